"""Tree verification kernels against their torch references, the sampling verifier's statistics, and warping.

Kernel tests run on ``kernel_device`` (CUDA, or CPU under Triton's interpreter, where every program of a launch
runs in Python), so shapes stay small; outputs are written into buffers poisoned with ``POISON`` so that an
element the kernel forgets fails the comparison. Trees are random pre-ordered trees of several shapes (one chain,
a star, deep, bushy, the linear candidates), per batch row or shared, padded with leaves after ``num_nodes``.
"""

import zlib
from collections import Counter

import numpy as np
import pytest
import torch
from scipy import stats

from lookahead.sampling import SamplingParams, sample_rows, warp_logits
from lookahead_kernels.tree import TreeShape
from lookahead_kernels.verify_ref import (draw_tree_uniforms, inverse_cdf_sample, tree_parents,
                                          verify_tree_greedy_reference, verify_tree_sample_reference)
from tests.sm90_compile import run_compile_script

POISON = -777


@pytest.fixture(scope="module")
def vk():
    from lookahead_kernels import verify  # after conftest has set TRITON_INTERPRET on CPU
    return verify


def poisoned(B, A, device):
    return (torch.full((B,), POISON, dtype=torch.long, device=device),
            torch.full((B, A), POISON, dtype=torch.long, device=device),
            torch.full((B, A + 1), POISON, dtype=torch.long, device=device))


def assert_same(ref, got):
    for name, r, g in zip(("accept_len", "path", "emitted"), ref, got):
        assert not (g == POISON).any(), f"{name}: unwritten elements"
        assert torch.equal(r.cpu(), g.cpu()), f"{name} differs:\nreference {r}\nkernel    {g}"


def assert_consistent(out, tokens, end, num_nodes=None):
    """The outputs describe a walk: accepted nodes form a root-down path of real nodes whose tokens are emitted."""
    acc, path, emitted = (t.cpu() for t in out)
    B, V = tokens.shape
    end = end.cpu().expand(B, V)
    parents = tree_parents(end)
    for b in range(B):
        a = int(acc[b])
        n = V if num_nodes is None else int(num_nodes[b])
        nodes = path[b, :a].tolist()
        assert path[b, a:].eq(-1).all() and emitted[b, a + 1:].eq(-1).all() and emitted[b, a] >= 0
        assert all(0 <= i < n for i in nodes)
        assert [int(parents[b, i]) for i in nodes] == ([-1] + nodes[:-1])[:a]
        assert emitted[b, :a].tolist() == tokens[b, nodes].tolist()


# ---- trees ---------------------------------------------------------------------------------------------------------
def random_parents(size, kind, gen):
    """Parents (-1 for a child of x) of a random tree of ``size`` nodes, numbered in pre-order.

    Node i's parent is drawn from the rightmost path (x and the ancestors-or-self of node i-1): that keeps the
    numbering pre-order, and every pre-ordered tree can come out."""
    parents, stack = [], [-1]  # stack: x, then the path from x down to the last node
    for i in range(size):
        r = float(torch.rand((), generator=gen))
        if kind == "chain":
            k = len(stack) - 1
        elif kind == "star":
            k = 0
        elif kind == "deep":  # mostly extends the last node
            k = len(stack) - 1 if r < 0.75 else int(torch.randint(0, len(stack), (), generator=gen))
        elif kind == "bushy":  # hangs off x or the first two levels
            k = int(torch.randint(0, min(3, len(stack)), (), generator=gen))
        else:
            raise ValueError(kind)
        parents.append(stack[k])
        stack = stack[:k + 1] + [i]
    return parents


def padded_end(parents, V):
    """``end [V]``: the tree of ``parents`` followed by padding leaves."""
    end = list(range(1, V + 1))
    if parents:
        end[: len(parents)] = TreeShape.from_parents(parents).end.tolist()
    return torch.tensor(end)


def tree_batch(B, V, kind, gen, pad, shared):
    """``(end [V] or [B, V], num_nodes [B] or None, parents per row)`` for ``B`` rows of ``V`` nodes."""
    if kind == "linear":
        g, k = V
        end = TreeShape.linear(g, k).end
        V = g * k
        parents = [p.item() for p in TreeShape.linear(g, k).parents()]
        sizes = [int(torch.randint(0, V + 1, (), generator=gen)) if pad else V for _ in range(B)]
        return end, (torch.tensor(sizes) if pad else None), [parents] * B
    rows = 1 if shared else B
    sizes = [int(torch.randint(0, V + 1, (), generator=gen)) if pad else V for _ in range(rows)]
    if pad:
        sizes[0] = V - 1  # at least one padding node, and a big tree
    parents = [random_parents(n, kind, gen) for n in sizes]
    end = torch.stack([padded_end(p, V) for p in parents])
    if shared:
        return end[0], (torch.tensor(sizes * B) if pad else None), parents * B
    return end, (torch.tensor(sizes) if pad else None), parents


def max_depth(parents_rows):
    best = 0
    for parents in parents_rows:
        depth = []
        for p in parents:
            depth.append(1 if p < 0 else depth[p] + 1)
        best = max([best] + depth)
    return best


def to(device, *tensors):
    return [t.to(device) if isinstance(t, torch.Tensor) else t for t in tensors]


# ---- greedy --------------------------------------------------------------------------------------------------------
def greedy_tree_case(B, V, vocab, kind, gen, pad=False, shared=False, ties=False, dtype=torch.float32, plant=0.7):
    """Random logits on a random tree; a node's token is, with probability ``plant``, the argmax at its parent
    (so walks go deep, and siblings often repeat a token), else random (ids out of range included)."""
    end, n, parents = tree_batch(B, V, kind, gen, pad, shared)
    V = end.shape[-1]
    if ties:  # few distinct values: many equal maxima
        x = torch.randint(0, 3, (B, vocab), generator=gen).to(dtype)
        nodes = torch.randint(0, 3, (B, V, vocab), generator=gen).to(dtype)
    else:
        x = torch.randn(B, vocab, generator=gen).to(dtype)
        nodes = torch.randn(B, V, vocab, generator=gen).to(dtype)
    tokens = torch.randint(0, vocab, (B, V), generator=gen)
    y0, pred = x.argmax(-1), nodes.argmax(-1)
    for b in range(B):
        for i, p in enumerate(parents[b]):
            if float(torch.rand((), generator=gen)) < plant:
                tokens[b, i] = y0[b] if p < 0 else pred[b, p]
    tokens[torch.rand(B, V, generator=gen) < 0.03] = -1
    tokens[torch.rand(B, V, generator=gen) < 0.03] = vocab + 5
    if n is not None:  # padding: the best possible tokens and garbage rows, never to be read or accepted
        for b in range(B):
            tokens[b, int(n[b]):] = y0[b]
            nodes[b, int(n[b]):] = float("nan")
    return x, nodes, tokens, end, n, max(1, max_depth(parents))


@pytest.mark.parametrize("kind,V,pad,shared,ties", [
    ("chain", 6, False, True, False), ("star", 6, False, False, True), ("deep", 10, True, False, False),
    ("bushy", 10, False, False, True), ("bushy", 12, True, True, False), ("linear", (3, 3), False, True, True),
    ("linear", (2, 4), True, True, False), ("deep", 9, True, False, True),
])
def test_greedy_matches_reference(vk, kernel_device, kind, V, pad, shared, ties):
    gen = torch.Generator().manual_seed(zlib.crc32(repr((kind, V, pad, shared, ties)).encode()))
    B, vocab = 3, 37
    accepted = 0
    for rep in range(2):
        x, nodes, tokens, end, n, depth = greedy_tree_case(B, V, vocab, kind, gen, pad, shared, ties)
        x, nodes, tokens, end, n = to(kernel_device, x, nodes, tokens, end, n)
        A = depth + rep - 1  # at the depth, and one short of it (the cap)
        ref = verify_tree_greedy_reference(x, nodes, tokens, end, n, A)
        got = vk.verify_tree_greedy(x, nodes, tokens, end, n, A, vocab_splits=(2 if rep else None),
                                    out=poisoned(B, A, kernel_device))
        assert_same(ref, got)
        assert_consistent(ref, tokens.cpu(), end, n)
        accepted += int(ref[0].sum())
    assert accepted > 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_greedy_dtypes(vk, kernel_device, dtype):
    gen = torch.Generator().manual_seed(7)
    x, nodes, tokens, end, n, depth = greedy_tree_case(2, 7, 64, "bushy", gen, ties=True, dtype=dtype)
    x, nodes, tokens, end = to(kernel_device, x, nodes, tokens, end)
    assert_same(verify_tree_greedy_reference(x, nodes, tokens, end, None, depth),
                vk.verify_tree_greedy(x, nodes, tokens, end, None, depth, vocab_splits=2,
                                      out=poisoned(2, depth, kernel_device)))


def onehot(ids, vocab=10):
    ids = torch.as_tensor(ids)
    return torch.zeros(*ids.shape, vocab).scatter_(-1, ids[..., None], 1.0)


