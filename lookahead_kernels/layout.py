"""The token layout of one lookahead decoding step and its visibility rule.

Vocabulary follows ``shared/design/lookahead-step.md`` and ``shared/design/draft-tree.md``. A step feeds, in
this order:

* the lookahead branch: ``levels`` rows of ``window`` tokens. Row 0, column 0 is ``x`` (the last committed
  token); row 0 columns ``1..window-1`` and rows ``1..levels-1`` are guesses. Token ``(level j, column i)``
  sits at position ``p + i + j``; column ``i`` is the chain ``x, L0[1], .., L0[i], L1[i], .., L_j[i]``.
* the verification branch: a token tree of ``V`` nodes in depth-first pre-order (:class:`TreeShape`); node
  ``i`` sits at position ``p + depth[i]`` and descends from ``x`` through its ancestors ``j <= i < end[j]``.
  The original linear candidates are the tree ``TreeShape.linear(guesses, guess_len)``.

Every new token sees the committed prefix and, among the step's tokens, exactly its ancestors and itself. In the
lookahead branch that follows from a token's (level, column), integer arithmetic on two layout numbers; in the
tree it is one comparison against ``end``. Kernels evaluate both per tile; no mask is stored.

Two special layouts reuse the same rule: a prefill of ``P`` tokens is ``StepLayout(P, 1)`` (level 0 alone is a
causal chain) and a plain decoding step is ``StepLayout(1, 1)``.
"""

from __future__ import annotations

import dataclasses

import torch

from .tree import TreeShape
from .validation import require_int

LOOKAHEAD_BRANCH = 0
VERIFY_BRANCH = 1


@dataclasses.dataclass(frozen=True, eq=False)
class StepLayout:
    """Shape of one step: ``window`` columns and ``levels`` rows of lookahead, then a verification ``tree``.

    ``levels`` is ``ngram - 1`` once the window is warm and smaller during warm-up; ``tree`` is ``None`` (no
    verification branch) or a :class:`TreeShape` of ``V`` nodes, shared by the batch (``[V]``) or per sequence
    (``[B, V]``).
    """

    window: int
    levels: int
    tree: TreeShape | None = None

    def __post_init__(self) -> None:
        require_int("StepLayout.window", self.window, 1)
        require_int("StepLayout.levels", self.levels, 1)
        if self.tree is not None and not isinstance(self.tree, TreeShape):
            raise ValueError(f"StepLayout.tree must be None or a TreeShape, got {type(self.tree).__name__}")

    @classmethod
    def prefill(cls, length: int) -> "StepLayout":
        """A causal block of ``length`` tokens (level 0 of a window that wide)."""
        return cls(length, 1)

    @classmethod
    def linear(cls, window: int, levels: int, guesses: int = 0, guess_len: int = 1, device=None) -> "StepLayout":
        """The original layout: ``guesses`` linear candidates of ``guess_len`` tokens as the tree."""
        tree = TreeShape.linear(guesses, guess_len, device) if guesses else None
        return cls(window, levels, tree)

    @property
    def lookahead_len(self) -> int:
        """Tokens of the lookahead branch, ``x`` included: ``1 + (window-1) + (levels-1)*window``."""
        return self.window * self.levels

    @property
    def tree_size(self) -> int:
        """``V``, nodes of the verification tree (0 without one)."""
        return 0 if self.tree is None else self.tree.size

    @property
    def T(self) -> int:
        """Tokens fed in the step."""
        return self.lookahead_len + self.tree_size

    def _tree_row(self, b):
        """(depth, end) of sequence ``b``'s tree, ``[V]`` each."""
        tree = self.tree
        if not tree.batched:
            return tree.depth, tree.end
        return tree.depth[b], tree.end[b]

    # ---- per-token integers -------------------------------------------------------------------------------
    def token_coords(self, idx: torch.Tensor):
        """(branch, level, column) of lookahead-branch indices; tree tokens get branch 1, level 0, column 0.

        Pure integer arithmetic, usable as a FlexAttention ``mask_mod`` building block and inside kernels.
        """
        la = self.lookahead_len
        is_verify = idx >= la
        zero = torch.zeros_like(idx)
        level = torch.where(is_verify, zero, idx // self.window)
        column = torch.where(is_verify, zero, idx % self.window)
        return is_verify.to(idx.dtype), level, column

    def position_offsets(self, device=None) -> torch.Tensor:
        """LongTensor ``[T]`` (``[B, T]`` for a per-sequence tree): each token's position minus ``p``."""
        la = self.lookahead_len
        idx = torch.arange(la, device=device)
        head = idx // self.window + idx % self.window
        if self.tree is None:
            return head
        depth = self.tree.depth.to(device=head.device, dtype=torch.long)
        if depth.dim() == 2:
            head = head.expand(depth.shape[0], la)
        return torch.cat([head, depth], dim=-1)

    def visible(self, q_idx: torch.Tensor, k_idx: torch.Tensor, b=0) -> torch.Tensor:
        """Whether step token ``q_idx`` attends to step token ``k_idx`` (broadcasting, elementwise).

        ``k`` is visible iff it is ``x``; or both are lookahead tokens and ``k`` is a level-0 token at a column
        ``<=`` the query's or in the query's own column at a level ``<=`` the query's; or both are tree nodes
        ``u_q, u_k`` with ``u_k <= u_q < end[u_k]``. ``b`` picks the sequence of a per-sequence tree.
        """
        la = self.lookahead_len
        bq, lq, cq = self.token_coords(q_idx)
        bk, lk, ck = self.token_coords(k_idx)
        look = (bq == 0) & (bk == 0) & (((lk == 0) & (ck <= cq)) | ((ck == cq) & (lk <= lq)))
        if self.tree is None or self.tree_size == 0:
            return (k_idx == 0) | look
        _, end = self._tree_row(b)
        uq, uk = q_idx - la, k_idx - la
        end_k = end.to(k_idx.device)[torch.clamp(uk, 0, self.tree_size - 1)]
        tree = (bq == 1) & (bk == 1) & (uk <= uq) & (uq < end_k)
        return (k_idx == 0) | look | tree

    def mask_mod(self, cache_len: torch.Tensor | int):
        """A FlexAttention ``mask_mod(b, h, q_idx, kv_idx)`` over cache rows.

        ``kv_idx < cache_len[b]`` is the committed prefix (visible to all); rows from ``cache_len[b]`` on are
        the step's own tokens in layout order; rows past the step are never visible.
        """
        if isinstance(cache_len, int):
            cache_len = torch.tensor([cache_len])

        def mod(b, h, q_idx, kv_idx):
            start = cache_len[b]
            k = kv_idx - start
            in_step = (k >= 0) & (k < self.T)
            kk = torch.clamp(k, 0, self.T - 1)
            return (k < 0) | (in_step & self.visible(q_idx, kk, b))

        return mod

    # ---- rows the decoding loop reads back ------------------------------------------------------------------
    def last_level_rows(self) -> range:
        """Step indices of the last lookahead level (its outputs are the window's new guesses)."""
        start = (self.levels - 1) * self.window
        return range(start, start + self.window)

    def node_row(self, node):
        """Step index of tree node ``node`` (int or tensor)."""
        return self.lookahead_len + node
