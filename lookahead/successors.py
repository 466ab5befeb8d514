"""Successor table: for each token, the model's own most likely next tokens, read off logits a step computes.

Every row whose logits a step computes says what the model expects after the token fed there. Keeping the top
``k`` of each (the latest row wins) gives a table ``token -> k next tokens`` from which a draft tree can be grown
breadth-first from ``x`` at no extra model cost ("token recycling").
"""

from __future__ import annotations

import torch


class SuccessorTable:
    """For each token seen, the top-``k`` next tokens last predicted after it with their probabilities among
    those ``k`` (a host dict: the tree builder walks it on the host). The probability, not the rank, is what says
    how sure the model was, so the builder calibrates acceptance by it.

    Args:
        vocab_size: token ids lie in ``[0, vocab_size)``.
        k: successors kept per token.
    """

    def __init__(self, vocab_size: int, k: int = 8):
        if vocab_size < 1 or k < 1:
            raise ValueError(f"SuccessorTable needs vocab_size >= 1 and k >= 1, got {vocab_size}, {k}")
        self.k, self.vocab_size = k, vocab_size
        self._rows: dict[int, list[tuple[int, float]]] = {}

    def update(self, tokens: torch.Tensor, logits: torch.Tensor) -> None:
        """Record the top-``k`` of ``logits [R, vocab]`` and their softmax among themselves as the successors of
        ``tokens [R]`` (later rows win)."""
        if tokens.numel() == 0:
            return
        top = logits.float().topk(min(self.k, logits.shape[-1]), dim=-1)
        # The probability among the top k only: a confidence the builder calibrates by measured acceptance, at
        # a fraction of the cost of a softmax over the vocabulary (which took ~6% of a CPU step).
        probs = top.values.softmax(dim=-1)
        for t, ids, probs in zip(tokens.reshape(-1).tolist(), top.indices.tolist(), probs.tolist()):
            self._rows[t] = list(zip(ids, probs))

    def successors(self, token: int) -> list[tuple[int, float]]:
        """``(next token, probability)`` pairs after ``token``, most likely first (empty when none recorded)."""
        return self._rows.get(token, [])