def test_greedy_hand_worked(vk, kernel_device):
    #          x                 tokens: 0:3  1:5  2:1  3:7  4:3  5:2 (padding in row 1)
    #        /   \               argmax: x -> 3, 0 -> 7, 1 -> 1, 2 -> 2, 3 -> 9, 4 -> 2
    #       0     4
    #      / \
    #     1   3
    #     |
    #     2
    end = TreeShape.from_parents([-1, 0, 1, 0, -1]).end
    end = torch.cat([end, torch.tensor([6])])
    tokens = torch.tensor([[3, 5, 1, 7, 3, 2]] * 4)
    x = onehot([3, 3, 3, 3])
    nodes = onehot([[7, 1, 2, 9, 2, 0]] * 4)
    # row 1: 0 -> 5 at node 0, so node 1 (token 5) is taken, then 1 -> node 2 (token 1), then bonus 2
    nodes[1, 0] = onehot(5)
    # row 2: x -> 4 matches no root; row 3: node 0 no longer real (num_nodes 0)
    x[2] = onehot(4)
    n = torch.tensor([5, 5, 5, 0])
    ref = verify_tree_greedy_reference(x, nodes, tokens, end, n, 3)
    assert ref[0].tolist() == [2, 3, 0, 0]
    assert ref[1].tolist() == [[0, 3, -1], [0, 1, 2], [-1, -1, -1], [-1, -1, -1]]
    assert ref[2].tolist() == [[3, 7, 9, -1], [3, 5, 1, 2], [4, -1, -1, -1], [3, -1, -1, -1]]
    assert_same(ref, vk.verify_tree_greedy(*to(kernel_device, x, nodes, tokens, end, n), 3,
                                           out=poisoned(4, 3, kernel_device)))
    # max_accept caps the walk: row 1 stops after node 1, the bonus is the argmax there
    capped = verify_tree_greedy_reference(x, nodes, tokens, end, n, 2)
    assert capped[2].tolist()[1] == [3, 5, 1]
    assert_same(capped, vk.verify_tree_greedy(*to(kernel_device, x, nodes, tokens, end, n), 2,
                                              out=poisoned(4, 2, kernel_device)))
    # max_accept = 0: the argmax at x alone
    zero = verify_tree_greedy_reference(x, nodes, tokens, end, n, 0)
    assert zero[2].tolist() == [[3], [3], [4], [3]] and zero[1].shape == (4, 0)
    assert_same(zero, vk.verify_tree_greedy(*to(kernel_device, x, nodes, tokens, end, n), 0,
                                            out=poisoned(4, 0, kernel_device)))


def test_greedy_repeated_sibling_takes_the_first(vk, kernel_device):
    """Not a trie: two roots carry the argmax at x; only the first is followed, even when the second goes deeper."""
    end = TreeShape.from_parents([-1, -1, 1]).end  # roots 0 and 1, node 2 under node 1
    tokens = torch.tensor([[4, 4, 6]])
    x, nodes = onehot([4]), onehot([[1, 6, 8]])
    ref = verify_tree_greedy_reference(x, nodes, tokens, end, None, 2)
    assert (ref[0].tolist(), ref[1].tolist(), ref[2].tolist()) == ([1], [[0, -1]], [[4, 1, -1]])
    assert_same(ref, vk.verify_tree_greedy(*to(kernel_device, x, nodes, tokens, end), None, 2,
                                           out=poisoned(1, 2, kernel_device)))


def test_greedy_empty_tree(vk, kernel_device):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 30, generator=gen).to(kernel_device)
    nodes = torch.empty(2, 0, 30, device=kernel_device)
    tokens = torch.empty(2, 0, dtype=torch.long, device=kernel_device)
    end = torch.empty(0, dtype=torch.long, device=kernel_device)
    ref = verify_tree_greedy_reference(x, nodes, tokens, end, None, 3)
    assert ref[0].eq(0).all() and ref[1].eq(-1).all() and ref[2][:, 0].equal(x.argmax(-1))
    assert_same(ref, vk.verify_tree_greedy(x, nodes, tokens, end, None, 3, out=poisoned(2, 3, kernel_device)))


@pytest.mark.parametrize("vocab", [1000, 49152, 128256])
def test_greedy_vocab_sizes(vk, kernel_device, vocab):
    gen = torch.Generator().manual_seed(vocab)
    x, nodes, tokens, end, _, depth = greedy_tree_case(1, 3, vocab, "chain", gen, plant=1.0)
    x[0, vocab - 1] = x[0].max() + 1  # the maximum in the last slice of the vocabulary
    tokens[0] = torch.stack([torch.tensor(vocab - 1), nodes[0, 0].argmax(), nodes[0, 1].argmax()])
    x, nodes, tokens, end = to(kernel_device, x, nodes, tokens, end)
    ref = verify_tree_greedy_reference(x, nodes, tokens, end, None, 3)
    assert ref[0].item() == 3
    assert_same(ref, vk.verify_tree_greedy(x, nodes, tokens, end, None, 3, out=poisoned(1, 3, kernel_device)))


def test_greedy_strided_views(vk, kernel_device):
    """x and node rows as views into the model's [B, T, vocab] logits, as the decoding loop passes them."""
    gen = torch.Generator().manual_seed(4)
    B, la, V, vocab = 2, 5, 6, 40
    logits = torch.randn(B, la + V + 2, vocab, generator=gen).to(kernel_device)
    x, nodes = logits[:, 0], logits[:, la: la + V]
    end = TreeShape.from_parents([-1, 0, 0, -1, 3, 4]).end.to(kernel_device)
    tokens = torch.randint(0, vocab, (B, V), generator=gen).to(kernel_device)
    tokens[:, 0] = (x.argmax(-1) + 1) % vocab
    tokens[:, 3] = x.argmax(-1)
    tokens[:, 4] = nodes[:, 3].argmax(-1)
    tokens[:, 5] = nodes[:, 4].argmax(-1)
    ref = verify_tree_greedy_reference(x, nodes, tokens, end, None, 3)
    assert ref[0].tolist() == [3, 3]
    assert_same(ref, vk.verify_tree_greedy(x, nodes, tokens, end, None, 3, out=poisoned(B, 3, kernel_device)))


def test_greedy_nan_like_torch(vk, kernel_device):
    x = torch.tensor([[0.0, 5.0, float("nan"), 5.0, float("nan")], [1.0, 1.0, 1.0, 0.0, 1.0]])
    nodes = torch.tensor([[[float("nan"), 0.0, 0.0, 9.0, 0.0], [0.0] * 5],
                          [[0.0, 2.0, 2.0, 1.0, 2.0], [0.0] * 5]])
    tokens = torch.tensor([[2, 3], [0, 1]])  # a chain: NaN at x is argmax 2, then NaN at node 0 is 0 (not 3)
    end = torch.tensor([2, 2])
    ref = verify_tree_greedy_reference(x, nodes, tokens, end, None, 2)
    assert ref[0].tolist() == [1, 2] and ref[2].tolist() == [[2, 0, -1], [0, 1, 0]]
    assert_same(ref, vk.verify_tree_greedy(*to(kernel_device, x, nodes, tokens, end), None, 2, vocab_splits=2,
                                           out=poisoned(2, 2, kernel_device)))


@pytest.mark.parametrize("R,V,splits,ties", [(7, 1000, None, False), (5, 300, 3, True), (3, 128256, None, False)])
def test_row_argmax(vk, kernel_device, R, V, splits, ties):
    gen = torch.Generator().manual_seed(R + V)
    logits = (torch.randint(0, 4, (R, V), generator=gen).float() if ties else torch.randn(R, V, generator=gen))
    logits = logits.to(kernel_device)
    out = torch.full((R,), POISON, dtype=torch.long, device=kernel_device)
    got = vk.row_argmax(logits, vocab_splits=splits, out=out)
    assert torch.equal(got.cpu(), logits.argmax(-1).cpu())
    view = logits[::2]  # strided rows
    assert torch.equal(vk.row_argmax(view).cpu(), view.argmax(-1).cpu())


def test_row_argmax_lane_edge_cases(vk, kernel_device):
    """Each lane keeps its own best over a slice's blocks: -inf rows, NaN in a late block or at a slice's end, the
    same maximum in several lanes and blocks, slices that are only a tail (9 logits: one slice of 16, masked) or
    end in one (40 logits in 3 slices of 16, 16 and 8) all give torch.argmax's index."""
    inf, nan = float("inf"), float("nan")
    V = 40000  # several blocks per slice on a GPU (2048 logits a block) and under the interpreter (16384)
    rows = torch.randn(8, V, generator=torch.Generator().manual_seed(3))
    rows[0] = -inf
    rows[1, 39999] = nan
    rows[2, [5, 20000, 37000]] = 9.0  # ties in three blocks: the first wins
    rows[3] = -inf
    rows[3, 33000] = nan
    rows[3, 12] = inf
    rows[4, [17000, 17001]] = nan
    rows[5] = 0.0
    rows[6, 16383:16385] = 7.0  # a tie across the interpreter's block boundary
    rows[7, [1, 30000]] = inf
    for splits in (None, 1, 3, 7):
        out = torch.full((8,), POISON, dtype=torch.long, device=kernel_device)
        got = vk.row_argmax(rows.to(kernel_device), vocab_splits=splits, out=out)
        assert got.cpu().tolist() == [0, 39999, 5, 33000, 17000, 0, 16383, 1]
    small = torch.tensor([[-inf] * 9, [0.0] * 8 + [1.0], [nan] + [0.0] * 8])
    got = vk.row_argmax(small.to(kernel_device), vocab_splits=4)
    assert got.cpu().tolist() == [0, 8, 0]
    tails = torch.full((4, 40), -inf)
    tails[0, 39], tails[1, [15, 16]], tails[2, 33:] = 1.0, 2.0, nan
    tails[3, :] = torch.arange(40.0).flip(0)
    got = vk.row_argmax(tails.to(kernel_device), vocab_splits=3)
    assert got.cpu().tolist() == [39, 15, 33, 0]


