"""Successor table: for each token, the model's own most likely next tokens, read off logits a step computes.

Every row whose logits a step computes says what the model expects after the token fed there. Keeping the top
``k`` of each (the latest row wins) gives a table ``token -> k next tokens`` from which a draft tree can be grown
breadth-first from ``x`` at no extra model cost ("token recycling").
"""

from __future__ import annotations

import torch


class SuccessorTable:
    """For each token seen, the top-``k`` next tokens last predicted after it with their probabilities among
    those ``k``. The probability, not the rank, is what says how sure the model was, so the builder calibrates
    acceptance by it. Dense host tensors, which the C++ draft builder reads in place.

    Args:
        vocab_size: token ids lie in ``[0, vocab_size)``.
        k: successors kept per token.

    Attributes:
        ids: int32 ``[vocab_size, k]``, each token's successors, most likely first (only the first ``count[t]``
            of row ``t`` are written).
        probs: float32 ``[vocab_size, k]``, their probabilities among the token's top ``k`` (likewise).
        count: int32 ``[vocab_size]``, successors recorded per token (0: none yet).
    """

    def __init__(self, vocab_size: int, k: int = 8):
        if vocab_size < 1 or k < 1:
            raise ValueError(f"SuccessorTable needs vocab_size >= 1 and k >= 1, got {vocab_size}, {k}")
        self.k, self.vocab_size = k, vocab_size
        # Read only up to each token's count: left unwritten, the 3 MB a row (SmolLM2) cost a 16-row batch 15 ms of
        # page faults when it started lookahead.
        self.ids = torch.empty(vocab_size, k, dtype=torch.int32)
        self.probs = torch.empty(vocab_size, k, dtype=torch.float32)
        self.count = torch.zeros(vocab_size, dtype=torch.int32)

    @staticmethod
    def top(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids int64 [R, k'], probs float32 [R, k'])``: each row's top ``k' = min(k, vocab)`` and their softmax
        among themselves, where ``logits [R, vocab]`` are (on their device: a GPU step reads back only these)."""
        top = logits.float().topk(min(k, logits.shape[-1]), dim=-1)
        # The probability among the top k only: a confidence the builder calibrates by measured acceptance, at
        # a fraction of the cost of a softmax over the vocabulary (which took ~6% of a CPU step).
        return top.indices, top.values.softmax(dim=-1)

    def record(self, tokens: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor) -> None:
        """Row ``r`` of ``ids``/``probs`` (as :meth:`top` gives them, on the CPU) becomes the successors of
        ``tokens[r]``; a later row for the same token wins."""
        if tokens.numel() == 0:
            return
        tokens, ids, probs = tokens.reshape(-1).cpu(), ids.cpu(), probs.cpu()
        if int(tokens.min()) < 0 or int(tokens.max()) >= self.vocab_size:
            raise ValueError(f"SuccessorTable: token ids must be in [0, {self.vocab_size})")
        from lookahead_kernels.cpu_ops import cpu_ops_available

        if cpu_ops_available(build=False):
            torch.ops.lookahead_draft.record_successors(self.ids, self.probs, self.count, tokens, ids, probs)
            return
        j = ids.shape[1]
        for t, row_ids, row_probs in zip(tokens.tolist(), ids, probs):  # in order: later rows win
            self.ids[t, :j] = row_ids.to(torch.int32)
            self.probs[t, :j] = row_probs
            self.count[t] = j

    def update(self, tokens: torch.Tensor, logits: torch.Tensor) -> None:
        """Record the top-``k`` of ``logits [R, vocab]`` as the successors of ``tokens [R]`` (later rows win)."""
        if tokens.numel() == 0:
            return
        self.record(tokens, *self.top(logits, self.k))

    def successors(self, token: int) -> list[tuple[int, float]]:
        """``(next token, probability)`` pairs after ``token``, most likely first (empty when none recorded)."""
        n = int(self.count[token])
        return list(zip(self.ids[token, :n].tolist(), self.probs[token, :n].tolist()))
