"""The C++ draft builder (``csrc/draft_tree.cpp``) against its Python reference in ``lookahead.draft``: the same
candidates, order, scores and keys, the same encoded trees, on random builder states."""

import random

import pytest
import torch

from lookahead import DraftMemory, LookaheadConfig
from lookahead.draft import (NUM_CODES, AcceptanceStats, DraftBuilder, Proposals, code_key, encode_rows, key_code,
                             propose_rows, record_trials, record_trials_reference)
from lookahead.successors import SuccessorTable, pack_tops, record_step, record_step_reference
from lookahead.suffix import SuffixIndex, suffix_spans
from lookahead_kernels.cpu_ops import cpu_ops_available
from lookahead_kernels.tree import TreeShape, check_tree

pytestmark = pytest.mark.skipif(not cpu_ops_available(), reason="the C++ ops could not be built here")


def random_builder(seed: int, vocab: int, sources=("pool", "suffix", "successors"), ngram=4, guess=6):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    cfg = LookaheadConfig(window=3, ngram=ngram, guess=guess, pool_backend="cpp", sources=sources)
    b = DraftBuilder(cfg, vocab, native=True, memory=_random_memory(seed, vocab) if seed % 3 == 0 else None)
    # Few distinct tokens: sources propose the same tokens, tries share prefixes, scores tie.
    prompt = torch.randint(0, min(vocab, 12), (rng.randint(2, 80),), generator=gen)
    if seed % 2:  # a motif repeated with a few changes: suffix matches of every length class (up to 8+)
        motif = torch.randint(0, min(vocab, 12), (rng.randint(3, 12),), generator=gen)
        prompt = motif.repeat(rng.randint(2, 8))
        prompt[torch.randint(0, len(prompt), (rng.randint(0, 4),), generator=gen)] = rng.randrange(min(vocab, 12))
    b.start(prompt)
    if b.successors is not None:
        rows = rng.randint(0, 3 * vocab)
        logits = torch.randn(rows, vocab, generator=gen) * rng.choice([0.5, 2.0, 6.0])
        if rng.random() < 0.3:  # exact ties among the top k
            logits = logits.round()
        b.successors.update(torch.randint(0, vocab, (rows,), generator=gen), logits)
    for _ in range(rng.randint(0, 300)):
        b.stats.record_code(rng.randrange(NUM_CODES), rng.random() < 0.4)
    return b, prompt.tolist()


def _random_memory(seed: int, vocab: int) -> DraftMemory:
    """A draft memory of a few sequences over the builders' few tokens: its matches join the suffix source's."""
    rng = random.Random(-seed - 1)
    memory = DraftMemory(max_match=rng.choice([2, 8]), max_len=rng.choice([3, 32]))
    for _ in range(rng.randint(1, 4)):
        memory.add([rng.randrange(min(vocab, 12)) for _ in range(rng.randint(3, 60))])
    return memory


def propose_both(b, sequence, budget):
    b.native = True
    native = b.propose(sequence, budget)
    b.native = False
    ref = b.propose(sequence, budget)
    return native, ref


@pytest.mark.parametrize("seed", range(40))
def test_native_proposal_equals_the_reference(seed):
    vocab = [7, 50, 300][seed % 3]
    sources = [("pool", "suffix", "successors"), ("successors",), ("pool",), ("suffix", "successors"),
               ("pool", "suffix")][seed % 5]
    b, seq = random_builder(seed, vocab, sources, ngram=2 + seed % 4)
    for budget in (0, 1, 2, 5, 15, 63, 255):
        native, ref = propose_both(b, seq, budget)
        assert len(native) == len(ref) <= budget
        assert torch.equal(native.tokens, ref.tokens)
        assert torch.equal(native.parents, ref.parents)
        assert native.scores == ref.scores  # the same doubles, multiplied in the same order
        assert torch.equal(native.codes, ref.codes) and torch.equal(native.code_offsets, ref.code_offsets)
        assert all(-1 <= p < i for i, p in enumerate(native.parents.tolist()))
        parents = native.parents.tolist()
        for i in range(-1, len(native)):  # at most one child is accepted: their estimates sum to at most 1
            children = sum(s for s, q in zip(native.scores, parents) if q == i)
            assert children <= (1.0 if i < 0 else native.scores[i]) * (1 + 1e-12)


