"""The C++ n-gram pool against the Python reference (lookahead/pool.py), plus make_pool's choices."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lookahead.config import LookaheadConfig
from lookahead.pool import NGramPool
from lookahead.pools import CppNGramPool, TableNGramPool, lookup_rows, make_pool
from lookahead_kernels import pool_ext
from lookahead_kernels.pool_ext import PoolExtensionError, load_pool_extension

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def cpp_loader():
    """Builds the C++ extension once per session (a build failure fails the tests: CI has g++ and ninja)."""
    load_pool_extension()
    return load_pool_extension


# ---------------------------------------------------------------- property test: random operation sequences

@st.composite
def scenarios(draw):
    """(vocab, ngram, guess, ops); ops are ("insert", rows) | ("seq", tokens) | ("lookup", key)."""
    vocab = draw(st.integers(1, 8))
    ngram = draw(st.integers(2, 5))
    guess = draw(st.integers(0, 4))
    token = st.integers(0, vocab - 1)
    row = st.lists(token, min_size=ngram, max_size=ngram)
    # A small stock of rows drawn from again and again gives shared keys and exact duplicates within a batch.
    stock = draw(st.lists(row, min_size=1, max_size=4))
    any_row = st.one_of(st.sampled_from(stock), row)
    op = st.one_of(
        st.tuples(st.just("insert"), st.lists(any_row, max_size=7)),
        st.tuples(st.just("seq"), st.lists(token, max_size=12)),
        st.tuples(st.just("lookup"), token),
    )
    return vocab, ngram, guess, draw(st.lists(op, max_size=14))


def assert_same_lookup(ref: NGramPool, pool: TableNGramPool, key: int) -> None:
    want = ref.lookup(key)
    assert torch.equal(pool.lookup(key), want), f"lookup({key})"
    assert torch.equal(lookup_rows([pool], [key])[0], want), f"lookup_rows([{key}])"
    out, count = pool.lookup_padded(torch.tensor(key))
    assert out.shape == (pool.guess, pool.ngram - 1) and out.dtype == torch.long and count.dim() == 0
    count = int(count)
    assert count == want.shape[0]
    assert torch.equal(out[:count], want)
    assert bool((out[count:] == -1).all())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(scenario=scenarios())
def test_cpp_pool_matches_reference(cpp_loader, scenario):
    vocab, ngram, guess, ops = scenario
    ref = NGramPool(ngram, guess)
    pool = CppNGramPool(ngram, guess, vocab, loader=cpp_loader)
    for kind, arg in ops:
        if kind == "insert":
            rows = torch.tensor(arg, dtype=torch.long).reshape(-1, ngram)
            ref.insert(rows)
            pool.insert(rows)
        elif kind == "seq":
            tokens = torch.tensor(arg, dtype=torch.long)
            ref.insert_sequence(tokens)
            pool.insert_sequence(tokens)
        else:
            assert_same_lookup(ref, pool, arg)
    for key in range(vocab):
        assert_same_lookup(ref, pool, key)
    assert len(pool) == len(ref)


# ---------------------------------------------------------------- edge cases, C++ pool

def test_move_to_end_and_eviction(cpp_loader):
    pool = CppNGramPool(3, 2, 10, loader=cpp_loader)
    pool.insert(torch.tensor([[1, 2, 3], [1, 4, 4], [1, 2, 3]]))  # (2, 3) again: moves to the newest end
    assert pool.lookup(1).tolist() == [[4, 4], [2, 3]]
    pool.insert(torch.tensor([[1, 5, 5]]))  # over G: drops the oldest, (4, 4)
    assert pool.lookup(1).tolist() == [[2, 3], [5, 5]]
    assert pool.lookup(2).shape == (0, 2) and len(pool) == 2


def test_duplicates_within_one_batch(cpp_loader):
    pool = CppNGramPool(2, 3, 10, loader=cpp_loader)
    pool.insert(torch.tensor([[7, 1], [7, 1], [7, 2], [7, 1], [7, 3], [7, 4]]))
    assert pool.lookup(7).tolist() == [[1], [3], [4]]


def test_lookup_changes_nothing(cpp_loader):
    pool = CppNGramPool(2, 2, 10, loader=cpp_loader)
    pool.insert(torch.tensor([[0, 1], [0, 2]]))
    before = (pool.conts.clone(), pool.stamp.clone(), pool.clock.clone())
    pool.lookup(0), pool.lookup_padded(torch.tensor(0)), pool.lookup(5)
    assert all(torch.equal(a, b) for a, b in zip(before, (pool.conts, pool.stamp, pool.clock)))
    pool.insert(torch.tensor([[0, 3]]))  # so (0, 1) is still the oldest
    assert pool.lookup(0).tolist() == [[2], [3]]


def test_guess_zero_stores_nothing(cpp_loader):
    pool = CppNGramPool(3, 0, 10, loader=cpp_loader)
    pool.insert_sequence(torch.arange(10))
    out, count = pool.lookup_padded(torch.tensor(1))
    assert out.shape == (0, 2) and int(count) == 0 and len(pool) == 0 and pool.lookup(1).shape == (0, 2)


def test_int32_inputs_and_short_sequences(cpp_loader):
    pool = CppNGramPool(4, 3, 10, loader=cpp_loader)
    pool.insert_sequence(torch.tensor([1, 2, 3], dtype=torch.int32))  # shorter than N: nothing
    assert len(pool) == 0
    pool.insert(torch.tensor([[1, 2, 3, 4]], dtype=torch.int32))
    assert pool.lookup(torch.tensor(1, dtype=torch.int32)).tolist() == [[2, 3, 4]]


def test_padded_lookup_layout(cpp_loader):
    pool = CppNGramPool(3, 4, 10, loader=cpp_loader)
    pool.insert(torch.tensor([[9, 0, 1], [9, 2, 3]]))
    out, count = pool.lookup_padded(torch.tensor(9))
    assert out.dtype == torch.long and count.dtype == torch.long and count.shape == ()
    assert out.tolist() == [[0, 1], [2, 3], [-1, -1], [-1, -1]] and int(count) == 2


def test_a_batch_s_lookups_in_one_call_equal_each_pool_s(cpp_loader):
    # Table pools of different shapes, a Python pool and a row without one, in one call.
    pools = [CppNGramPool(3, 4, 10, loader=cpp_loader), None, NGramPool(3, 2),
             CppNGramPool(4, 2, 20, loader=cpp_loader), CppNGramPool(3, 0, 10, loader=cpp_loader)]
    gen = torch.Generator().manual_seed(5)
    for pool in pools:
        if pool is not None:
            pool.insert_sequence(torch.randint(0, 6, (40,), generator=gen))
    for keys in ([1, 0, 1, 2, 1], [9, 3, 7, 19, 0], [2, 2, 2, 2, 2]):
        got = lookup_rows(pools, keys)
        assert got[1].shape == (0, 0)
        for pool, key, rows in zip(pools, keys, got):
            if pool is not None:
                assert torch.equal(rows, pool.lookup(key)), (pool, key)
    assert sum(len(r) for r in lookup_rows(pools, [1] * 5)) > 0
    with pytest.raises(ValueError, match=r"key must be in \[0, 20\), got 20 for row 1"):
        lookup_rows([pools[0], pools[3]], [0, 20])
    assert lookup_rows([], []) == []


@pytest.mark.parametrize("bad", [[[1, 2, 10]], [[-1, 2, 3]], [[1, 2, 3], [10, 0, 0]]])
def test_out_of_range_insert_is_rejected_and_changes_nothing(cpp_loader, bad):
    pool = CppNGramPool(3, 2, 10, loader=cpp_loader)
    pool.insert(torch.tensor([[1, 2, 3]]))
    with pytest.raises(ValueError, match=r"\[0, 10\)"):
        pool.insert(torch.tensor(bad))
    with pytest.raises(ValueError, match=r"\[0, 10\)"):
        pool.insert_sequence(torch.tensor([1, 2, 3, 99]))
    with pytest.raises(ValueError, match=r"\[0, 10\)"):
        pool.insert_sequence(torch.tensor([99]))  # too short to insert, still checked
    assert pool.lookup(1).tolist() == [[2, 3]] and len(pool) == 1 and int(pool.clock) == 1


@pytest.mark.parametrize("ngrams, what", [
    (torch.tensor([[1, 2]]), r"\[K, 3\]"),
    (torch.tensor([1, 2, 3]), r"\[K, 3\]"),
    (torch.tensor([[1.0, 2.0, 3.0]]), "integer"),
    (torch.tensor([[True, False, True]]), "integer"),
    ([[1, 2, 3]], "torch.Tensor"),
])
def test_bad_ngrams_are_rejected(cpp_loader, ngrams, what):
    pool = CppNGramPool(3, 2, 10, loader=cpp_loader)
    with pytest.raises(ValueError, match=what):
        pool.insert(ngrams)


@pytest.mark.parametrize("key", [10, -1, torch.tensor(10), torch.tensor([1, 2]), 1.0, True, torch.tensor(0.0)])
def test_bad_keys_are_rejected(cpp_loader, key):
    pool = CppNGramPool(3, 2, 10, loader=cpp_loader)
    with pytest.raises(ValueError):
        pool.lookup(key)
    with pytest.raises(ValueError):
        pool.lookup_padded(key)


@pytest.mark.parametrize("args", [(1, 2, 10), (3, -1, 10), (3, 2, 0), (3, 2, 2**31)])
def test_bad_sizes_are_rejected(cpp_loader, args):
    with pytest.raises(ValueError):
        CppNGramPool(*args, loader=cpp_loader)


def test_ops_check_their_inputs(cpp_loader):
    ops = cpp_loader()
    conts = torch.zeros(4, 2, 2, dtype=torch.int32)
    stamp = torch.full((4, 2), -1, dtype=torch.long)
    with pytest.raises(ValueError, match="stamp must be"):
        ops.lookup(conts, stamp[:, :1].contiguous(), torch.tensor(0))
    with pytest.raises(ValueError, match="clock must be"):
        ops.insert(conts, stamp, torch.zeros(2, dtype=torch.long), torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="ngrams must be"):
        ops.insert(conts, stamp, torch.zeros(1, dtype=torch.long), torch.zeros(1, 3, dtype=torch.int32))


# ---------------------------------------------------------------- make_pool

def failing_loader():
    raise PoolExtensionError("simulated build failure")


def test_make_pool_explicit_backends(cpp_loader):
    cfg = LookaheadConfig(ngram=4, guess=3)
    py = make_pool(dataclass_replace(cfg, pool_backend="python"), 100)
    assert isinstance(py, NGramPool) and (py.ngram, py.guess) == (4, 3)
    cpp = make_pool(dataclass_replace(cfg, pool_backend="cpp"), 100, loader=cpp_loader)
    assert isinstance(cpp, CppNGramPool) and cpp.conts.shape == (100, 3, 3) and cpp.vocab_size == 100
    with pytest.raises(PoolExtensionError, match="simulated"):
        make_pool(dataclass_replace(cfg, pool_backend="cpp"), 100, loader=failing_loader)
    with pytest.raises(ValueError, match="vocab_size"):
        make_pool(cfg, 0, loader=cpp_loader)


def test_the_removed_cuda_backend_is_refused_with_the_allowed_values():
    with pytest.raises(ValueError, match="pool_backend must be one of 'auto', 'python', 'cpp', got 'cuda'"):
        LookaheadConfig(pool_backend="cuda")


def test_make_pool_auto_uses_cpp_without_warning(cpp_loader):
    # The draft is built on the host: the C++ pool serves a GPU's decoding too (the pool takes no device).
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pool = make_pool(LookaheadConfig(), 50, loader=cpp_loader)
    assert isinstance(pool, CppNGramPool)


def test_make_pool_auto_falls_back_to_python_with_a_reason():
    # No other pool to try in between: the Python pool, with the C++ pool's reason, warned once.
    with pytest.warns(RuntimeWarning, match="Python n-gram pool.*C\\+\\+ pool unavailable.*simulated build failure") \
            as caught:
        pool = make_pool(LookaheadConfig(ngram=3, guess=2), 50, loader=failing_loader)
    assert isinstance(pool, NGramPool) and len(caught) == 1


def dataclass_replace(cfg, **changes):
    import dataclasses

    return dataclasses.replace(cfg, **changes)


# ---------------------------------------------------------------- building

def test_build_failure_carries_the_compiler_message(tmp_path, monkeypatch):
    (tmp_path / "ngram_pool.cpp").write_text("this is not C++;\n")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setattr(pool_ext, "_CSRC", tmp_path)
    monkeypatch.setattr(pool_ext, "_CPU_NAME", "lookahead_pool_broken_for_test")
    monkeypatch.setattr(pool_ext, "_has_kernel", lambda: False)
    with pytest.raises(PoolExtensionError, match="(?s)lookahead_pool_broken_for_test.*ngram_pool.cpp.*error"):
        load_pool_extension()


def test_a_failed_build_is_not_tried_again(monkeypatch):
    # Every lookahead call makes its rows' pools ("auto" then falls back to Python): one compile per process.
    tries = []

    def broken(name, sources, verbose):
        tries.append(name)
        raise PoolExtensionError(f"building {name} failed: simulated compiler error")

    monkeypatch.setattr(pool_ext, "_CPU_NAME", "lookahead_pool_never_built_for_test")
    monkeypatch.setattr(pool_ext, "_has_kernel", lambda: False)
    monkeypatch.setattr(pool_ext, "_build", broken)
    monkeypatch.setattr(pool_ext, "_FAILED", {})
    for _ in range(3):
        with pytest.raises(PoolExtensionError, match="lookahead_pool_never_built_for_test failed: simulated"):
            load_pool_extension()
    assert tries == ["lookahead_pool_never_built_for_test"]
    with pytest.warns(RuntimeWarning, match="Python n-gram pool.*simulated compiler error"):
        assert isinstance(make_pool(LookaheadConfig(), 50), NGramPool)
    assert len(tries) == 1


def test_importing_builds_nothing(tmp_path):
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))
    code = "import lookahead.pools, lookahead_kernels.pool_ext, lookahead_kernels; lookahead_kernels.load_pool_extension"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, check=True)
    assert not (tmp_path / "ext").exists()