@pytest.mark.parametrize("V", [1, 9, 40, 1000, 32000, 49152, 128256])
def test_vocab_slices_are_aligned_and_never_empty(vk, V):
    for asked in (1, 2, 3, 5, 7, 40, 64):
        slice_len, slices = vk._vocab_slices(V, asked)
        assert slice_len % 16 == 0 and 1 <= slices <= asked
        assert (slices - 1) * slice_len < V <= slices * slice_len


# ---- sampling: kernel == reference ---------------------------------------------------------------------------------
def sample_tree_case(B, V, vocab, kind, gen, pad=False, shared=False, dtype=torch.float32, hot=4):
    """Peaked random distributions over ``hot`` tokens, some exact zeros; node tokens are often the most likely
    token at their parent (first children above all, so that walks go deep), else drawn from the hot tokens (repeated siblings included),
    and a few ids are out of range; padding rows are NaN."""
    def dist(*shape):
        w = torch.rand(*shape, vocab, generator=gen) * 0.05
        w[..., :hot] += torch.rand(*shape, hot, generator=gen) * 4
        w[torch.rand(*shape, vocab, generator=gen) < 0.2] = 0
        w[..., 0] += 0.1  # every row keeps some mass
        return (w / w.sum(-1, keepdim=True)).to(dtype)
    end, n, parents = tree_batch(B, V, kind, gen, pad, shared)
    V = end.shape[-1]
    x, nodes = dist(B), dist(B, V)
    tokens = torch.randint(0, hot + 1, (B, V), generator=gen)
    for b in range(B):  # first children mostly, other nodes sometimes, carry the most likely token at their parent
        for i, p in enumerate(parents[b]):
            if float(torch.rand((), generator=gen)) < (0.8 if i == p + 1 else 0.3):
                tokens[b, i] = (x[b] if p < 0 else nodes[b, p]).float().argmax()
    tokens[torch.rand(B, V, generator=gen) < 0.05] = -1
    if n is not None:
        for b in range(B):
            tokens[b, int(n[b]):] = 0
            nodes[b, int(n[b]):] = float("nan")
    return x, nodes, tokens, end, n, max(1, max_depth(parents))


@pytest.mark.parametrize("kind,V,pad,shared,dtype", [
    ("chain", 5, False, True, torch.float32), ("star", 6, False, False, torch.float32),
    ("deep", 9, True, False, torch.float32), ("bushy", 10, True, True, torch.float16),
    ("bushy", 8, False, False, torch.bfloat16), ("linear", (3, 3), True, True, torch.float32),
    ("deep", 7, False, True, torch.float64),
])
def test_sample_matches_reference(vk, kernel_device, kind, V, pad, shared, dtype):
    gen = torch.Generator().manual_seed(zlib.crc32(repr((kind, V, pad, shared, str(dtype))).encode()))
    B, vocab = 6, 20
    x, nodes, tokens, end, n, depth = sample_tree_case(B, V, vocab, kind, gen, pad, shared, dtype)
    u = draw_tree_uniforms(B, tokens.shape[1], generator=gen)
    u[:, :-1] *= 0.5  # tries accept more often: the walks go deeper
    x, nodes, tokens, end, n, u = to(kernel_device, x, nodes, tokens, end, n, u)
    ref = verify_tree_sample_reference(x, nodes, tokens, end, n, depth, u)
    assert_same(ref, vk.verify_tree_sample(x, nodes, tokens, end, n, depth, u, out=poisoned(B, depth, kernel_device)))
    assert_consistent(ref, tokens.cpu(), end, n)
    assert ref[0].max() >= 1  # (walks two deep and more: the big-vocabulary, temperature-0 and statistics tests)
    # capped one short of the depth, and the launcher's own draw: same seed, same result
    A = depth - 1
    g1 = torch.Generator(device=kernel_device).manual_seed(5)
    g2 = torch.Generator(device=kernel_device).manual_seed(5)
    got = vk.verify_tree_sample(x, nodes, tokens, end, n, A, generator=g1, out=poisoned(B, A, kernel_device))
    assert_same(verify_tree_sample_reference(x, nodes, tokens, end, n, A, generator=g2), got)


def test_sample_repeated_sibling_and_zero_weight(vk, kernel_device):
    """Roots carry tokens [2, 1, 2, 3] where token 1 has weight 0: node 1 is always rejected, node 2 repeats
    node 0's token so it is rejected once node 0 is (its weight is gone), and the bonus skips both."""
    end = torch.tensor([1, 2, 3, 4])
    tokens = torch.tensor([[2, 1, 2, 3]] * 4)
    x = torch.tensor([[0.2, 0.0, 0.3, 0.1, 0.4]] * 4)
    nodes = torch.full((4, 4, 5), 0.2)
    # row 0: accept node 0 (u < 0.3); row 1: reject 0, 1 and 2, accept 3 (0.1 / 0.7 > u); row 2: reject all, the
    # bonus from [0.2, 0, 0, 0, 0.4] / 0.6 at u = 0.5 is token 4; row 3: the same at u = 0.1 is token 0
    u = torch.tensor([[0.1, 0.0, 0.0, 0.0, 0.5],
                      [0.9, 0.0, 0.0, 0.1, 0.5],
                      [0.9, 0.0, 0.0, 0.9, 0.5],
                      [0.9, 0.0, 0.0, 0.9, 0.1]], dtype=torch.float64)
    ref = verify_tree_sample_reference(x, nodes, tokens, end, None, 1, u)
    assert ref[0].tolist() == [1, 1, 0, 0]
    assert ref[1].tolist() == [[0], [3], [-1], [-1]]
    assert ref[2][:, 0].tolist() == [2, 3, 4, 0]
    assert_same(ref, vk.verify_tree_sample(*to(kernel_device, x, nodes, tokens, end), None, 1,
                                           u.to(kernel_device), out=poisoned(4, 1, kernel_device)))


def test_sample_empty_tree(vk, kernel_device):
    gen = torch.Generator().manual_seed(3)
    x = torch.softmax(torch.randn(3, 12, generator=gen), -1).to(kernel_device)
    nodes = torch.empty(3, 0, 12, device=kernel_device)
    tokens = torch.empty(3, 0, dtype=torch.long, device=kernel_device)
    end = torch.empty(0, dtype=torch.long, device=kernel_device)
    u = draw_tree_uniforms(3, 0, generator=gen).to(kernel_device)
    ref = verify_tree_sample_reference(x, nodes, tokens, end, None, 2, u)
    assert ref[0].eq(0).all() and ref[2][:, 0].ge(0).all() and ref[2][:, 1:].eq(-1).all()
    assert_same(ref, vk.verify_tree_sample(x, nodes, tokens, end, None, 2, u, out=poisoned(3, 2, kernel_device)))


def test_sample_big_vocab(vk, kernel_device):
    """Weight on tokens spread over the vocabulary: the bonus after rejections is found chunk by chunk, with the
    rejected tokens' weight taken out of the chunks that hold them."""
    vocab = 128256
    hot = torch.tensor([5, 20000, 40001, 70000, 127999])
    B = 5
    x = torch.zeros(B, vocab)
    x[:, hot] = torch.tensor([0.3, 0.25, 0.2, 0.15, 0.1])
    x[:, 1000:1010] = 0.001
    nodes = x[:, None].repeat(1, 4, 1)
    end = TreeShape.from_parents([-1, 0, -1, -1]).end
    tokens = hot[[0, 1, 2, 3]].expand(B, 4).clone()
    u = torch.tensor([[0.99, 0.0, 0.99, 0.99, t] for t in (0.0, 0.01, 0.3, 0.8, 0.999)], dtype=torch.float64)
    u[0, 0] = 0.0  # row 0 accepts node 0 then node 1
    x, nodes, tokens, end, u = to(kernel_device, x, nodes, tokens, end, u)
    ref = verify_tree_sample_reference(x, nodes, tokens, end, None, 2, u)
    # rows 1-4 reject tokens 5, 40001 and 70000; what is left: 1000..1009, 20000, 127999
    assert ref[0].tolist() == [2, 0, 0, 0, 0]
    assert ref[2][1:, 0].tolist() == [1003, 20000, 127999, 127999]
    assert_same(ref, vk.verify_tree_sample(x, nodes, tokens, end, None, 2, u, out=poisoned(B, 2, kernel_device)))