@pytest.mark.parametrize("seed", range(20))
def test_native_encoding_equals_the_reference(seed):
    rng = random.Random(seed)
    b, seq = random_builder(100 + seed, 40)
    proposal = b.propose(seq, rng.choice([3, 16, 64, 200]))
    for keep in sorted({0, 1, len(proposal) // 2, len(proposal)}):
        size = keep + rng.choice([0, 0, 3])
        b.native = True
        native = b.encode(proposal, keep, size)
        b.native = False
        ref = b.encode(proposal, keep, size)
        assert native.num_nodes == ref.num_nodes == keep and native.size == ref.size == size
        assert torch.equal(native.tokens, ref.tokens)
        assert torch.equal(native.shape.depth, ref.shape.depth) and torch.equal(native.shape.end, ref.shape.end)
        assert native.parents == ref.parents and native.codes == ref.codes and native.max_depth == ref.max_depth
        if size:
            check_tree(native.shape.depth, native.shape.end)
            assert native.shape.parents().tolist()[:keep] == native.parents


def test_successor_records_match_the_python_fallback():
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 20, (200,), generator=gen)  # many repeats: the last row for a token must win
    logits = torch.randn(200, 20, generator=gen)
    native = SuccessorTable(20, 5)
    native.update(tokens, logits)
    ids, probs = SuccessorTable.top(logits, 5)
    want = {}
    for t, i, p in zip(tokens.tolist(), ids, probs):
        want[t] = list(zip(i.tolist(), p.tolist()))
    assert all(native.successors(t) == want.get(t, []) for t in range(20)) and native.recorded == len(want)
    with pytest.raises(ValueError, match=r"\[0, 20\)"):
        native.record(torch.tensor([20]), ids[:1], probs[:1])


@pytest.mark.parametrize("seed", range(6))
def test_a_batch_s_proposals_and_trees_equal_each_row_s_reference(seed):
    # Rows of different sources and vocabularies in one call: each row reads its own candidates, rates and table.
    rng = random.Random(seed)
    rows = [random_builder(1000 * seed + i, rng.choice([7, 50, 300]),
                           rng.choice([("pool", "suffix", "successors"), ("successors",), ("pool", "suffix"),
                                       ("suffix",)]), ngram=rng.randint(2, 5)) for i in range(rng.randint(2, 6))]
    builders, sequences = [b for b, _ in rows], [seq for _, seq in rows]
    budget = rng.choice([1, 5, 16, 63])
    batch = propose_rows(builders, sequences, budget)
    refs = []
    for b, seq in zip(builders, sequences):
        b.native = False
        refs.append(b.propose(seq, budget))
        b.native = True
    assert len(batch) == len(refs)
    for i, ref in enumerate(refs):
        got = batch.row(i)
        assert torch.equal(got.tokens, ref.tokens) and torch.equal(got.parents, ref.parents)
        assert got.scores == ref.scores
        assert torch.equal(got.codes, ref.codes) and torch.equal(got.code_offsets, ref.code_offsets)
    concat = Proposals.concat(refs)
    for name in ("tokens", "parents", "codes", "code_offsets"):
        assert torch.equal(getattr(concat, name), getattr(batch, name)), name
    assert concat.starts == batch.starts and concat.scores == batch.scores
    picks = list(range(len(refs))) + [-1]  # a parked row last: no node, all padding
    rng.shuffle(picks)
    keeps = [rng.randint(0, len(refs[i])) if i >= 0 else 0 for i in picks]
    size = max(keeps) + rng.choice([0, 2])
    native = encode_rows(batch, picks, keeps, size, native=True)
    ref = encode_rows(batch, picks, keeps, size, native=False)
    for name in ("tokens", "depth", "end"):
        assert getattr(native, name).shape == (len(picks), size)
        assert torch.equal(getattr(native, name), getattr(ref, name)), name
    for a, b in zip(native.trees, ref.trees):
        assert a.num_nodes == b.num_nodes and a.parents == b.parents and a.codes == b.codes
        assert a.max_depth == b.max_depth and torch.equal(a.tokens, b.tokens)
        assert torch.equal(a.shape.depth, b.shape.depth) and torch.equal(a.shape.end, b.shape.end)


@pytest.mark.parametrize("seed", range(8))
def test_a_tree_step_encoded_and_packed_in_one_call_equals_the_reference_path(seed):
    """``build_tree_step`` (the C++ ``encode_step``) gives the block and trees that the Python encoding, the step's
    tokens stacked and the NumPy packing give (``encode_rows(native=False)``, ``build_step(pack=True)``): every
    int of the block, and each tree's nodes, parents, codes and encoding."""
    from lookahead.step import build_step, build_tree_step
    from lookahead.window import stack_step_tokens

    rng = random.Random(seed)
    rows = [random_builder(500 * seed + i, rng.choice([7, 50, 300])) for i in range(rng.randint(1, 5))]
    proposals = propose_rows([b for b, _ in rows], [seq for _, seq in rows], rng.choice([1, 5, 16, 40]))
    picks = list(range(len(rows))) + [-1] * rng.randint(0, 2)  # parked rows: no node, all padding
    rng.shuffle(picks)
    keeps = [rng.randint(0, len(proposals.scores[i])) if i >= 0 else 0 for i in picks]
    size = max(keeps) + rng.choice([0, 3])
    window, levels = rng.choice([(1, 1), (3, 2), (4, 1)])
    B, width = len(picks), window * levels
    xs = [rng.randrange(300) for _ in range(B)]
    positions = [rng.randrange(1000) for _ in range(B)]
    window_tokens = stack_step_tokens([None] * B, xs, 1) if width == 1 else torch.randint(0, 300, (B, width))
    window_tokens[:, 0] = torch.tensor(xs)
    step, trees = build_tree_step(positions, xs, None if width == 1 else window_tokens.clone(), levels, window,
                                  proposals, picks, keeps, size, {})
    ref_trees = encode_rows(proposals, picks, keeps, size, native=False)
    ref = build_step(positions, window_tokens, levels, window, ref_trees, "cpu", pack=True)
    assert step.packed.dtype == torch.long and torch.equal(step.packed, ref.packed)
    for name in ("tokens", "positions", "logits_rows", "logits_tokens", "num_nodes"):
        assert torch.equal(getattr(step, name), getattr(ref, name)), name
    assert step.layout.T == ref.layout.T and step.node_rows == ref.node_rows
    for name in ("tokens", "depth", "end"):
        assert torch.equal(getattr(trees, name), getattr(ref_trees, name)), name
    for a, b in zip(trees.trees, ref_trees.trees, strict=True):
        assert a.num_nodes == b.num_nodes and a.parents == b.parents and a.codes == b.codes
        assert a.max_depth == b.max_depth and torch.equal(a.tokens, b.tokens)
        assert torch.equal(a.shape.depth, b.shape.depth) and torch.equal(a.shape.end, b.shape.end)


def _random_path(rng: random.Random, parents: list[int]) -> list[int]:
    """A verifier's accepted nodes in a tree of pre-order ``parents``: a chain from a child of x, cut at random."""
    path, at = [], -1
    while True:
        children = [i for i, p in enumerate(parents) if p == at]
        if not children or rng.random() < 0.25:
            return path
        at = rng.choice(children)
        path.append(at)


def _copied_stats(stats: AcceptanceStats) -> AcceptanceStats:
    copy = AcceptanceStats()
    copy.trials.copy_(stats.trials)
    copy.rates.copy_(stats.rates)
    return copy


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("seed", range(10))
def test_a_batch_s_trials_recorded_in_one_call_equal_the_reference(seed, packed):
    """``record_trials`` on the C++ encoding (``encode_rows`` or ``build_tree_step``) counts the same trials and
    computes the same rates, double for double, as the Python reference row by row, over several steps; parked
    rows (no node) and rows left out of the call learn nothing."""
    from lookahead.step import build_tree_step

    rng = random.Random(seed)
    rows = [random_builder(700 * seed + i, rng.choice([7, 50, 300])) for i in range(rng.randint(1, 5))]
    builders = [b for b, _ in rows]
    refs = [_copied_stats(b.stats) for b in builders]
    for _ in range(4):
        proposals = propose_rows(builders, [seq for _, seq in rows], rng.choice([1, 5, 16, 40]))
        picks = list(range(len(rows))) + [-1] * rng.randint(0, 2)
        rng.shuffle(picks)
        keeps = [rng.randint(0, len(proposals.scores[i])) if i >= 0 else 0 for i in picks]
        size = max(keeps) + rng.choice([0, 3])
        if packed:
            B = len(picks)
            _, trees = build_tree_step([10] * B, [1] * B, None, 1, 1, proposals, picks, keeps, size, {})
        else:
            trees = encode_rows(proposals, picks, keeps, size, native=True)
        assert trees.encoding is not None
        learned = [b for b, i in enumerate(picks) if i >= 0 and rng.random() < 0.8]
        paths = [_random_path(rng, trees.trees[b].parents) for b in learned]
        record_trials([builders[picks[b]] for b in learned], trees, learned, paths)
        for b, path in zip(learned, paths):
            record_trials_reference(refs[picks[b]], trees.trees[b], path)
    for builder, ref in zip(builders, refs):
        assert torch.equal(builder.stats.trials, ref.trials)
        assert torch.equal(builder.stats.rates, ref.rates)  # the same arithmetic in the same order
        assert builder.stats.tested == ref.tested and builder.stats.accepted == ref.accepted


def test_trials_from_the_python_encoding_are_recorded_by_the_reference():
    b, seq = random_builder(3, 50)
    ref = _copied_stats(b.stats)
    proposals = propose_rows([b], [seq], 16)
    trees = encode_rows(proposals, [0], [len(proposals.scores[0])], len(proposals.scores[0]), native=False)
    assert trees.encoding is None
    path = _random_path(random.Random(0), trees.trees[0].parents)
    record_trials([b], trees, [0], [path])
    record_trials_reference(ref, trees.trees[0], path)
    assert torch.equal(b.stats.trials, ref.trials) and torch.equal(b.stats.rates, ref.rates)


def test_record_trials_refuses_what_does_not_fit_and_writes_nothing():
    record = torch.ops.lookahead_draft.record_trials
    trials, rates = torch.zeros(2, 8, dtype=torch.long), torch.full((8,), 0.5, dtype=torch.float64)
    priors = torch.full((8,), 0.5, dtype=torch.float64)
    codes, offsets = torch.tensor([1, 2, 3]), torch.tensor([0, 1, 2, 3])
    parents, order = torch.tensor([-1, 0, -1]), torch.tensor([0, 1, 2])
    record([trials], [rates], priors, 4.0, codes, offsets, parents, order, [0], [0], [3], [1], [0])  # fits
    assert trials.tolist() == [[0, 1, 1, 1, 0, 0, 0, 0], [0, 1, 0, 0, 0, 0, 0, 0]]
    assert rates[1] == (1 + 4.0 * 0.5) / (1 + 4.0) and rates[2] == 2.0 / 5.0 and rates[0] == 0.5
    before = (trials.clone(), rates.clone())
    good = ([trials], [rates], priors, 4.0, codes, offsets, parents, order, [0], [0], [3], [1], [0])
    for i, bad, match in ((0, [trials.int()], "trials\\[0\\] must be"), (1, [rates[:4]], "must hold 8"),
                          (2, priors.float(), "priors"), (4, torch.tensor([1, 9, 3]), "code 9 outside"),
                          (5, torch.tensor([0, 2, 1, 3]), "code_offsets must rise"),
                          (6, torch.tensor([-1, 2, -1]), "parent 2"), (7, torch.tensor([0, 3, 2]), "best-first"),
                          (8, [1], "first"), (10, [4], "keep"), (11, [2], "path_counts sum"),
                          (12, [3], "outside its 3 real nodes"), (9, [0, 0], "one trials")):
        args = list(good)
        args[i] = bad
        with pytest.raises(ValueError, match=match):
            record(*args)
        assert torch.equal(trials, before[0]) and torch.equal(rates, before[1])


def test_the_host_bindings_compute_and_refuse_as_the_torch_ops_do():
    """The loop's per-step calls go through ``host_ops()`` (pybind11), the same C++ functions as the torch ops: the
    same outputs, and the same errors (``ValueError`` where the op says ``TORCH_CHECK_VALUE``)."""
    from lookahead_kernels.cpu_ops import host_ops

    ops = host_ops()
    parents, tokens = torch.tensor([-1, 0, -1]), torch.tensor([5, 6, 7])
    head, rows = torch.zeros(1, dtype=torch.long), torch.arange(4)
    args = (parents, tokens, [0, 1], [3, 0], 3, [10, 20], [1, 2], None, head, rows)
    for a, b in zip(ops.encode_step(*args), torch.ops.lookahead_draft.encode_step(*args)):
        assert torch.equal(a, b)
    for a, b in zip(ops.encode(parents, tokens, [0], [3], 4), torch.ops.lookahead_draft.encode(parents, tokens, [0],
                                                                                               [3], 4)):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="keep <= size"):
        ops.encode_step(parents, tokens, [0, 1], [3, 0], 2, [10, 20], [1, 2], None, head, rows)
    with pytest.raises(RuntimeError, match="parent of node 0"):
        ops.encode(torch.tensor([0]), torch.tensor([5]), [0], [1], 1)
    trials, rates = torch.zeros(2, 8, dtype=torch.long), torch.zeros(8, dtype=torch.float64)
    with pytest.raises(ValueError, match="path_counts sum"):
        ops.record_trials([trials], [rates], torch.zeros(8, dtype=torch.float64), 4.0, torch.tensor([1]),
                          torch.tensor([0, 1]), torch.tensor([-1]), torch.tensor([0]), [0], [0], [1], [2], [0])
    with pytest.raises(RuntimeError, match="one root"):
        ops.propose([1, 2], [], [], [], [0], [], [], [], [], 4)
    with pytest.raises(RuntimeError, match="one length"):
        ops.suffix_spans([torch.zeros(4, dtype=torch.long)], [], [], [0], 2, 4, 4)
    none = torch.empty(0, dtype=torch.int32)
    table = ([torch.full((0, 1), -1, dtype=torch.long)] * 2, [torch.full((NUM_CODES,), 0.5, dtype=torch.float64)] * 2,
             [none] * 2, [none] * 2)
    buffers = [torch.zeros(8, dtype=torch.long)] * 2
    with pytest.raises(ValueError, match="one buffer per matched row"):
        ops.propose_matched([1, 2], buffers, [0, 0], [], [0, 0], [1], 2, 4, 4, *table, 4)
    with pytest.raises(ValueError, match="must rise"):
        ops.propose_matched([1, 2], buffers, [0, 0], [], [0, 0], [1, 0], 2, 4, 4, *table, 4)
    seq = [3, 1, 2, 3, 1]
    got = ops.propose_matched([1, 1], buffers[:1], [0], seq, [5], [1], 2, 4, 4, *table, 4)
    spans = ops.suffix_spans([torch.zeros(8, dtype=torch.long)], [0], seq, [5], 2, 4, 4)
    want = ops.propose([1, 1], spans[0], spans[1], spans[2], [0, spans[3][0]], *table, 4)
    assert spans[3][0] > 0 and all(torch.equal(a, b) for a, b in zip(got, want))
    with pytest.raises(RuntimeError, match="one index and one entries"):
        ops.record_successors([], [torch.zeros(3, dtype=torch.int32)], torch.zeros(1, 1, dtype=torch.long),
                              torch.zeros(1, 2, 1, 1, dtype=torch.int32), [], [], [], [])


