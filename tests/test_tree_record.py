"""lookahead_kernels.tree_record: a verified device-tree step's tops written into random tables in one launch, equal to
DeviceSuccessors.record_reference and to a sequential Python reference (every node's under its token, then x's row and
the accepted nodes' under token and pair, a later write to the same token or slot winning), over paths of every length,
repeated tokens, strided inputs as the step passes them; its refusals; its sm_90 build. Triton's interpreter on a CPU,
compiled on a GPU."""

import pytest
import torch

from lookahead.device_tree import PAIR_SLOTS, DeviceSuccessors, StaticTree
from tests.sm90_compile import run_compile_script


@pytest.fixture(scope="module")
def tr():
    from lookahead_kernels import tree_record

    return tree_record


def _step(tree: StaticTree, B: int, vocab: int, g: torch.Generator, device: str):
    """A step's x and tree tokens (columns of a wider block, as the step's token buffer), tops and accepted paths
    (each a chain down the tree, -1 past it), tokens drawn from a small vocabulary so that they repeat."""
    V, k = tree.num_nodes, tree.successors
    A = int(tree.shape.depth.max())
    block = torch.randint(0, vocab, (B, V + 3), generator=g)
    tops = torch.randint(0, vocab, (B, 1 + V, k), generator=g)
    path = torch.full((B, A + 2), -1)[:, :A]  # a slice: strided
    children = {}
    for i, p in enumerate(tree.parents):
        children.setdefault(p, []).append(i)
    for b in range(B):
        node, depth = -1, 0
        while children.get(node) and torch.rand(1, generator=g) < 0.7:
            options = children[node]
            node = options[int(torch.randint(0, len(options), (1,), generator=g))]
            path[b, depth], depth = node, depth + 1
    return block.to(device)[:, 1: 2 + V], tops.to(device), path.to(device)


def _sequential(successors: DeviceSuccessors, fed, tops, path) -> tuple:
    """The tables after the step, written one entry at a time: the nodes in order, then the path (on the CPU)."""
    table, pairs, keys, prev = (t.cpu().clone() for t in successors.tensors())
    j = tops.shape[2]
    for b in range(fed.shape[0]):
        for row in range(1, fed.shape[1]):
            table[b, int(fed[b, row]), :j] = tops[b, row].to(torch.int32)
        before = int(prev[b])
        for row in [0] + [int(n) + 1 for n in path[b] if n >= 0]:
            token = int(fed[b, row])
            table[b, token, :j] = tops[b, row].to(torch.int32)
            slot = DeviceSuccessors.slot(before, token)
            keys[b, slot] = successors.pair_key(before, token)
            pairs[b, slot, :j] = tops[b, row].to(torch.int32)
            before = token
        prev[b] = before
    return table, pairs, keys, prev


@pytest.mark.parametrize("budget,B,vocab", [(1, 1, 5), (4, 3, 6), (9, 4, 40), (32, 2, 8), (64, 3, 50)])
def test_tree_record_equals_the_references(tr, kernel_device, budget, B, vocab):
    tree = StaticTree.best(budget)
    g = torch.Generator().manual_seed(budget * 100 + B)
    kernel = DeviceSuccessors(tree, B, vocab, kernel_device)
    reference = DeviceSuccessors(tree, B, vocab)
    for t in kernel.tensors():  # poisoned: entries never written must stay as they were
        t.copy_(torch.randint(0, vocab, t.shape, generator=g, dtype=t.dtype).to(kernel_device))
    for a, b in zip(reference.tensors(), kernel.tensors()):
        a.copy_(b.cpu())
    for _ in range(4):
        fed, tops, path = _step(tree, B, vocab, g, kernel_device)
        want = _sequential(reference, fed.cpu(), tops.cpu(), path.cpu())
        tr.tree_record(fed, tops, path, kernel.table, kernel.pairs, kernel.pair_keys, kernel.prev)
        reference.record_reference(fed.cpu(), tops.cpu(), path.cpu())
        for got, ref, seq in zip(kernel.tensors(), reference.tensors(), want):
            assert torch.equal(got.cpu(), seq)
            assert torch.equal(ref, seq)


def test_tree_record_refuses_bad_inputs(tr, kernel_device):
    tree = StaticTree.best(4)
    s = DeviceSuccessors(tree, 2, 9, kernel_device)
    fed, tops, path = _step(tree, 2, 9, torch.Generator().manual_seed(0), kernel_device)
    tables = s.tensors()
    with pytest.raises(ValueError, match="tops must be a torch.int64"):
        tr.tree_record(fed, tops.int(), path, *tables)
    with pytest.raises(ValueError, match="table must be contiguous"):
        tr.tree_record(fed, tops, path, s.table.transpose(0, 1), *tables[1:])
    with pytest.raises(ValueError, match=r"path \[B, A <= 64\]"):
        tr.tree_record(fed, tops, path[:1], *tables)
    with pytest.raises(ValueError, match=r"k >= j"):
        tr.tree_record(fed, torch.cat([tops, tops], dim=2), path, *tables)


def test_kernel_compiles_for_h100(kernel_device):
    """Built for sm_90 through ptxas (paths of 8 nodes, 6 successors), without a GPU."""
    run_compile_script(_SM90_SCRIPT, kernel_device)


_SM90_SCRIPT = r'''
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from lookahead_kernels import tree_record as tr

fn = tr._tree_record_kernel
sig = {name: "i32" for name in fn.arg_names}
sig.update(fed_ptr="*i64", tops_ptr="*i64", path_ptr="*i64", table_ptr="*i32", pairs_ptr="*i32", keys_ptr="*i64",
           prev_ptr="*i64")
consts = dict(K=6, SLOTS=%d, A=8, J=8)
sig.update({name: "constexpr" for name in consts})
triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
               options=dict(num_warps=1))
print("sm90 ok")
''' % PAIR_SLOTS