def _cpu_walk():
    from lookahead_kernels.cpu_ops import cpu_ops_available

    if not cpu_ops_available():
        pytest.skip("the C++ ops could not be built here")
    from lookahead_kernels import verify_tree_sample_cpu

    return verify_tree_sample_cpu


def _walk_reference(x_logits, node_logits, tokens, end, n, max_accept, params, uniforms=None, generator=None):
    """The reference walk over the rows ``warp_logits`` makes (padding nodes' NaN rows warped as zeros: never read)."""
    return verify_tree_sample_reference(warp_logits(x_logits, params), warp_logits(node_logits.nan_to_num(0.0), params),
                                        tokens, end, n, max_accept, uniforms, generator=generator)


WARPS = [SamplingParams(1.0, 0, 1.0), SamplingParams(0.7, 0, 0.9), SamplingParams(1.3, 3, 1.0),
         SamplingParams(0.8, 5, 0.6), SamplingParams(1.0, 0, 1.0, 0.2), SamplingParams(0.7, 6, 0.9, 0.1)]


@pytest.mark.parametrize("kind,V,pad,shared,dtype", [
    ("chain", 5, False, True, torch.float32), ("star", 6, False, False, torch.float32),
    ("deep", 9, True, False, torch.float32), ("bushy", 10, True, True, torch.float16),
    ("bushy", 8, False, False, torch.bfloat16), ("linear", (3, 3), True, True, torch.float32),
    ("deep", 7, False, True, torch.float64), ("bushy", 12, True, False, torch.float32),
])
@pytest.mark.parametrize("params", WARPS, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}")
def test_sample_cpu_walk_matches_reference(kind, V, pad, shared, dtype, params):
    """The C++ walk from logits (the CPU's sampled verification) gives the reference's results on the warped rows:
    temperature, top-k and top-p; walks deep and shallow, padded rows (NaN, never read), repeated siblings, ids
    outside the vocabulary, tokens without mass, capped walks, its own draw."""
    walk = _cpu_walk()
    warp = dict(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, min_p=params.min_p)
    for seed in range(4):
        gen = torch.Generator().manual_seed(zlib.crc32(repr((kind, V, pad, shared, str(dtype), params, seed)).encode()))
        B, vocab = 6, 20
        x, nodes, tokens, end, n, depth = sample_tree_case(B, V, vocab, kind, gen, pad, shared)
        x, nodes = x.log().to(dtype), nodes.log().to(dtype)  # exact zeros become -inf logits
        u = draw_tree_uniforms(B, tokens.shape[1], generator=gen)
        u[:, :-1] *= 0.5 if seed % 2 else 1.0
        for A in (depth, max(depth - 1, 0)):
            ref = _walk_reference(x, nodes, tokens, end, n, A, params, u)
            assert_same(ref, walk(x, nodes, tokens, end, n, A, uniforms=u, **warp))
            assert_consistent(ref, tokens, end, n)
        same = (torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed))
        assert_same(_walk_reference(x, nodes, tokens, end, n, depth, params, generator=same[0]),
                    walk(x, nodes, tokens, end, n, depth, generator=same[1], **warp))


def test_sample_cpu_walk_edge_cases():
    """Hand-made cases: zero weights and repeated siblings, an empty tree, a big vocabulary with a sharp nucleus, a
    row without a finite logit; bad arguments refused."""
    walk = _cpu_walk()
    plain = dict(temperature=1.0, top_k=0, top_p=1.0)
    end = torch.tensor([1, 2, 3, 4])
    tokens = torch.tensor([[2, 1, 2, 3]] * 4)
    x = torch.tensor([[0.2, 0.0, 0.3, 0.1, 0.4]] * 4).log()
    nodes = torch.zeros(4, 4, 5)
    u = torch.tensor([[0.1, 0.0, 0.0, 0.0, 0.5], [0.9, 0.0, 0.0, 0.1, 0.5], [0.9, 0.0, 0.0, 0.9, 0.5],
                      [0.9, 0.0, 0.0, 0.9, 0.1]], dtype=torch.float64)
    got = walk(x, nodes, tokens, end, None, 1, uniforms=u, **plain)
    assert got[0].tolist() == [1, 1, 0, 0] and got[2][:, 0].tolist() == [2, 3, 4, 0]
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 12, generator=gen)
    empty = (x, torch.empty(3, 0, 12), torch.empty(3, 0, dtype=torch.long), torch.empty(0, dtype=torch.long), None, 2)
    u = draw_tree_uniforms(3, 0, generator=gen)
    assert_same(_walk_reference(*empty, SamplingParams(0.9, 4, 0.8), u),
                walk(*empty, uniforms=u, temperature=0.9, top_k=4, top_p=0.8))
    vocab, hot = 128256, torch.tensor([5, 20000, 40001, 70000, 127999])
    x = torch.full((5, vocab), -30.0)
    x[:, hot] = torch.tensor([0.3, 0.25, 0.2, 0.15, 0.1]).log()
    x[:, 1000:1010] = torch.tensor(0.001).log()
    args = (x, x[:, None].repeat(1, 4, 1), hot[[0, 1, 2, 3]].expand(5, 4).clone(),
            TreeShape.from_parents([-1, 0, -1, -1]).end, None, 2)
    u = torch.tensor([[0.0, 0.0, 0.99, 0.99, t] for t in (0.0, 0.01, 0.3, 0.8, 0.999)], dtype=torch.float64)
    # (not min-p's WARPS: dropping the tail puts the bonus's uniform 0.3 exactly on a step of this CDF, where
    # float32 weights and the reference's probabilities may round apart)
    for params in (p for p in WARPS if p.min_p == 0):
        warp = dict(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)
        assert_same(_walk_reference(*args, params, u), walk(*args, uniforms=u, **warp))
    dead = torch.full((2, 12), float("-inf"))  # no finite logit at x: every child rejected, no bonus
    got = walk(dead, torch.zeros(2, 3, 12), torch.tensor([[1, 2, 3]] * 2), torch.tensor([3, 3, 3]), None, 3,
               uniforms=torch.zeros(2, 4, dtype=torch.float64), **plain)
    assert got[0].tolist() == [0, 0] and got[2][:, 0].tolist() == [-1, -1]
    with pytest.raises(ValueError, match="uniforms"):
        walk(*args, uniforms=torch.rand(5, 4, dtype=torch.float64), **plain)
    for bad, match in ((dict(plain, temperature=0.0), "temperature"), (dict(plain, top_k=-1), "top_k"),
                       (dict(plain, top_p=1.5), "top_p"), (dict(plain, top_k=2.0), "top_k"),
                       (dict(plain, min_p=-0.5), "min_p")):
        with pytest.raises(ValueError, match=match):
            walk(*args, uniforms=u, **bad)


def _cpu_greedy_walk():
    _cpu_walk()  # skips where the C++ ops did not build
    from lookahead_kernels import verify_tree_greedy_cpu

    return verify_tree_greedy_cpu


@pytest.mark.parametrize("kind,V,pad,shared,ties,dtype", [
    ("chain", 6, False, True, False, torch.float32), ("star", 6, False, False, True, torch.float32),
    ("deep", 10, True, False, False, torch.float32), ("bushy", 10, False, False, True, torch.float32),
    ("bushy", 12, True, True, False, torch.float16), ("linear", (3, 3), False, True, True, torch.bfloat16),
    ("linear", (2, 4), True, True, False, torch.float32), ("deep", 9, True, False, True, torch.float16),
])
def test_greedy_cpu_walk_matches_reference(kind, V, pad, shared, ties, dtype):
    """The C++ greedy walk from logits (the CPU's greedy verification) gives the reference's results: deep and
    capped walks, ties (the first maximum), padded nodes (NaN rows, never read; their tokens the best possible),
    repeated siblings, ids outside the vocabulary, one tree for the batch or one a row, half-precision rows."""
    walk = _cpu_greedy_walk()
    gen = torch.Generator().manual_seed(zlib.crc32(repr((kind, V, pad, shared, ties, str(dtype))).encode()))
    accepted = 0
    for rep in range(3):
        x, nodes, tokens, end, n, depth = greedy_tree_case(5, V, 37, kind, gen, pad, shared, ties, dtype)
        for A in (depth, depth - 1, 0):
            ref = verify_tree_greedy_reference(x, nodes, tokens, end, n, A)
            assert_same(ref, walk(x, nodes, tokens, end, n, A))
            accepted += int(ref[0].sum())
    assert accepted > 0


