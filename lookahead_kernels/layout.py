"""The token layout of one lookahead decoding step and its visibility rule.

Vocabulary follows ``shared/design/lookahead-step.md``. A step feeds, in this order:

* the lookahead branch: ``levels`` rows of ``window`` tokens. Row 0, column 0 is ``x`` (the last committed
  token); row 0 columns ``1..window-1`` and rows ``1..levels-1`` are guesses. Token ``(level j, column i)``
  sits at position ``p + i + j``; column ``i`` is the chain ``x, L0[1], .., L0[i], L1[i], .., L_j[i]``.
* the verification branch: ``guesses`` candidates of ``guess_len`` tokens; token ``m`` (1-based) of a
  candidate sits at position ``p + m`` and descends from ``x`` through the candidate's earlier tokens.

Every new token sees the committed prefix and, among the step's tokens, exactly its ancestors and itself.
The rule needs only each token's (branch, level, column), which follow from the token's index by integer
arithmetic on the four layout numbers, so kernels evaluate it per tile without any stored mask.

Two special layouts reuse the same rule: a prefill of ``P`` tokens is ``StepLayout(P, 1, 0, 1)`` (level 0
alone is a causal chain) and a plain decoding step is ``StepLayout(1, 1, 0, 1)``.
"""

from __future__ import annotations

import dataclasses

import torch

from .validation import require_int

LOOKAHEAD_BRANCH = 0
VERIFY_BRANCH = 1


@dataclasses.dataclass(frozen=True)
class StepLayout:
    """Shape of one step: ``window`` columns, ``levels`` lookahead rows, ``guesses`` candidates of ``guess_len``.

    ``levels`` is ``ngram - 1`` once the window is warm and smaller during warm-up; ``guesses`` may be 0.
    """

    window: int
    levels: int
    guesses: int = 0
    guess_len: int = 1

    def __post_init__(self) -> None:
        require_int("StepLayout.window", self.window, 1)
        require_int("StepLayout.levels", self.levels, 1)
        require_int("StepLayout.guesses", self.guesses, 0)
        require_int("StepLayout.guess_len", self.guess_len, 1)

    @classmethod
    def prefill(cls, length: int) -> "StepLayout":
        """A causal block of ``length`` tokens (level 0 of a window that wide)."""
        return cls(length, 1, 0, 1)

    @property
    def lookahead_len(self) -> int:
        """Tokens of the lookahead branch, ``x`` included: ``1 + (window-1) + (levels-1)*window``."""
        return self.window * self.levels

    @property
    def T(self) -> int:
        """Tokens fed in the step."""
        return self.lookahead_len + self.guesses * self.guess_len

    # ---- per-token integers -------------------------------------------------------------------------------
    def token_coords(self, idx: torch.Tensor):
        """(branch, level, column) of step-token indices ``idx`` (any integer tensor, elementwise).

        Lookahead tokens: level ``j`` and column ``i``. Verification tokens: level is the 1-based depth ``m``
        inside the candidate and column is the candidate index ``c``. Pure integer arithmetic, so the same
        expression serves as a FlexAttention ``mask_mod`` building block and inside kernels.
        """
        la = self.lookahead_len
        is_verify = idx >= la
        u = torch.clamp(idx - la, min=0)
        level = torch.where(is_verify, u % self.guess_len + 1, idx // self.window)
        column = torch.where(is_verify, u // self.guess_len, idx % self.window)
        return is_verify.to(idx.dtype), level, column

    def position_offsets(self, device=None) -> torch.Tensor:
        """LongTensor ``[T]``: each token's position minus ``p`` (the position of ``x``)."""
        idx = torch.arange(self.T, device=device)
        branch, level, column = self.token_coords(idx)
        return torch.where(branch == VERIFY_BRANCH, level, level + column)

    def visible(self, q_idx: torch.Tensor, k_idx: torch.Tensor) -> torch.Tensor:
        """Whether step token ``q_idx`` attends to step token ``k_idx`` (broadcasting, elementwise).

        ``k`` is visible iff it is ``x``, or it is in the same branch and either (lookahead only) a level-0
        token at a column ``<=`` the query's, or in the query's own column at a level ``<=`` the query's.
        Verification tokens have level >= 1, so the level-0 clause never holds for them.
        """
        bq, lq, cq = self.token_coords(q_idx)
        bk, lk, ck = self.token_coords(k_idx)
        ancestor = ((lk == 0) & (ck <= cq)) | ((ck == cq) & (lk <= lq))
        return (k_idx == 0) | ((bq == bk) & ancestor)

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
            return (k < 0) | (in_step & self.visible(q_idx, kk))

        return mod

    # ---- rows the decoding loop reads back ------------------------------------------------------------------
    def last_level_rows(self) -> range:
        """Step indices of the last lookahead level (its outputs are the window's new guesses)."""
        start = (self.levels - 1) * self.window
        return range(start, start + self.window)

    def candidate_row(self, candidate: int, depth: int) -> int:
        """Step index of token ``depth`` (1-based) of ``candidate``."""
        return self.lookahead_len + candidate * self.guess_len + depth - 1
