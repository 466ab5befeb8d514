"""lookahead_kernels.tree_draft: a device tree's tokens read off random tables in one launch, equal to
DeviceSuccessors.draft_reference (torch, a level at a time) over trees of 1 to 64 nodes, vocabularies whose pairs
share slots, and rows of their own; its refusals; its sm_90 build. Triton's interpreter on a CPU, compiled on a
GPU."""

import pytest
import torch

from lookahead.device_tree import PAIR_SLOTS, DeviceSuccessors, StaticTree
from tests.sm90_compile import run_compile_script


@pytest.fixture(scope="module")
def td():
    from lookahead_kernels import tree_draft

    return tree_draft


def _random_successors(tree: StaticTree, B: int, vocab: int, device: str, seed: int) -> DeviceSuccessors:
    """Tables of random tokens, about half of every pair recorded (and so slots shared where the vocabulary's
    pairs collide), random tokens before x."""
    g = torch.Generator().manual_seed(seed)
    successors = DeviceSuccessors(tree, B, vocab, device)
    k = tree.successors
    successors.table.copy_(torch.randint(0, vocab, (B, vocab, k), generator=g, dtype=torch.int32))
    successors.prev.copy_(torch.randint(0, vocab, (B,), generator=g))
    before, token = torch.meshgrid(torch.arange(vocab), torch.arange(vocab), indexing="ij")
    before, token = before.reshape(-1), token.reshape(-1)
    for b in range(B):
        kept = torch.rand(before.shape, generator=g) < 0.5
        slots = DeviceSuccessors.slot(before[kept], token[kept])
        successors.pair_keys[b, slots.to(device)] = successors.pair_key(before[kept], token[kept]).to(device)
        successors.pairs[b, slots.to(device)] = torch.randint(0, vocab, (int(kept.sum()), k), generator=g,
                                                              dtype=torch.int32).to(device)
    return successors


@pytest.mark.parametrize("budget,B,vocab", [(1, 1, 5), (4, 3, 11), (9, 2, 40), (17, 4, 7), (32, 1, 60), (64, 3, 13)])
def test_tree_draft_equals_the_reference(td, kernel_device, budget, B, vocab):
    tree = StaticTree.best(budget)
    successors = _random_successors(tree, B, vocab, kernel_device, seed=budget * 1000 + vocab)
    for trial in range(3):
        x = torch.randint(0, vocab, (B,), generator=torch.Generator().manual_seed(trial)).to(kernel_device)
        if trial == 1:  # a column of a step's tokens, as DeviceTreeFinish.prepare passes x
            x = torch.stack([x, x], dim=1)[:, 0]
        got = td.tree_draft(x, successors.prev, successors.table, successors.pairs, successors.pair_keys,
                            *successors._nodes, successors._depth)
        want = successors.draft_reference(x)
        assert got.dtype == torch.long and got.shape == (B, budget)
        assert torch.equal(got.cpu(), want.cpu())
        if trial == 0:  # the reference really reads pairs here, not only the tokens' own rows
            singles = successors.pair_keys.clone()
            successors.pair_keys.zero_()
            assert not torch.equal(successors.draft_reference(x).cpu(), want.cpu()) or budget == 1
            successors.pair_keys.copy_(singles)


def test_tree_draft_refuses_bad_inputs(td, kernel_device):
    tree = StaticTree.best(4)
    s = _random_successors(tree, 2, 9, kernel_device, seed=1)
    x = torch.zeros(2, dtype=torch.long, device=kernel_device)
    args = [x, s.prev, s.table, s.pairs, s.pair_keys, *s._nodes]
    with pytest.raises(ValueError, match="table must be a contiguous torch.int32"):
        td.tree_draft(*args[:2], s.table.long(), *args[3:], s._depth)
    with pytest.raises(ValueError, match="contiguous"):
        td.tree_draft(*args[:3], s.pairs.transpose(0, 1), *args[4:], s._depth)
    with pytest.raises(ValueError, match=r"prev \[B\]"):
        td.tree_draft(x, s.prev[:1], *args[2:], s._depth)
    with pytest.raises(ValueError, match="power of two"):
        td.tree_draft(*args[:3], s.pairs[:, :3].contiguous(), s.pair_keys[:, :3].contiguous(), *args[5:], s._depth)
    with pytest.raises(ValueError, match="levels"):
        td.tree_draft(*args, 9)
    if kernel_device == "cpu":
        with pytest.raises(ValueError, match="device"):
            td.tree_draft(*args[:2], torch.zeros(2, 9, 1, dtype=torch.int32, device="meta"), *args[3:], s._depth)


def test_kernel_compiles_for_h100(kernel_device):
    """Built for sm_90 through ptxas (a tree of 33 nodes, 7 levels), without a GPU."""
    run_compile_script(_SM90_SCRIPT, kernel_device)


_SM90_SCRIPT = r'''
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from lookahead_kernels import tree_draft as td

fn = td._tree_draft_kernel
sig = {name: "*i32" for name in fn.arg_names}
sig.update(x_ptr="*i64", prev_ptr="*i64", keys_ptr="*i64", out_ptr="*i64", x_stride="i32", vocab="i32", V="i32")
consts = dict(K=4, SLOTS=%d, DEPTH=7, BLOCK=64)
sig.update({name: "constexpr" for name in consts})
triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
               options=dict(num_warps=1))
print("sm90 ok")
''' % PAIR_SLOTS