def test_greedy_cpu_walk_edge_cases():
    """A NaN in a row is its argmax (torch.argmax's rule), a strided node tensor, an empty tree, a big vocabulary;
    a tree that is not a pre-ordered nesting, num_nodes out of range and float64 rows refused."""
    walk = _cpu_greedy_walk()
    end = TreeShape.from_parents([-1, 0, 1, 0, -1]).end
    tokens = torch.tensor([[3, 5, 1, 7, 3]] * 2)
    x, nodes = onehot([3, 3]), onehot([[7, 1, 2, 9, 2]] * 2)
    x[1, 6] = float("nan")  # row 1: the argmax at x is 6, no root carries it
    assert_same(verify_tree_greedy_reference(x, nodes, tokens, end, None, 3), walk(x, nodes, tokens, end, None, 3))
    assert walk(x, nodes, tokens, end, None, 3)[2].tolist() == [[3, 7, 9, -1], [6, -1, -1, -1]]
    wide = torch.randn(2, 5, 30)[:, :, 3:13]  # strided before the vocabulary
    assert_same(verify_tree_greedy_reference(x, wide, tokens, end, None, 3), walk(x, wide, tokens, end, None, 3))
    empty = (x, torch.empty(2, 0, 10), torch.empty(2, 0, dtype=torch.long), torch.empty(0, dtype=torch.long), None, 2)
    assert_same(verify_tree_greedy_reference(*empty), walk(*empty))
    gen = torch.Generator().manual_seed(5)
    big, big_nodes = torch.randn(3, 128256, generator=gen), torch.randn(3, 4, 128256, generator=gen)
    big_tokens = torch.stack([big.argmax(-1), big_nodes[:, 0].argmax(-1), big.argmax(-1), big.argmax(-1)], 1)
    big_end = TreeShape.from_parents([-1, 0, -1, 2]).end
    ref = verify_tree_greedy_reference(big, big_nodes, big_tokens, big_end, None, 3)
    assert ref[0].tolist() == [2, 2, 2]
    assert_same(ref, walk(big, big_nodes, big_tokens, big_end, None, 3))
    with pytest.raises(ValueError, match="pre-order nesting"):
        walk(x, nodes, tokens, torch.tensor([3, 2, 5, 4, 5]), None, 3)  # node 2's subtree runs past node 1's
    with pytest.raises(ValueError, match="end"):
        walk(x, nodes, tokens, torch.tensor([1, 1, 3, 4, 5]), None, 3)
    with pytest.raises(ValueError, match="num_nodes"):
        torch.ops.lookahead_draft.verify_tree_argmax(x, nodes, tokens, end.expand(2, 5).contiguous(),
                                                     torch.tensor([5, 6]), 3)
    with pytest.raises(ValueError, match="float64"):
        walk(x.double(), nodes.double(), tokens, end, None, 3)


def consistent_case(B, V, vocab, gen):
    """Logits that depend only on the path (as a real model's do), with ties, on a bushy tree whose tokens
    follow the argmax often."""
    table = {}

    def row(key):
        if key not in table:
            table[key] = torch.randint(0, 3, (vocab,), generator=gen).float()
        return table[key]

    end, _, parents = tree_batch(B, V, "bushy", gen, False, False)
    tokens = torch.randint(0, 3, (B, V), generator=gen)
    x = torch.stack([row((b,)) for b in range(B)])
    nodes = torch.empty(B, V, vocab)
    for b in range(B):
        paths = []
        for i, p in enumerate(parents[b]):
            prefix = (b,) if p < 0 else paths[p]
            if float(torch.rand((), generator=gen)) < 0.6:
                tokens[b, i] = row(prefix).argmax()
            paths.append(prefix + (int(tokens[b, i]),))
            nodes[b, i] = row(paths[-1])
    return x, nodes, tokens, end, max_depth(parents)


def test_temperature_zero_is_greedy(vk, kernel_device):
    gen = torch.Generator().manual_seed(13)
    B, V, vocab = 4, 9, 30
    x, nodes, tokens, end, depth = to(kernel_device, *consistent_case(B, V, vocab, gen))
    greedy = SamplingParams(temperature=0)
    assert greedy.is_greedy and not SamplingParams().is_greedy
    xp, np_ = warp_logits(x, greedy), warp_logits(nodes, greedy)
    ref = verify_tree_greedy_reference(x, nodes, tokens, end, None, depth)
    assert ref[0].max() >= 2
    u = draw_tree_uniforms(B, V, generator=gen).to(kernel_device)
    assert_same(ref, verify_tree_sample_reference(xp, np_, tokens, end, None, depth, u))
    assert_same(ref, vk.verify_tree_sample(xp, np_, tokens, end, None, depth, u, out=poisoned(B, depth, kernel_device)))


# ---- sampling: the verifier keeps the target distribution ----------------------------------------------------------
VS = 6  # vocabulary of the statistical tests


def model_dist(prefix, seed=0):
    """A known model: the next-token distribution after ``prefix`` (a tuple of tokens), with exact zeros."""
    rng = np.random.default_rng([seed, len(prefix), *prefix])
    w = rng.random(VS) + 0.05
    w[rng.random(VS) < 0.3] = 0
    w[(sum(prefix) + len(prefix)) % VS] += 0.3
    return w / w.sum()


# Trees as (parent, how the token is chosen from the parent's distribution): rank r = the r-th most likely token,
# "zero" = a token of weight 0 there, "dup" = the token of the parent's first child (a repeated sibling).
STAT_TREES = {
    "star3": [(-1, 0), (-1, 1), (-1, 2)],
    "chain": [(-1, 0), (0, 0), (1, 1)],
    "bushy": [(-1, 0), (0, 0), (1, 0), (1, 1), (0, 1), (-1, 1), (5, 0), (5, 2), (-1, 3)],
    "non-trie": [(-1, 0), (-1, "zero"), (-1, "dup"), (2, 0), (-1, 1)],
}


def stat_tree(name, seed=0):
    """(parents, tokens, per-node distributions [V, VS], distribution at x) of a STAT_TREES tree."""
    parents, tokens, paths = [], [], []
    for i, (p, how) in enumerate(STAT_TREES[name]):
        prefix = () if p < 0 else paths[p]
        q = model_dist(prefix, seed)
        if how == "zero":
            t = int(np.flatnonzero(q == 0)[0])
        elif how == "dup":
            t = tokens[parents.index(p)]
        else:
            t = int(np.argsort(-q, kind="stable")[how])
        parents.append(p)
        tokens.append(t)
        paths.append(prefix + (t,))
    return parents, tokens, np.stack([model_dist(path, seed) for path in paths]), model_dist((), seed)


def exact_sequences(parents, tokens, max_accept, seed=0):
    """Exact probability of every emitted sequence: sample token by token from the model while the sampled token
    is a child of the current node (the first child carrying it) and fewer than max_accept nodes are accepted."""
    out = {}

    def walk(node, prefix, prob):
        q = model_dist(prefix, seed)
        kids = [c for c, p in enumerate(parents) if p == node] if len(prefix) < max_accept else []
        for v in np.flatnonzero(q > 0):
            child = next((c for c in kids if tokens[c] == v), None)
            if child is None:
                out[prefix + (int(v),)] = prob * q[v]
            else:
                walk(child, prefix + (int(v),), prob * q[v])

    walk(-1, (), 1.0)
    assert abs(sum(out.values()) - 1) < 1e-9
    return out


def chi2_pvalue(counts: np.ndarray, p: np.ndarray) -> float:
    p = np.asarray(p, dtype=np.float64)
    support = p > 0
    assert counts[~support].sum() == 0, f"tokens with probability 0 were emitted: {counts}"
    expected = p[support] / p[support].sum() * counts.sum()
    return stats.chisquare(counts[support], expected).pvalue


def chi2_sequences(samples, exact, min_expected=5.0) -> float:
    """Chi-square p-value of sampled sequences against exact probabilities; rare sequences share one bin."""
    n = len(samples)
    counts = Counter(samples)
    impossible = [s for s in counts if exact.get(s, 0) <= 0]
    assert not impossible, f"sequences of probability 0 were emitted: {impossible[:5]}"
    keys = sorted(exact, key=exact.get, reverse=True)
    big = [k for k in keys if exact[k] * n >= min_expected] or keys[:1]
    obs = [counts[k] for k in big]
    exp = [exact[k] * n for k in big]
    rest = n - sum(obs)
    rest_exp = n - sum(exp)
    if rest_exp >= min_expected:
        obs.append(rest)
        exp.append(rest_exp)
    else:  # too rare for a bin of its own: joins the least likely kept bin
        obs[-1] += rest
        exp[-1] += rest_exp
    return stats.chisquare(obs, exp).pvalue


def emitted_sequences(out):
    acc, _, emitted = (t.cpu() for t in out)
    return [tuple(emitted[b, : int(acc[b]) + 1].tolist()) for b in range(acc.shape[0])]


def stat_pvalues(out, parents, tokens, p_x, max_accept):
    seqs = emitted_sequences(out)
    first = np.bincount([s[0] for s in seqs], minlength=VS)
    return [chi2_pvalue(first, p_x), chi2_sequences(seqs, exact_sequences(parents, tokens, max_accept))]


@pytest.mark.parametrize("name,max_accept", [("star3", 1), ("chain", 3), ("chain", 2), ("bushy", 3),
                                             ("non-trie", 2)])
