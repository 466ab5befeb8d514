"""The tree encoding of the verification branch: shapes, validation and the visibility rule in a layout."""

import pytest
import torch

from lookahead_kernels.attention_ref import dense_mask
from lookahead_kernels.layout import StepLayout
from lookahead_kernels.tree import TreeShape, ancestor_matrix


def test_linear_tree_is_chains_from_x():
    t = TreeShape.linear(2, 3)
    assert t.depth.tolist() == [1, 2, 3, 1, 2, 3]
    assert t.end.tolist() == [3, 3, 3, 6, 6, 6]
    assert t.parents().tolist() == [-1, 0, 1, -1, 3, 4]


def test_from_parents_hand_worked():
    #        x
    #      /   \
    #     0     4
    #    / \
    #   1   3
    #   |
    #   2
    t = TreeShape.from_parents([-1, 0, 1, 0, -1])
    assert t.depth.tolist() == [1, 2, 3, 2, 1]
    assert t.end.tolist() == [4, 3, 3, 4, 5]
    assert t.parents().tolist() == [-1, 0, 1, 0, -1]
    anc = ancestor_matrix(t.end)
    assert anc[:, 2].nonzero().flatten().tolist() == [0, 1, 2]
    assert anc[:, 3].nonzero().flatten().tolist() == [0, 3]


@pytest.mark.parametrize("depth,end,word", [
    ([1, 1], [0, 2], "end"),              # end[0] must exceed 0
    ([1, 1], [3, 2], "end"),              # past V
    ([1, 2, 2], [2, 3, 3], "nesting"),     # node 1's subtree runs past node 0's
    ([1, 1], [2, 2], "depth"),            # node 1 is inside node 0's subtree but has depth 1
])
def test_bad_trees_are_rejected(depth, end, word):
    with pytest.raises(ValueError, match=word):
        TreeShape(torch.tensor(depth), torch.tensor(end))


def test_tree_layout_mask_and_positions():
    tree = TreeShape.from_parents([-1, 0, 1, 0, -1])
    layout = StepLayout(2, 2, tree)
    assert layout.T == 4 + 5
    idx = torch.arange(layout.T)
    got = layout.visible(idx[:, None], idx[None, :]).int()
    # rows/cols: x, L0[1], L1[0], L1[1], n0, n1, n2, n3, n4
    want = torch.tensor([
        [1, 0, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 1, 0, 0, 0, 0, 0],
        [1, 0, 0, 0, 1, 0, 0, 0, 0],
        [1, 0, 0, 0, 1, 1, 0, 0, 0],
        [1, 0, 0, 0, 1, 1, 1, 0, 0],
        [1, 0, 0, 0, 1, 0, 0, 1, 0],
        [1, 0, 0, 0, 0, 0, 0, 0, 1],
    ])
    assert torch.equal(got, want)
    assert layout.position_offsets().tolist() == [0, 1, 1, 2, 1, 2, 3, 2, 1]
    m = dense_mask(layout, cache_len=3, kv_len=3 + layout.T)
    assert m[:, :3].all() and torch.equal(m[:, 3:].int(), want)


def test_batched_tree_layout_picks_each_row():
    a = TreeShape.from_parents([-1, 0, 1])   # a chain
    b = TreeShape.from_parents([-1, -1, -1])  # a star
    tree = TreeShape(torch.stack([a.depth, b.depth]), torch.stack([a.end, b.end]))
    layout = StepLayout(1, 1, tree)
    idx = torch.arange(layout.T)
    chain = layout.visible(idx[:, None], idx[None, :], 0)
    star = layout.visible(idx[:, None], idx[None, :], 1)
    assert torch.equal(chain, torch.ones(4, 4, dtype=torch.bool).tril())
    assert torch.equal(star, torch.eye(4, dtype=torch.bool) | (idx[None, :] == 0))
    assert layout.position_offsets().tolist() == [[0, 1, 2, 3], [0, 1, 1, 1]]
