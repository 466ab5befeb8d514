"""KV compaction (``lookahead_kernels.kv_compact``) against its torch reference and against the rule itself (copy
row ``n + offset + path[j]`` to ``n + 1 + j`` in ascending ``j``); on the CPU under Triton's interpreter, on a GPU
compiled. A copy is exact, so every comparison is equality; rows nobody should touch hold NaN and must keep it."""

from __future__ import annotations

import pytest
import torch

from lookahead_kernels import compact_kv_reference
from tests.sm90_compile import run_compile_script

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(scope="module")
def ops():
    from lookahead_kernels import kv_compact

    return kv_compact


def make_case(L, B, S, H, D, offset, V, accept, dtype, device, seed=0):
    """Caches of random rows (NaN beyond each step, where nothing may be read or written), per-row starts, and
    accepted paths: ``accept[b]`` increasing node indices ``>= j`` among ``V``, then junk."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(L, B, S, H, D, generator=g).to(dtype)
    v = torch.randn(L, B, S, H, D, generator=g).to(dtype)
    lens = torch.randint(0, S - offset - V + 1, (B,), generator=g)
    for b in range(B):
        k[:, b, lens[b] + offset + V:] = float("nan")
        v[:, b, lens[b] + offset + V:] = float("nan")
    A = max(accept) + 1
    path = torch.full((B, A), -7, dtype=torch.long)  # junk past each row's accepted length is never read
    for b, a in enumerate(accept):
        path[b, :a] = torch.randperm(V, generator=g)[:a].sort().values
    return (k.to(device), v.to(device), lens.to(device), torch.tensor(accept, device=device), path.to(device))


def by_the_rule(k, v, lens, offset, accept, path):
    k, v = k.clone(), v.clone()
    for b in range(k.shape[1]):
        n = int(lens[b])
        for j in range(int(accept[b])):
            src = n + offset + int(path[b, j])
            k[:, b, n + 1 + j] = k[:, b, src]
            v[:, b, n + 1 + j] = v[:, b, src]
    return k, v


def same(a, b):
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


CASES = [
    # (L, B, S, Hkv, D, offset, V, accepted per row)
    (2, 1, 40, 3, 64, 1, 8, [3]),              # SmolLM2's row (192), one sequence, no window
    (3, 3, 64, 1, 16, 11, 20, [0, 5, 20]),     # a window before the tree; none, some and every node accepted
    (1, 2, 50, 8, 160, 4, 9, [9, 1]),          # a row of 1280 elements: two chunks
    (2, 4, 30, 2, 8, 1, 6, [1, 0, 6, 2]),      # chains of first children (in place), short rows
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("L,B,S,H,D,offset,V,accept", CASES)
def test_compact_kv_matches_the_rule_and_the_reference(ops, kernel_device, L, B, S, H, D, offset, V, accept, dtype):
    k, v, lens, acc, path = make_case(L, B, S, H, D, offset, V, accept, dtype, kernel_device)
    want_k, want_v = by_the_rule(k, v, lens, offset, acc, path)
    rk, rv = k.clone(), v.clone()
    compact_kv_reference(rk, rv, lens, offset, acc, path)
    assert same(rk, want_k) and same(rv, want_v)
    ops.compact_kv(k, v, lens, offset, acc, path)
    assert same(k, want_k) and same(v, want_v)


def test_compact_kv_on_a_narrowed_batch(ops, kernel_device):
    """A cache whose batch dimension was narrowed (finished rows left) is not contiguous: strides are honoured."""
    k, v, lens, acc, path = make_case(2, 4, 40, 2, 16, 3, 10, [2, 4, 0, 1], torch.float32, kernel_device, seed=3)
    want_k, want_v = by_the_rule(k, v, lens, 3, acc, path)
    outside = k[:, [0, 3]].clone(), v[:, [0, 3]].clone()
    ops.compact_kv(k[:, 1:3], v[:, 1:3], lens[1:3].clone(), 3, acc[1:3].clone(), path[1:3].clone())
    assert same(k[:, 1:3], want_k[:, 1:3]) and same(v[:, 1:3], want_v[:, 1:3])
    assert same(k[:, [0, 3]], outside[0]) and same(v[:, [0, 3]], outside[1])  # the other sequences untouched


def test_compact_kv_accepts_nothing_and_clamps(ops, kernel_device):
    k, v, lens, acc, path = make_case(1, 2, 30, 1, 8, 2, 5, [2, 2], torch.float32, kernel_device, seed=5)
    before = k.clone(), v.clone()
    ops.compact_kv(k, v, lens, 2, torch.zeros(2, dtype=torch.long, device=kernel_device), path)
    ops.compact_kv(k, v, lens, 2, torch.full((2,), -3, device=kernel_device), path)
    ops.compact_kv(k, v, lens, 2, acc, path[:, :0])
    assert same(k, before[0]) and same(v, before[1])
    want = by_the_rule(k, v, lens, 2, acc, path)
    ops.compact_kv(k, v, lens, 2, torch.full((2,), 99, device=kernel_device), path[:, :2])  # clamped to A = 2
    assert same(k, want[0]) and same(v, want[1])


def test_compact_kv_argument_errors(ops, kernel_device):
    k, v, lens, acc, path = make_case(1, 2, 30, 1, 8, 2, 5, [1, 2], torch.float32, kernel_device)
    for fn in (ops.compact_kv, compact_kv_reference):
        with pytest.raises(ValueError, match="k_cache and v_cache"):
            fn(k, v.half(), lens, 2, acc, path)
        with pytest.raises(ValueError, match="cache_len must be int64"):
            fn(k, v, lens.int(), 2, acc, path)
        with pytest.raises(ValueError, match="accept_len must be int64"):
            fn(k, v, lens, 2, acc[:1], path)
        with pytest.raises(ValueError, match="path must be int64"):
            fn(k, v, lens, 2, acc, path[0])
        with pytest.raises(ValueError, match="offset"):
            fn(k, v, lens, 0, acc, path)
    with pytest.raises(ValueError, match="contiguous"):
        ops.compact_kv(k.transpose(3, 4), v.transpose(3, 4), lens, 2, acc, path)


def test_opcheck(ops, kernel_device):
    k, v, lens, acc, path = make_case(1, 2, 30, 1, 8, 2, 5, [1, 2], torch.float32, kernel_device)
    torch.library.opcheck(torch.ops.lookahead.compact_kv, (k, v, lens, 2, acc, path),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


_SM90_SCRIPT = r'''
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from lookahead_kernels import kv_compact as kc

fn = kc._compact_kv_kernel
for dt, block in (("bf16", 1024), ("fp32", 256)):
    sig = {name: "i64" if name == "offset" else "i32" for name in fn.arg_names}
    sig.update(k_ptr="*" + dt, v_ptr="*" + dt, len_ptr="*i64", acc_ptr="*i64", path_ptr="*i64", BLOCK="constexpr")
    triton.compile(ASTSource(fn=fn, signature=sig, constexprs=dict(BLOCK=block)), target=GPUTarget("cuda", 90, 32),
                   options=dict(num_warps=4))
print("sm90 ok")
'''


def test_kernel_compiles_for_h100(kernel_device):
    run_compile_script(_SM90_SCRIPT, kernel_device)


@pytest.mark.gpu
def test_compact_kv_in_a_cuda_graph():
    """The launch holds no host synchronisation: captured once, replayed on new paths written in place."""
    k, v, lens, acc, path = make_case(2, 3, 64, 2, 32, 5, 12, [4, 0, 12], torch.bfloat16, "cuda", seed=9)
    k0, v0 = k.clone(), v.clone()
    from lookahead_kernels import compact_kv

    compact_kv(k, v, lens, 5, acc, path)  # compile outside the capture
    k.copy_(k0), v.copy_(v0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        compact_kv(k, v, lens, 5, acc, path)
    _, _, _, acc2, path2 = make_case(2, 3, 64, 2, 32, 5, 12, [2, 7, 1], torch.bfloat16, "cuda", seed=10)
    acc.copy_(acc2), path[:, :path2.shape[1]].copy_(path2)
    k.copy_(k0), v.copy_(v0)
    graph.replay()
    want = by_the_rule(k0, v0, lens, 5, acc, path)
    assert same(k, want[0]) and same(v, want[1])


@pytest.fixture(scope="module")
def cpu_compact():
    from lookahead_kernels.cpu_ops import cpu_ops_available, cpu_ops_error

    if not cpu_ops_available():
        pytest.skip(f"the CPU ops did not build: {cpu_ops_error()}")
    return torch.ops.lookahead_cpu.compact_kv


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("L,B,S,H,D,offset,V,accept", CASES)
def test_cpu_compact_kv_matches_the_rule(cpu_compact, L, B, S, H, D, offset, V, accept, dtype):
    """The CPU's C++ compaction (a row copy each) gives the rule's cache, NaN rows untouched."""
    k, v, lens, acc, path = make_case(L, B, S, H, D, offset, V, accept, dtype, "cpu", seed=L * B)
    want_k, want_v = by_the_rule(k, v, lens, offset, acc, path)
    cpu_compact(k, v, lens, offset, acc, path)
    assert same(k, want_k) and same(v, want_v)


def test_cpu_compact_kv_narrowed_clamped_and_refused(cpu_compact):
    """A narrowed batch's strides, nothing accepted, accept_len clamped to 0 .. A; arguments that do not fit and
    rows outside the cache refused before anything is written."""
    k, v, lens, acc, path = make_case(2, 4, 40, 2, 16, 3, 10, [2, 4, 0, 1], torch.float32, "cpu", seed=3)
    want_k, want_v = by_the_rule(k, v, lens, 3, acc, path)
    outside = k[:, [0, 3]].clone(), v[:, [0, 3]].clone()
    cpu_compact(k[:, 1:3], v[:, 1:3], lens[1:3].clone(), 3, acc[1:3].clone(), path[1:3].clone())
    assert same(k[:, 1:3], want_k[:, 1:3]) and same(v[:, 1:3], want_v[:, 1:3])
    assert same(k[:, [0, 3]], outside[0]) and same(v[:, [0, 3]], outside[1])
    k, v, lens, acc, path = make_case(1, 2, 30, 1, 8, 2, 5, [2, 2], torch.float32, "cpu", seed=5)
    before = k.clone(), v.clone()
    cpu_compact(k, v, lens, 2, torch.zeros(2, dtype=torch.long), path)
    cpu_compact(k, v, lens, 2, torch.full((2,), -3), path)
    assert same(k, before[0]) and same(v, before[1])
    want = by_the_rule(k, v, lens, 2, acc, path)
    cpu_compact(k, v, lens, 2, torch.full((2,), 99), path[:, :2])  # clamped to A = 2
    assert same(k, want[0]) and same(v, want[1])
    for args, match in (((k, v.half(), lens, 2, acc, path), "k_cache and v_cache"),
                        ((k, v, lens.int(), 2, acc, path), "cache_len and accept_len"),
                        ((k, v, lens, 2, acc, path[0]), "path must be"),
                        ((k, v, lens, 0, acc, path), "offset"),
                        ((k.transpose(3, 4), v.transpose(3, 4), lens, 2, acc, path), "contiguous"),
                        ((k, v, torch.tensor([0, 27]), 2, acc, path), r"outside the cache's 30 rows")):
        with pytest.raises(ValueError, match=match):
            cpu_compact(*args)
    assert same(k, want[0]) and same(v, want[1])  # nothing written by a refused call