def test_encode_step_refuses_inputs_that_do_not_fit():
    encode_step = torch.ops.lookahead_draft.encode_step
    parents, tokens = torch.tensor([-1, 0, -1]), torch.tensor([5, 6, 7])
    head, rows = torch.zeros(1, dtype=torch.long), torch.arange(4)
    encode_step(parents, tokens, [0, 1], [3, 0], 3, [10, 20], [1, 2], None, head, rows)  # fits
    window = torch.zeros(2, 3, dtype=torch.long)
    for args, match in (((parents, tokens[:2], [0, 1], [3, 0], 3, [10, 20], [1, 2], None, head, rows), "tokens"),
                        ((parents, tokens, [0], [3, 0], 3, [10, 20], [1, 2], None, head, rows), "one start"),
                        ((parents, tokens, [0, 1], [3, 0], 3, [10, 20], [1], None, head, rows), "one start"),
                        ((parents, tokens, [0, 1], [3, 0], 2, [10, 20], [1, 2], None, head, rows), "keep <= size"),
                        ((parents, tokens, [0, 1], [3, 3], 3, [10, 20], [1, 2], None, head, rows), "start \\+ keep"),
                        ((parents, tokens, [0, 1], [3, 0], 3, [10, 20], [1, 2], window.int(), head, rows),
                         "window_tokens"),
                        ((parents, tokens, [0, 1], [3, 0], 3, [10, 20], [1, 2], window, head, rows), "offsets"),
                        ((parents, tokens, [0, 1], [3, 0], 3, [10, 20], [1, 2], None, head, rows[None]), "rows")):
        with pytest.raises(ValueError, match=match):
            encode_step(*args)
    with pytest.raises(RuntimeError, match="parent of node 0"):
        encode_step(torch.tensor([0]), torch.tensor([5]), [0], [1], 1, [3], [1], None, head, rows)


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("n,R,j,vocab", [(1, 1, 1, 12), (3, 17, 5, 12), (16, 40, 8, 12), (16, 40, 8, 300)])
def test_a_step_s_successor_records_match_the_python_reference(n, R, j, vocab, shared):
    # Few tokens: rows repeat them, and the last row for a token must win; many: the entries grow, in place.
    gen = torch.Generator().manual_seed(n * 100 + R + vocab)
    B = n + 2  # batch rows no table reads (parked), and tables reading rows out of order
    tokens = torch.randint(0, vocab, (B, R + 3), generator=gen)
    ids = torch.randint(0, vocab, (B, R, j), generator=gen)
    probs = torch.rand(B, R, j, generator=gen)
    # As a step reads them back: each batch row's tops contiguous behind its other results.
    back = torch.cat([torch.randint(0, 9, (B, 5), dtype=torch.int32, generator=gen),
                      pack_tops(ids, probs).reshape(B, -1)], dim=1)
    tops = back[:, 5:].view(B, 2, R, j)
    rows = torch.randperm(B, generator=gen)[:n].tolist()
    computed = torch.randint(1, R + 1, (n,), generator=gen).tolist()
    last = [sorted(set(torch.randint(0, c, (3,), generator=gen).tolist())) for c in computed]
    native = [SuccessorTable(vocab, 8) for _ in range(1 if shared else n)]
    ref = [SuccessorTable(vocab, 8) for _ in range(1 if shared else n)]
    for table in native + ref:  # a stale value beyond j must survive: only the first j of an entry are written
        table._made()[1].fill_(-7)
    for step in range(2):  # the second step rewrites entries the first made
        record_step(native * (n if shared else 1), tokens, tops, rows, computed, last)
        record_step_reference(ref * (n if shared else 1), tokens, tops, rows, computed, last)
        for a, b in zip(native, ref):  # the same entries, in the same order
            assert torch.equal(a.tensors[0], b.tensors[0]) and a.tensors[1].shape == b.tensors[1].shape
            assert all(a.successors(t) == b.successors(t) for t in range(vocab))
            if vocab <= 64:  # never grown: every value, the stale ones included
                assert torch.equal(a.tensors[1], b.tensors[1])
                assert j == 8 or bool((a.tensors[1][: a.recorded, :, j:] == -7).all())
    assert sum(t.recorded for t in native) > 0
    if vocab > 64 and shared:  # 16 rows' records into one table
        assert native[0].tensors[1].shape[0] > 64  # grown
    if not shared:  # the values themselves: each table's last write of a token is its row's ids and probabilities
        table, b = native[0], rows[0]
        t = int(tokens[b, last[0][-1]])
        assert table.successors(t) == list(zip(ids[b, last[0][-1]].tolist(), probs[b, last[0][-1]].tolist()))