@pytest.mark.parametrize("impl", ["reference", "cpu"])
def test_sample_reference_keeps_distribution(name, max_accept, impl):
    """The reference walk, and the C++ walk from the distributions' logits, emit the exact sequence law."""
    if impl == "cpu":
        walk = _cpu_walk()

        def verify_tree_sample_reference(x, nodes, *args, **kwargs):
            return walk(x.log(), nodes.log(), *args, temperature=1.0, top_k=0, top_p=1.0, **kwargs)
    else:
        verify_tree_sample_reference = globals()["verify_tree_sample_reference"]
    parents, tokens, q, p_x = stat_tree(name)
    B, V = 20000, len(parents)
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()) + max_accept)
    end = TreeShape.from_parents(parents).end
    tok = torch.tensor(tokens).expand(B, V)
    x = torch.tensor(p_x).expand(B, VS)
    nodes = torch.tensor(q).expand(B, V, VS)
    out = verify_tree_sample_reference(x, nodes, tok, end, None, max_accept, generator=gen)
    assert min(stat_pvalues(out, parents, tokens, p_x, max_accept)) > 1e-3
    exact = exact_sequences(parents, tokens, max_accept)
    assert out[0].max() == max(len(s) - 1 for s, p in exact.items() if p * B > 50)  # the walk reaches the bottom
    assert_consistent(out, tok, end)
    if name == "non-trie":  # node 1 (weight 0) and node 2 (a repeat of node 0) are never accepted
        assert not ((out[1] == 1) | (out[1] == 2) | (out[1] == 3)).any()


def test_sample_kernel_keeps_distribution(vk, kernel_device):
    """The kernel on several trees in one launch: per-row trees padded to one size, padding made of likely tokens
    that must never be accepted."""
    per_tree = 120 if kernel_device == "cpu" else 20000
    names = ["star3", "chain", "bushy", "non-trie"]
    trees = [stat_tree(name) for name in names]
    V = max(len(t[0]) for t in trees)
    A = 3
    B = per_tree * len(names)
    end = torch.empty(B, V, dtype=torch.long)
    tok = torch.empty(B, V, dtype=torch.long)
    nodes = torch.full((B, V, VS), float("nan"), dtype=torch.float64)
    x = torch.empty(B, VS, dtype=torch.float64)
    n = torch.empty(B, dtype=torch.long)
    for k, (parents, tokens, q, p_x) in enumerate(trees):
        rows = slice(k * per_tree, (k + 1) * per_tree)
        end[rows] = padded_end(parents, V)
        tok[rows] = torch.tensor(tokens + [int(np.argmax(p_x))] * (V - len(tokens)))
        nodes[rows, : len(parents)] = torch.tensor(q)
        x[rows] = torch.tensor(p_x)
        n[rows] = len(parents)
    out = vk.verify_tree_sample(*to(kernel_device, x, nodes, tok, end, n), A,
                                generator=torch.Generator(kernel_device).manual_seed(3))
    assert_consistent(out, tok, end, n)
    for k, (parents, tokens, q, p_x) in enumerate(trees):
        rows = slice(k * per_tree, (k + 1) * per_tree)
        part = tuple(t[rows] for t in out)
        assert min(stat_pvalues(part, parents, tokens, p_x, A)) > 1e-3, names[k]
    assert out[0].max() >= 2


def test_inverse_cdf_boundaries():
    w = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]] * 4, dtype=torch.float64)
    target = torch.tensor([0.0, 0.5, 0.9999, 1.0], dtype=torch.float64)  # 1.0: past the end by "rounding"
    assert inverse_cdf_sample(w, target).tolist() == [1, 3, 3, 3]
    assert inverse_cdf_sample(torch.zeros(1, 3, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)).item() == -1


def test_inverse_cdf_picks_the_first_index_whose_cdf_passes_the_target():
    """As its docstring states it, row by row in Python: zero weights (runs of them, at either end), targets on the
    CDF's steps exactly, past its end, and rows of no mass."""
    gen = torch.Generator().manual_seed(5)
    w = torch.rand(64, 40, generator=gen, dtype=torch.float64)
    w[w < 0.5] = 0.0
    w[:, :3] = 0.0
    w[5] = 0.0
    cdf = w.cumsum(-1)
    target = torch.rand(64, generator=gen, dtype=torch.float64) * cdf[:, -1]
    target[10:20] = cdf[10:20, 7]  # on a step
    target[20:24] = cdf[20:24, -1] * 1.5  # past the end
    want = []
    for row, t in zip(w.tolist(), target.tolist()):
        c, pick = 0.0, None
        for i, x in enumerate(row):
            c += x
            if t < c:
                pick = i
                break
        if pick is None:
            pick = max((i for i, x in enumerate(row) if x > 0), default=-1)
        want.append(pick)
    assert inverse_cdf_sample(w, target).tolist() == want


# ---- warping and row sampling ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [
    (1.0, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.0), (1.3, 5, 1.0, 0.0), (0.9, 0, 0.8, 0.0), (0.6, 10, 0.5, 0.0),
    (1.0, 3, 0.01, 0.0), (2.0, 1000, 0.95, 0.0), (1.0, 0, 1.0, 0.05), (0.8, 20, 0.9, 0.2), (1.5, 0, 1.0, 1.0)])
def test_warp_matches_hf(temperature, top_k, top_p, min_p):
    from transformers.generation.logits_process import (MinPLogitsWarper, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)

    from lookahead.sampling import warp_scores

    gen = torch.Generator().manual_seed(int(temperature * 10) + top_k)
    logits = torch.randn(6, 200, generator=gen) * 3
    params = SamplingParams(temperature, top_k, top_p, min_p)
    probs = warp_logits(logits, params)
    assert probs.dtype == torch.float32 and not probs.isnan().any()
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    if min_p > 0:
        scores = MinPLogitsWarper(min_p)(None, scores)
    ours = warp_scores(logits, params)  # output_scores' rows: the same scores, -inf where removed
    assert torch.equal(torch.isneginf(ours), torch.isneginf(scores))
    torch.testing.assert_close(ours[torch.isfinite(ours)], scores[torch.isfinite(scores)])
    expected = torch.softmax(scores, -1)
    assert torch.equal(probs > 0, expected > 0)
    err = ((probs.double() - expected.double()).abs() / expected.double().clamp_min(1e-30)).max()
    assert err < 1e-5
    torch.testing.assert_close(probs.sum(-1), torch.ones(6))


@pytest.mark.parametrize("params", [
    SamplingParams(typical_p=0.9), SamplingParams(0.7, 0, 1.0, typical_p=0.2), SamplingParams(typical_p=0.999),
    SamplingParams(epsilon_cutoff=0.003), SamplingParams(1.2, 0, 1.0, epsilon_cutoff=0.2),
    SamplingParams(eta_cutoff=0.001), SamplingParams(0.8, 0, 1.0, eta_cutoff=0.3),
    SamplingParams(0.9, 40, 0.95, 0.05, typical_p=0.7, epsilon_cutoff=0.01, eta_cutoff=0.02),
    SamplingParams(top_h=0.4), SamplingParams(1.3, 0, 1.0, top_h=0.9), SamplingParams(0.7, 20, 1.0, 0.05, top_h=0.6)],
    ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}-t{p.typical_p}-e{p.epsilon_cutoff}"
                  f"-n{p.eta_cutoff}-h{p.top_h}")
def test_entropy_cutoffs_match_hf(params):
    """top_h, typical_p, epsilon_cutoff and eta_cutoff among the other warpers, as transformers chains them; rows
    sharp, flat and tied (where removal meets ties, the mask must still be transformers')."""
    from transformers.generation.logits_process import (EpsilonLogitsWarper, EtaLogitsWarper, MinPLogitsWarper,
                                                        TemperatureLogitsWarper, TopHLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper, TypicalLogitsWarper)

    from lookahead.sampling import warp_scores

    gen = torch.Generator().manual_seed(5)
    logits = torch.cat([torch.randn(6, 300, generator=gen) * 4, torch.randn(6, 300, generator=gen) * 0.3,
                        (torch.randn(4, 300, generator=gen) * 2).round()])
    scores = TemperatureLogitsWarper(params.temperature)(None, logits.clone())
    for on, warper in ((params.top_h > 0, lambda: TopHLogitsWarper(params.top_h)),
                       (params.top_k > 0, lambda: TopKLogitsWarper(params.top_k)),
                       (params.top_p < 1, lambda: TopPLogitsWarper(params.top_p)),
                       (params.min_p > 0, lambda: MinPLogitsWarper(params.min_p)),
                       (params.typical_p < 1, lambda: TypicalLogitsWarper(params.typical_p)),
                       (params.epsilon_cutoff > 0, lambda: EpsilonLogitsWarper(params.epsilon_cutoff)),
                       (params.eta_cutoff > 0, lambda: EtaLogitsWarper(params.eta_cutoff, device="cpu"))):
        if on:
            scores = warper()(None, scores)
    ours = warp_scores(logits, params)
    assert torch.equal(torch.isneginf(ours), torch.isneginf(scores))
    assert (~torch.isneginf(ours)).sum(-1).min() >= 1 and torch.isneginf(ours).any()
    torch.testing.assert_close(ours[torch.isfinite(ours)], scores[torch.isfinite(scores)])
    probs = warp_logits(logits, params)
    torch.testing.assert_close(probs, torch.softmax(scores, -1))
    # [..., V] rows: a batch of trees' node rows warp as their flattened rows do
    assert torch.equal(warp_scores(logits.view(2, 8, 300), params).view(16, 300), ours)


