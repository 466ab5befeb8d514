"""The 2D lookahead window: the last ``N-1`` levels of the Jacobi trajectory over ``W`` columns.

State is a LongTensor ``[levels, W]``. Row 0 column 0 is a placeholder: the step feeds ``x`` there. Token
``(j, i)`` is the guess for position ``p + i + j`` where ``p`` is the position of the step's ``x``.

After a step that accepted ``a`` tokens, the rows and the step's new outputs are stacked into
``S = [L0, .., L_{levels-1}, outputs]`` and re-aligned to the next ``p' = p + 1 + a``:

* warm (``levels == N-1``): ``S[1:, a:]`` — level ``j`` takes old level ``j+1`` from column ``a`` (level 0's
  column 0 becomes the placeholder, so its real tokens start at old column ``1+a``);
* warming up: ``S[:, 1+a:]`` — every row shifts by ``1+a`` columns and the outputs become a new level.

Columns that fall off the right are refilled with tokens drawn from the sequence so far.
"""

from __future__ import annotations

import torch


class LookaheadWindow:
    """Jacobi window of ``window`` columns growing to ``ngram - 1`` levels.

    Args:
        window: ``W``, columns.
        ngram: ``N``; the window is warm at ``N - 1`` levels.
        generator: draws the tokens that fill empty columns (explicit, so runs are reproducible).
    """

    def __init__(self, window: int, ngram: int, generator: torch.Generator):
        self.window = window
        self.max_levels = ngram - 1
        self.generator = generator
        self.tokens = torch.empty(0, window, dtype=torch.long)

    @property
    def levels(self) -> int:
        return self.tokens.shape[0]

    @property
    def warm(self) -> bool:
        return self.levels == self.max_levels

    def _draw(self, source: list, rows: int, cols: int) -> torch.Tensor:
        """``[rows, cols]`` tokens drawn uniformly from ``source`` (a non-empty list of ints: a decoding row's
        committed sequence is one, and indexing it beats keeping a tensor copy of it up to date)."""
        idx = torch.randint(len(source), (rows, cols), generator=self.generator)
        return torch.tensor([source[i] for i in idx.reshape(-1).tolist()], dtype=torch.long).reshape(rows, cols)

    def reset(self, source, levels: int = 1) -> None:
        """Start warm-up: ``levels`` levels of tokens drawn from ``source`` (the prompt: a list of ints or a 1-D
        tensor). More than one: a row that joins a batch whose windows are further on (every row of a step feeds as
        many levels); the drawn levels are guesses like any other, which verification keeps or drops."""
        if not 1 <= levels <= self.max_levels:
            raise ValueError(f"levels must be in [1, {self.max_levels}], got {levels!r}")
        source = source.reshape(-1).tolist() if isinstance(source, torch.Tensor) else list(source)
        self.tokens = self._draw(source, levels, self.window)

    def advance(self, x: int, outputs: torch.Tensor, accepted: int, source, ngrams: bool = True) -> torch.Tensor | None:
        """Slide after a step and return the step's n-grams.

        Args:
            x: the step's input token.
            outputs: the model's new guesses, one per column of the last level (``W`` ints or a LongTensor).
            accepted: ``a``, candidate tokens accepted in the step (the bonus token not counted).
            source: the tokens refills are drawn from (the sequence so far): a list of ints or a 1-D tensor.
            ngrams: ``False``: the caller has no use for the n-grams (no pool to feed, no trace), and a window of
                ``x`` alone then makes none.
        Returns:
            LongTensor ``[W, N]`` of n-grams ``(L0[i], .., L_{N-2}[i], outputs[i])`` when the window was warm
            (``L0[0] = x``), else ``None``.
        """
        if self.window == 1 and self.max_levels == 1:
            # x alone (the automatic mode's step without a window): its one column is x at every step, so there
            # is nothing to slide or refill; the n-gram is x and its guess. A row pays this every step (a tensor:
            # 40 us of a 16-row step's host work on this project's CPU), so it is made only when wanted.
            return torch.tensor([[x, int(outputs[0])]]) if ngrams else None
        stacked = torch.cat([self.tokens, torch.as_tensor(outputs).reshape(1, -1).cpu()], dim=0)
        stacked[0, 0] = x
        ngrams = stacked.t().contiguous() if self.warm else None
        kept = stacked[1:, accepted:] if self.warm else stacked[:, 1 + accepted:]
        missing = self.window - kept.shape[1]
        if missing > 0:
            if isinstance(source, torch.Tensor):
                source = source.reshape(-1).tolist()
            kept = torch.cat([kept, self._draw(source, kept.shape[0], missing)], dim=1)
        self.tokens = kept
        return ngrams


def stack_step_tokens(windows: list[LookaheadWindow | None], xs: list[int], width: int) -> torch.Tensor:
    """LongTensor ``[B, width]``: each row's lookahead branch of its next step, its window's ``levels * W =
    width`` tokens with its ``x`` first; a row without a window (``None``: finished, parked) feeds ``x`` alone."""
    if width == 1:  # every row's branch is its x (the automatic mode on a GPU): nothing of the windows to stack
        return torch.tensor(xs, dtype=torch.long)[:, None]
    out = torch.stack([torch.full((width,), x, dtype=torch.long) if w is None else w.tokens.reshape(-1)
                       for w, x in zip(windows, xs)])
    out[:, 0] = torch.tensor(xs, dtype=torch.long)
    return out