def test_successor_records_refuse_what_does_not_fit():
    table = SuccessorTable(12, 4)
    tokens, tops = torch.zeros(2, 3, dtype=torch.long), pack_tops(torch.zeros(2, 3, 4), torch.zeros(2, 3, 4))
    record_step([table], tokens, tops, [1], [3], [[2]])  # fits
    for args, match in (((tokens, tops, [2], [3], [[2]]), "rows"),
                        ((tokens, tops, [0], [4], [[2]]), "computed"),
                        ((tokens, tops[:, :, :, :3], [0], [3], [[2]]), "contiguous"),
                        ((tokens[:, :2], tops, [0], [3], [[2]]), "R' <= R"),
                        ((tokens, tops.long(), [0], [3], [[2]]), "int32"),
                        ((tokens, tops, [0], [3], [[3]]), "outside")):
        with pytest.raises(RuntimeError, match=match):
            record_step([table], *args)


def _flat_reference(indexes, sequences, limit):
    """``suffix_spans``'s output built from each index's Python ``matches``."""
    tokens, lens, matches, counts = [], [], [], []
    for index, sequence in zip(indexes, sequences):
        found = index.matches(sequence, limit)
        counts.append(len(found))
        for cont, match in found:
            tokens += cont
            lens.append(len(cont))
            matches.append(match)
    return tokens, lens, matches, counts