@pytest.mark.parametrize("V", [100, 129, 3000])
@pytest.mark.parametrize("scale", [0.3, 3.0, 12.0])
@pytest.mark.parametrize("ties", [False, True])
def test_top_p_among_candidates_keeps_what_the_full_sort_keeps(V, scale, ties):
    """On the CPU top-p first looks for the nucleus among the likeliest ``NUCLEUS_CANDIDATES`` tokens (a sort of the
    whole vocabulary took 6 ms a row): it must keep exactly the tokens a stable descending sort of every token
    keeps, sharp distributions (the nucleus among the candidates) and flat ones (past them: the full sort) alike,
    with ties anywhere, the edge included."""
    from lookahead import sampling

    gen = torch.Generator().manual_seed(V + int(scale * 10) + ties)
    logits = torch.randn(5, V, generator=gen) * scale
    if ties:
        logits = (logits * 2).round() / 2
    probs = torch.softmax(logits, -1)
    for top_p in (0.3, 0.9, 0.99, 1 - 1e-6):
        sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        before = sorted_p.cumsum(-1) - sorted_p
        keep_sorted = before < top_p
        keep_sorted[..., 0] = True
        expected = torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)
        assert torch.equal(sampling._nucleus(probs, top_p), expected), top_p


def test_warp_keeps_at_least_one_and_greedy_one_hot():
    logits = torch.tensor([[0.0, 10.0, 10.0, -1.0]])
    assert warp_logits(logits, SamplingParams(top_p=1e-9)).gt(0).sum() == 1
    assert warp_logits(logits, SamplingParams(temperature=0)).tolist() == [[0.0, 1.0, 0.0, 0.0]]
    assert warp_logits(logits, SamplingParams(top_k=1)).gt(0).sum() == 2  # ties at the k-th value are kept


def test_sample_rows_distribution():
    p = torch.tensor([0.1, 0.0, 0.4, 0.3, 0.2, 0.0])
    gen = torch.Generator().manual_seed(21)
    draws = sample_rows(p.expand(3, 20000, 6), gen)
    assert draws.shape == (3, 20000) and draws.dtype == torch.long
    counts = np.bincount(draws.flatten().numpy(), minlength=6)
    assert chi2_pvalue(counts, p.numpy()) > 1e-3


