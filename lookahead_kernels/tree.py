"""The verification branch of a step as a token tree (``shared/design/draft-tree.md``).

Nodes ``0..V-1`` are numbered in depth-first pre-order. Per node two integers describe the shape:

* ``depth[i] >= 1``: distance from ``x``; the node sits at position ``p + depth[i]``;
* ``end[i]``: one past the last node of its subtree (``i < end[i] <= V``).

Node ``j`` is an ancestor of ``i`` or ``i`` itself iff ``j <= i < end[j]``: that one comparison is the whole
visibility rule, so kernels evaluate it from the ``end`` array alone and no mask is ever stored. Padding to a
constant shape appends leaves (``end[i] = i + 1``, ``depth[i] = 1``) after the real nodes; the verifier is told
how many nodes are real and never accepts the rest.

``depth`` and ``end`` are int64 tensors ``[V]`` (one tree shared by every sequence of the batch) or ``[B, V]``
(a tree per sequence), on any device. The node tokens are not part of the shape: they are step inputs.
"""

from __future__ import annotations

import dataclasses

import torch

from .validation import require_int


@dataclasses.dataclass(frozen=True, eq=False)
class TreeShape:
    """``depth`` and ``end`` of a verification tree; see the module docstring.

    Checked on construction when the tensors are on the CPU (a device tensor is never read back).
    """

    depth: torch.Tensor
    end: torch.Tensor

    def __post_init__(self) -> None:
        for name in ("depth", "end"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dim() not in (1, 2) or t.is_floating_point() \
                    or t.dtype == torch.bool:
                desc = (t.dtype, tuple(t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"TreeShape.{name} must be an integer tensor [V] or [B, V], got {desc}")
        if self.depth.shape != self.end.shape:
            raise ValueError(f"TreeShape.depth {tuple(self.depth.shape)} and end {tuple(self.end.shape)} must "
                             f"have one shape")
        if self.depth.device != self.end.device:
            raise ValueError(f"TreeShape.depth is on {self.depth.device} but end is on {self.end.device}")
        if self.end.device.type == "cpu" and self.size:
            check_tree(self.depth, self.end)

    @classmethod
    def trusted(cls, depth: torch.Tensor, end: torch.Tensor) -> "TreeShape":
        """A shape whose maker guarantees the encoding (the C++ draft builder, whose trees its tests check), not
        checked again: the check builds ``[V, V]`` matrices, a tenth of a millisecond a step at ``V = 256``."""
        shape = object.__new__(cls)
        object.__setattr__(shape, "depth", depth)
        object.__setattr__(shape, "end", end)
        return shape

    @property
    def size(self) -> int:
        """``V``, nodes in the tree (padding included)."""
        return self.end.shape[-1]

    @property
    def batched(self) -> bool:
        return self.end.dim() == 2

    def row(self, b: int) -> "TreeShape":
        """The tree of sequence ``b`` (the shared tree when not batched)."""
        if not self.batched:
            return self
        return TreeShape(self.depth[b], self.end[b])

    def to(self, device) -> "TreeShape":
        return TreeShape.trusted(self.depth.to(device), self.end.to(device))  # checked when it was made

    @classmethod
    def linear(cls, guesses: int, guess_len: int, device=None) -> "TreeShape":
        """``guesses`` chains of ``guess_len`` tokens from ``x``: the original lookahead candidates.

        Candidate ``c``, token ``m`` (1-based) is node ``c * guess_len + m - 1``."""
        require_int("TreeShape.linear guesses", guesses, 0)
        require_int("TreeShape.linear guess_len", guess_len, 1)
        idx = torch.arange(guesses * guess_len, device=device)
        return cls(idx % guess_len + 1, (idx // guess_len + 1) * guess_len)

    @classmethod
    def from_parents(cls, parents, device=None) -> "TreeShape":
        """Shape of a pre-ordered tree given each node's parent index (``-1`` for a child of ``x``).

        ``parents[i] < i``; the numbering must already be depth-first pre-order (each subtree contiguous).
        """
        parents = [int(p) for p in parents]
        V = len(parents)
        depth = [0] * V
        end = list(range(1, V + 1))
        for i, p in enumerate(parents):
            if not -1 <= p < i:
                raise ValueError(f"parent of node {i} must be -1 or an earlier node, got {p}")
            depth[i] = 1 if p < 0 else depth[p] + 1
        for i in range(V - 1, -1, -1):  # children come after parents: fold subtree ends upwards
            p = parents[i]
            if p >= 0:
                end[p] = max(end[p], end[i])
        return cls(torch.tensor(depth, dtype=torch.long, device=device),
                   torch.tensor(end, dtype=torch.long, device=device))

    def parents(self) -> torch.Tensor:
        """LongTensor like ``end``: each node's parent (``-1`` for children of ``x``)."""
        V = self.size
        if V == 0:
            return self.end.clone()
        idx = torch.arange(V, device=self.end.device)
        anc = ancestor_matrix(self.end)  # [..., j, i]
        strict = anc & (idx[:, None] < idx[None, :])
        # The parent is the nearest strict ancestor: the largest such j.
        cand = torch.where(strict, idx[:, None].expand_as(strict), torch.full_like(strict, -1, dtype=torch.long))
        return cand.max(dim=-2).values


def ancestor_matrix(end: torch.Tensor) -> torch.Tensor:
    """BoolTensor ``[..., V, V]``: entry ``[j, i]`` says node ``j`` is an ancestor of ``i`` or ``i`` itself."""
    V = end.shape[-1]
    idx = torch.arange(V, device=end.device)
    j, i = idx[:, None], idx[None, :]
    return (j <= i) & (i < end[..., :, None])


def check_tree(depth: torch.Tensor, end: torch.Tensor) -> None:
    """Raise ``ValueError`` unless ``depth``/``end`` ([V] or [B, V]) encode pre-ordered trees."""
    V = end.shape[-1]
    idx = torch.arange(V, device=end.device)
    if bool((end <= idx).any()) or bool((end > V).any()):
        raise ValueError(f"tree end[i] must satisfy i < end[i] <= V={V}, got {end.tolist()}")
    anc = ancestor_matrix(end)
    # Subtrees nest: a node inside j's subtree ends no later than j's subtree.
    if bool((anc & (end[..., None, :] > end[..., :, None])).any()):
        raise ValueError(f"tree end array is not a pre-order nesting of subtrees: {end.tolist()}")
    # A node's depth is the number of its ancestors, itself included.
    if not torch.equal(anc.sum(dim=-2).to(depth.dtype), depth):
        raise ValueError(f"tree depth must be 1 + the number of strict ancestors; got depth {depth.tolist()} "
                         f"for end {end.tolist()}")


# A device tree's pair table (lookahead.device_tree; on a GPU lookahead_kernels.tree_draft's pair_slot_key, which
# both kernels use): the pair of tokens (a, b) has the slot (a * PAIR_MUL_A + b * PAIR_MUL_B) & (slots - 1) of a
# row's direct-mapped table of ``slots`` (a power of two), holding the key pair_key(a, b, vocab).
PAIR_MUL_A, PAIR_MUL_B = 1000003, 7919
# A node's grandparent index where it has none in the tree: a child of x reads the pair (the token before x, x), a
# child of a child of x the pair (x, its parent).
BEFORE_X, X = -2, -1


def pair_slot(before, token, slots: int):
    """The slot of the pair ``before``, ``token`` (ints or int64 tensors of one shape) among ``slots``."""
    return (before * PAIR_MUL_A + token * PAIR_MUL_B) & (slots - 1)


def pair_key(before, token, vocab: int):
    """What a slot holding the pair ``before``, ``token`` stores (never 0, which marks an empty slot)."""
    return before * vocab + token + 1