def test_a_successor_table_is_made_at_its_first_record_and_reads_as_empty_before():
    """Nothing allocated until a record (a batch's rows whose trees are all declined never pay for them); a table
    not yet made proposes what a made but empty one does, and proposing does not make it."""
    table = SuccessorTable(40, 4)
    assert not table.allocated and table.successors(3) == []
    cfg = LookaheadConfig(window=3, ngram=4, guess=6, pool_backend="cpp", sources=("suffix", "successors"))
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    fresh, made = DraftBuilder(cfg, 40, native=True), DraftBuilder(cfg, 40, native=True)
    for b in (fresh, made):
        b.start(prompt)
    made.successors._made()
    assert made.successors.recorded == 0 and made.successors.allocated and not fresh.successors.allocated
    a, b = propose_rows([fresh], [prompt], 16), propose_rows([made], [prompt], 16)
    assert a.scores == b.scores and a.scores[0]
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
    assert not fresh.successors.allocated
    table.record(torch.tensor([3]), torch.tensor([[7, 8, 9, 10]]), torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    assert table.allocated and [t for t, _ in table.successors(3)] == [7, 8, 9, 10] and table.successors(4) == []


@pytest.mark.parametrize("seed", range(12))
def test_native_suffix_matches_equal_the_reference_as_sequences_grow(seed):
    # Rows growing by 0-5 tokens a step (a row's buffer regrows past its first 64 tokens), few distinct tokens
    # (every match length up to max_match, ties of match length, continuations that are prefixes of others).
    rng = random.Random(seed)
    rows = rng.randint(1, 6) if seed % 4 else 1  # one row takes the Python path, more the C++ op
    sizes = [(rng.choice([1, 3, 8]), rng.choice([1, 4, 32])) for _ in range(rows)] if seed % 3 == 0 \
        else [(8, 32)] * rows  # mixed settings take the reference path: the same result either way
    native = [SuffixIndex(m, n) for m, n in sizes]
    ref = [SuffixIndex(m, n) for m, n in sizes]
    motif = [rng.randrange(5) for _ in range(rng.randint(1, 9))]
    sequences = [[rng.randrange(5)] for _ in range(rows)]
    for _ in range(60):
        for seq in sequences:
            for _ in range(rng.choice([0, 1, 1, 2, 5])):
                seq.append(motif[len(seq) % len(motif)] if rng.random() < 0.7 else rng.randrange(5))
        limit = rng.choice([0, 1, 4, 9])
        assert suffix_spans(native, sequences, limit) == _flat_reference(ref, sequences, limit)
    assert max(len(s) for s in sequences) > 64


def test_native_suffix_spans_refuse_a_shorter_sequence_and_bad_buffers():
    index = SuffixIndex()
    suffix_spans([index], [[1, 2, 3, 1]], 4)
    with pytest.raises(ValueError, match="shorter"):
        suffix_spans([index], [[1, 2, 3]], 4)
    spans = torch.ops.lookahead_draft.suffix_spans
    with pytest.raises(RuntimeError, match="room for 2"):
        spans([torch.zeros(2, dtype=torch.long)], [1], [5, 6], [2], 8, 32, 4)
    with pytest.raises(RuntimeError, match="int64"):
        spans([torch.zeros(4, dtype=torch.int32)], [0], [5], [1], 8, 32, 4)
    with pytest.raises(RuntimeError, match="new_tokens has"):
        spans([torch.zeros(4, dtype=torch.long)], [0], [5], [2], 8, 32, 4)
    with pytest.raises(RuntimeError, match="max_match"):
        spans([torch.zeros(4, dtype=torch.long)], [0], [5], [1], 0, 32, 4)


def test_the_random_proposals_cover_every_suffix_match_class():
    """The agreement tests above see suffix continuations of every class of match length (1, 2-3, 4-7, 8+)."""
    seen = set()
    for seed in range(40):
        b, seq = random_builder(seed, [7, 50, 300][seed % 3], ("suffix",))
        seen.update(code_key(c)[1] for c in b.propose(seq, 255).codes.tolist())
    assert seen == {1, 2, 4, 8}


def test_key_codes_round_trip_and_stay_in_range():
    keys = [("pool", d) for d in range(1, 64)] + [("suffix", m, d) for m in (1, 2, 4, 8) for d in range(1, 9)] + \
           [("successors", b, d) for b in range(12) for d in range(1, 5)]
    keys += [k + ("agreed",) for k in keys]
    codes = [key_code(k) for k in keys]
    assert len(set(codes)) == len(keys) and max(codes) < NUM_CODES
    assert [code_key(c) for c in codes] == keys


def test_native_ops_reject_bad_inputs():
    none = torch.empty(0, 0, dtype=torch.long)
    rates = torch.zeros(NUM_CODES, dtype=torch.float64)
    e32 = torch.empty(0, dtype=torch.int32)
    propose = torch.ops.lookahead_draft.propose
    with pytest.raises(RuntimeError, match="rates"):
        propose([1], [], [], [], [0], [none], [rates[:-1]], [e32], [e32], 4)
    with pytest.raises(RuntimeError, match="pool"):
        propose([1], [], [], [], [0], [torch.zeros(2, dtype=torch.long)], [rates], [e32], [e32], 4)
    with pytest.raises(RuntimeError, match="suffix_lens"):
        propose([1], [5, 6], [1], [1], [1], [none], [rates], [e32], [e32], 4)
    with pytest.raises(RuntimeError, match="suffix_matches has"):
        propose([1], [5], [1], [], [1], [none], [rates], [e32], [e32], 4)
    with pytest.raises(RuntimeError, match="suffix_matches must be"):
        propose([1], [5], [1], [0], [1], [none], [rates], [e32], [e32], 4)
    with pytest.raises(RuntimeError, match="one root"):
        propose([1, 2], [], [], [], [0, 0], [none], [rates], [e32], [e32], 4)
    index, entries = torch.zeros(6, 2, dtype=torch.int32), torch.zeros(4, 2, 3, dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"int32 index \[V \+ 1, 2\]"):
        propose([1], [], [], [], [0], [none], [rates], [index[:, :1].contiguous()], [entries], 4)
    index[1] = torch.tensor([9, 2])  # token 1's entry past the entries
    with pytest.raises(RuntimeError, match="entry 9 outside"):
        propose([1], [], [], [], [0], [none], [rates], [index], [entries], 4)
    tokens, tops = torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 2, 1, 3, dtype=torch.int32)
    index[5, 0] = 5  # five entries in use of four
    with pytest.raises(RuntimeError, match="uses 5 entries of 4"):
        torch.ops.lookahead_draft.record_successors([index], [entries], tokens, tops, [0], [1], [0], [])
    with pytest.raises(RuntimeError, match="parent of node 0"):
        torch.ops.lookahead_draft.encode(torch.tensor([0]), torch.tensor([5]), [0], [1], 1)
    with pytest.raises(RuntimeError, match="keep"):
        torch.ops.lookahead_draft.encode(torch.tensor([-1]), torch.tensor([5]), [0], [2], 2)
    with pytest.raises(RuntimeError, match="start"):
        torch.ops.lookahead_draft.encode(torch.tensor([-1]), torch.tensor([5]), [1], [1], 2)