def test_sample_rows_given_uniforms_draws_what_its_generator_would():
    """Uniforms passed in (a runner's buffer, drawn before the step) give the rows the generator would have."""
    probs = torch.rand(4, 5, 11, generator=torch.Generator().manual_seed(2))
    drawn = sample_rows(probs, torch.Generator().manual_seed(9))
    u = torch.rand(20, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    assert torch.equal(sample_rows(probs, uniforms=u.view(4, 5)), drawn)
    with pytest.raises(ValueError, match="one value per row"):
        sample_rows(probs, uniforms=u[:19])


@pytest.mark.parametrize("params", [SamplingParams(0.7, 0, 0.9), SamplingParams(1.0, 50, 0.95),
                                    SamplingParams(1.3, 0, 0.5), SamplingParams(0.8, 0, 1.0), SamplingParams(1.0, 7, 1.0),
                                    SamplingParams(0.0), SamplingParams(1.0, 0, 1.0, 0.05),
                                    SamplingParams(0.7, 0, 0.9, 0.3), SamplingParams(0.9, typical_p=0.8),
                                    SamplingParams(1.0, 0, 0.9, eta_cutoff=0.01)])
@pytest.mark.parametrize("native", [False, True])
def test_sample_logits_draws_what_sample_rows_draws_from_the_warped_row(params, native, monkeypatch):
    """``sample_logits`` (a plain step's draw; on the CPU with top-p it reads the nucleus's tokens only) picks the
    token ``sample_rows(warp_logits(...))`` picks with the same uniforms or generator: sharp rows (the nucleus
    among the candidates), flat ones (past them), ties, a small vocabulary."""
    from lookahead.sampling import sample_logits
    from lookahead_kernels import cpu_ops

    if native and not cpu_ops.cpu_ops_available():
        pytest.skip("the C++ ops could not be built here")
    monkeypatch.setattr(cpu_ops, "cpu_ops_available", lambda build=True: native)
    gen = torch.Generator().manual_seed(17)
    for V, scale in ((3000, 6.0), (3000, 0.5), (3000, 12.0), (100, 3.0)):
        logits = torch.randn(64, V, generator=gen) * scale
        logits[:8] = (logits[:8] * 2).round() / 2  # ties
        u = torch.rand(64, dtype=torch.float64, generator=gen)
        want = sample_rows(warp_logits(logits, params), uniforms=u)
        assert torch.equal(sample_logits(logits, params, uniforms=u), want), (V, scale)
        drawn = sample_logits(logits, params, torch.Generator().manual_seed(4))
        assert torch.equal(drawn, sample_rows(warp_logits(logits, params), torch.Generator().manual_seed(4)))
    with pytest.raises(ValueError, match="one value per row"):
        sample_logits(torch.randn(3, 3000), SamplingParams(0.7, 0, 0.9), uniforms=torch.rand(2, dtype=torch.float64))


def test_sample_warped_never_draws_a_token_without_mass_and_refuses_bad_arguments():
    """The C++ draw: -inf logits and tokens top-k removes are never drawn (uniforms up to the top of [0, 1));
    arguments outside what it reads are refused."""
    from lookahead_kernels.cpu_ops import cpu_ops_available

    if not cpu_ops_available():
        pytest.skip("the C++ ops could not be built here")
    op = torch.ops.lookahead_draft.sample_warped
    logits = torch.full((4, 300), float("-inf"))
    logits[:, 7], logits[:, 250] = 1.0, 1.5
    u = torch.tensor([0.0, 0.5, 0.999999, 1 - 2 ** -53], dtype=torch.float64)
    for top_k, top_p, min_p in ((0, 1.0, 0.0), (0, 0.99, 0.0), (2, 1.0, 0.0), (1, 1.0, 0.0), (0, 1.0, 0.7),
                                (0, 0.99, 0.7)):
        got = op(logits, 0.9, top_k, top_p, min_p, u)
        assert set(got.tolist()) <= ({250} if top_k == 1 or min_p > 0.6 else {7, 250}), (top_k, top_p, min_p)
    assert op(torch.full((1, 5), float("nan")), 1.0, 0, 1.0, 0.0, u[:1]).tolist() == [-1]
    for args, match in (((logits, 0.0, 0, 1.0, 0.0, u), "temperature"), ((logits, 1.0, -1, 1.0, 0.0, u), "top_k"),
                        ((logits, 1.0, 0, 1.5, 0.0, u), "top_p"), ((logits, 1.0, 0, 1.0, 1.5, u), "min_p"),
                        ((logits, 1.0, 0, 1.0, 0.0, u[:3]), "uniforms"),
                        ((logits.double(), 1.0, 0, 1.0, 0.0, u), "float32")):
        with pytest.raises(ValueError, match=match):
            op(*args)


@pytest.mark.parametrize("kwargs", [dict(temperature=-0.1), dict(temperature=float("nan")), dict(top_p=0.0),
                                    dict(top_p=1.5), dict(top_k=-1), dict(top_k=2.0), dict(top_k=True),
                                    dict(temperature="1"), dict(min_p=-0.1), dict(min_p=1.5), dict(min_p="0.1"),
                                    dict(typical_p=0.0), dict(typical_p=1.2), dict(epsilon_cutoff=1.0),
                                    dict(eta_cutoff=-0.1), dict(eta_cutoff=True)])
def test_bad_sampling_params(kwargs):
    with pytest.raises(ValueError, match="SamplingParams"):
        SamplingParams(**kwargs)


def test_bad_warp_and_sample_inputs():
    with pytest.raises(ValueError, match="logits"):
        warp_logits(torch.zeros(3, dtype=torch.long), SamplingParams())
    with pytest.raises(ValueError, match="SamplingParams"):
        warp_logits(torch.zeros(3), {"temperature": 1.0})
    with pytest.raises(ValueError, match="probs"):
        sample_rows(torch.zeros(2, 0))


# ---- bad arguments --------------------------------------------------------------------------------------------------
def test_bad_verify_arguments(vk, kernel_device):
    dev = kernel_device
    x, nodes = torch.rand(2, 10, device=dev), torch.rand(2, 3, 10, device=dev)
    tokens = torch.zeros(2, 3, dtype=torch.long, device=dev)
    end = torch.tensor([3, 3, 3], device=dev)
    cases = [
        ((x, nodes, tokens.int(), end, None, 2), "int64"),
        ((x, nodes, tokens[0], end, None, 2), r"\[B, V\]"),
        ((x[:1], nodes, tokens, end, None, 2), r"\[B, vocab\]"),
        ((x, nodes[:, :2], tokens, end, None, 2), r"\[B, V, vocab\]"),
        ((x.double(), nodes, tokens, end, None, 2), "dtype"),
        ((x, nodes, tokens, end[:2], None, 2), "end"),
        ((x, nodes, tokens, end.expand(3, 3), None, 2), "end"),
        ((x, nodes, tokens, end.float(), None, 2), "end"),
        ((x, nodes, tokens, end, 4, 2), "0..V"),
        ((x, nodes, tokens, end, torch.tensor([1, 2, 3], device=dev), 2), "int64"),
        ((x, nodes, tokens, end, 1.5, 2), "num_nodes"),
        ((x, nodes, tokens, end, None, -1), "max_accept"),
        ((x, nodes, tokens, end, None, True), "max_accept"),
        ((x, nodes, tokens, end, None, 2.0), "max_accept"),
    ]
    if dev == "cpu":  # values are only checked where reading them costs no synchronisation
        cases += [((x, nodes, tokens, torch.tensor([3, 1, 3]), None, 2), "end"),      # end[1] <= 1
                  ((x, nodes, tokens, torch.tensor([2, 3, 3]), None, 2), "nesting"),  # node 1 runs past node 0
                  ((x, nodes, tokens, end, torch.tensor([1, 4]), 2), "0..V")]
    fns = (vk.verify_tree_greedy, vk.verify_tree_sample, verify_tree_greedy_reference, verify_tree_sample_reference)
    for fn in fns:
        for args, msg in cases:
            with pytest.raises(ValueError, match=msg):
                fn(*args)
    for fn in (vk.verify_tree_sample, verify_tree_sample_reference):
        with pytest.raises(ValueError, match="uniforms"):
            fn(x, nodes, tokens, end, None, 2, torch.rand(2, 3, device=dev))
        with pytest.raises(ValueError, match="either generator or uniforms"):
            fn(x, nodes, tokens, end, None, 2, draw_tree_uniforms(2, 3, dev), torch.Generator(dev))
    with pytest.raises(ValueError, match="out"):
        vk.verify_tree_greedy(x, nodes, tokens, end, None, 2, out=poisoned(2, 3, dev))
    with pytest.raises(ValueError, match="vocab_splits"):
        vk.verify_tree_greedy(x, nodes, tokens, end, None, 2, vocab_splits=0)
    with pytest.raises(ValueError, match=r"\[R, V\]"):
        vk.row_argmax(x[0])


def test_custom_ops_opcheck(vk, kernel_device):
    """Schemas, fake (meta) implementations and mutation declarations of the registered ops."""
    gen = torch.Generator().manual_seed(31)
    B, V, vocab, A = 2, 5, 16, 3
    x, nodes, tokens, end, n, _ = greedy_tree_case(B, V, vocab, "bushy", gen, pad=True)
    x, nodes, tokens, end, n = to(kernel_device, x, nodes, tokens, end, n)
    xp, np_ = torch.softmax(x, -1), torch.softmax(nodes.nan_to_num(), -1)
    u = draw_tree_uniforms(B, V, generator=gen).to(kernel_device)
    tests = ("test_schema", "test_faketensor")
    torch.library.opcheck(torch.ops.lookahead.verify_tree_greedy_out.default,
                          (x, nodes, tokens, end, n, V, A, 0, *poisoned(B, A, kernel_device)), test_utils=tests)
    torch.library.opcheck(torch.ops.lookahead.verify_tree_sample_out.default,
                          (xp, np_, tokens, end, None, V, A, u, *poisoned(B, A, kernel_device)), test_utils=tests)
    torch.library.opcheck(torch.ops.lookahead.row_argmax_out.default,
                          (x, 2, torch.empty(B, dtype=torch.long, device=kernel_device)), test_utils=tests)


_SM90_SCRIPT = r'''
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from lookahead_kernels import verify as vk

assert isinstance(vk._tree_sample_walk_kernel, triton.runtime.JITFunction)
h100 = GPUTarget("cuda", 90, 32)


def build(fn, pointers, consts, ones=(), aligned=()):
    sig = {name: "i32" for name in fn.arg_names}  # sizes and strides
    sig.update(pointers)
    consts = dict(consts, **{name: 1 for name in ones})  # Triton specialises ints equal to 1 as constants
    sig.update({name: "constexpr" for name in consts})
    # ... and pointers and ints divisible by 16 as such
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs), target=h100,
                          options=dict(num_warps=8))


for dtype, ones in (("fp32", ("sxv", "scv", "suv", "stv", "sev", "A")), ("bf16", ("V",))):
    build(vk._tree_sample_walk_kernel,
          dict(x_ptr="*" + dtype, c_ptr="*" + dtype, tok_ptr="*i64", end_ptr="*i64", n_ptr="*i64", u_ptr="*fp64",
               acc_ptr="*i64", path_ptr="*i64", emit_ptr="*i64"),
          dict(HAS_N_TENSOR=not ones, BLOCK_N=128, BLOCK_A=8, BLOCK_V=2048, SUB_V=32), ones)
for dtype, f64 in (("fp16", False), ("fp64", True)):
    build(vk._argmax_partial_kernel,
          dict(x_ptr="*" + dtype, c_ptr="*" + dtype, n_ptr="*i64", val_ptr="*fp64", idx_ptr="*i64"),
          dict(HAS_X=not f64, HAS_N_TENSOR=f64, F64=f64, BLOCK_V=2048), ("sxv", "scv", "K"))
for has_n, ones in ((True, ("stv", "sev")), (False, ("A", "S", "V"))):
    build(vk._tree_greedy_walk_kernel,
          dict(val_ptr="*fp64", idx_ptr="*i64", tok_ptr="*i64", end_ptr="*i64", n_ptr="*i64", acc_ptr="*i64",
               path_ptr="*i64", emit_ptr="*i64"), dict(HAS_N_TENSOR=has_n, BLOCK_N=128, BLOCK_A=8, CHUNK=16), ones)
build(vk._row_argmax_merge_kernel, dict(val_ptr="*fp64", idx_ptr="*i64", out_ptr="*i64"), dict(BLOCK_R=128))
# The launcher's slices are multiples of 16 logits (vk._vocab_slices) so that the partial argmax loads 16 bytes at a
# time: with the slice length, the pointers and strides known divisible by 16 (as Triton specialises them), the
# float32 loads are 4-wide.
ptx = build(vk._argmax_partial_kernel,
            dict(x_ptr="*fp32", c_ptr="*fp32", n_ptr="*i64", val_ptr="*fp64", idx_ptr="*i64"),
            dict(HAS_X=True, HAS_N_TENSOR=False, F64=False, BLOCK_V=2048), ("sxv", "scv", "K"),
            ("x_ptr", "c_ptr", "n_ptr", "val_ptr", "idx_ptr", "V", "sxb", "scb", "scg", "sck", "slice_len")).asm["ptx"]
assert "ld.global.v4.b32" in ptx and "ld.global.b32" not in ptx, "the partial argmax's loads are not 16 bytes wide"
print("sm90 ok")
'''


def test_kernels_compile_for_h100(kernel_device):
    """The interpreter never compiles: build every kernel for sm_90 through ptxas so compiled-path type errors
    (loop-carried types, constexpr specialisation of strides equal to 1) show up without a GPU."""
    run_compile_script(_SM90_SCRIPT, kernel_device, {"TRITON_DEFAULT_FP_FUSION": "1"})


@pytest.mark.parametrize("params", WARPS[1:], ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}")
def test_sampler_verifies_a_cpu_tree_the_same_with_or_without_the_cpp_walk(params, monkeypatch):
    """``Sampler.verify_tree`` on the CPU: the C++ walk from the logits and the torch warp + reference (a CPU
    without the C++ ops) give the same results for the same uniforms, on padded batches of trees."""
    from lookahead.verification import Sampler
    from lookahead_kernels import cpu_ops

    _cpu_walk()
    sampler = Sampler(True, params.temperature, params.top_k, params.top_p, torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(31)
    B, vocab = 5, 300
    x, nodes, tokens, end, n, depth = sample_tree_case(B, 9, vocab, "bushy", gen, pad=True)
    x, nodes = (x.log() * 3).float(), (nodes.log() * 3).float()
    u = draw_tree_uniforms(B, tokens.shape[1], generator=gen)
    native = sampler.verify_tree(x, nodes, tokens, end, n, depth, uniforms=u)
    monkeypatch.setattr(cpu_ops, "cpu_ops_available", lambda build=True: False)
    assert_same(sampler.verify_tree(x, nodes.nan_to_num(0.0), tokens, end, n, depth, uniforms=u), native)


def test_sampler_walks_a_cpu_tree_with_torch_under_the_entropy_cutoffs():
    """The C++ walk does not know typical_p or the epsilon and eta cutoffs: with them, ``Sampler.verify_tree`` takes
    the torch warp and reference walk even where the C++ ops are built."""
    from lookahead.verification import Sampler

    sampler = Sampler(True, 0.9, 0, 1.0, torch.Generator().manual_seed(0), typical_p=0.8, eta_cutoff=0.02)
    params = sampler.params
    assert not params.native
    gen = torch.Generator().manual_seed(8)
    B, vocab = 4, 300
    x, nodes, tokens, end, n, depth = sample_tree_case(B, 9, vocab, "bushy", gen, pad=True)
    x, nodes = (x.log() * 3).float(), (nodes.log() * 3).float().nan_to_num(0.0)
    u = draw_tree_uniforms(B, tokens.shape[1], generator=gen)
    want = verify_tree_sample_reference(warp_logits(x, params), warp_logits(nodes, params), tokens, end, n, depth,
                                        uniforms=u)
    assert_same(sampler.verify_tree(x, nodes, tokens, end, n, depth, uniforms=u), want)