def test_trusted_shape_is_not_checked_but_equal():
    shape = TreeShape.from_parents([-1, 0, -1])
    trusted = TreeShape.trusted(shape.depth, shape.end)
    assert torch.equal(trusted.depth, shape.depth) and torch.equal(trusted.end, shape.end)


def stable_top(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's top k, largest first, NaN largest, the lower index first among equals (float64 probabilities)."""
    flat = x.reshape(-1, x.shape[-1]).double()
    key = torch.where(flat.isnan(), torch.inf, flat)
    nan_first = flat.isnan().double()  # NaN before +inf
    ids = torch.stack([torch.tensor(sorted(range(flat.shape[1]), key=lambda i: (-nan_first[r, i], -key[r, i], i))[:k])
                       for r in range(flat.shape[0])])
    vals = flat.gather(1, ids)
    return ids.reshape(*x.shape[:-1], -1), torch.softmax(vals, dim=-1).reshape(*x.shape[:-1], -1)


@pytest.mark.parametrize("V", [1, 7, 63, 64, 65, 200, 1000, 3000])
@pytest.mark.parametrize("k", [1, 3, 8, 70, 128])
def test_top_successors_equal_a_stable_top_k(V, k):
    gen = torch.Generator().manual_seed(V * 131 + k)
    for view in ("2d", "3d-slice"):
        full = torch.randn(3, 5, V, generator=gen) * 4
        full[0, 1] = full[0, 1].round()  # exact ties, the lower index first
        full[1, 2, V // 2] = float("nan")
        x = full[1] if view == "2d" else full[:, 1:4]  # rows of a larger step's logits, as the verifier passes
        ids, probs = torch.ops.lookahead_draft.top_successors(x, k)
        want_ids, want_probs = stable_top(x, min(k, V))
        assert ids.dtype == torch.int64 and probs.dtype == torch.float32
        assert ids.shape == probs.shape == (*x.shape[:-1], min(k, V))
        assert torch.equal(ids, want_ids)
        finite = ~want_probs.isnan()
        assert torch.equal(probs.isnan(), ~finite)  # a NaN among a row's top k makes its probabilities NaN
        assert torch.allclose(probs.double()[finite], want_probs[finite], rtol=1e-5, atol=1e-7)  # fp32 sums of k


def test_successor_tops_on_the_cpu_match_torch_where_no_entries_tie():
    x = torch.randn(2, 6, 4000, generator=torch.Generator().manual_seed(3))
    ids, probs = SuccessorTable.top(x[:, :5], 8)
    ref_ids, ref_probs = SuccessorTable.top_reference(x[:, :5], 8)
    assert torch.equal(ids, ref_ids) and torch.allclose(probs, ref_probs, rtol=1e-6, atol=0)


def test_top_successors_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match="float32"):
        torch.ops.lookahead_draft.top_successors(torch.zeros(2, 5, dtype=torch.float64), 3)
    with pytest.raises(ValueError, match="contiguous last dimension"):
        torch.ops.lookahead_draft.top_successors(torch.zeros(5, 2).t(), 3)
    with pytest.raises(ValueError, match="k must be >= 1"):
        torch.ops.lookahead_draft.top_successors(torch.zeros(2, 5), 0)


def test_some_random_builders_propose_from_their_memory():
    differ = 0
    for seed in range(0, 60, 3):
        b, seq = random_builder(seed, 50, ("suffix",))
        remembered = b.propose(seq, 63)
        b.memory = None
        alone = b.propose(seq, 63)
        differ += not torch.equal(remembered.tokens, alone.tokens)
    assert differ >= 5
