"""A call's logits processors: what transformers' processors do to a row's scores before it samples or takes the
argmax, applied to every row a step chooses or verifies a token from (``x``'s row and the tree's nodes; the
window's guesses need no exactness), each with its own context.

Two kinds, each in its own module: the repetition penalty (:mod:`lookahead.repetition`, the row's tokens) and the
token suppressions (:mod:`lookahead.suppression`, the row's count of new tokens). Each keeps its per-row state on
the model's device in tensors a ``state(name, shape, dtype)`` factory gives it (a runner's, whose addresses
captured graphs hold, or the call's own), and updates it from the host after each step. Both take the same
calls: ``start(state, sequences, counts, replayed)``, ``add(tokens, counts)``, ``keep(rows)``, ``rows(logits)``,
``tree(node_logits, tokens, end, depth)`` and ``key``.
"""

from __future__ import annotations

import torch

from .repetition import RepetitionPenalty
from .suppression import TokenSuppression


class LogitsProcessors:
    """The processors of one ``generate`` call, in transformers' order (the penalty, then the suppressions).

    Args:
        repetition_penalty: transformers' ``repetition_penalty`` (1.0: none).
        eos: the EOS ids; ``min_new``: suppress them until a row has that many new tokens.
        suppress_tokens, begin_suppress_tokens: ids suppressed always, and for the first new token.
        vocab_size: the model's vocabulary.
    """

    def __init__(self, vocab_size: int, repetition_penalty: float = 1.0, eos=(), min_new: int = 0,
                 suppress_tokens=(), begin_suppress_tokens=()):
        self.vocab_size = vocab_size
        self.items = []
        if repetition_penalty != 1.0:
            self.items.append(RepetitionPenalty(repetition_penalty, vocab_size))
        eos = [t for t in eos if t < vocab_size]  # an EOS outside the vocabulary is never chosen anyway
        if (min_new > 0 and eos) or suppress_tokens or begin_suppress_tokens:
            self.items.append(TokenSuppression(eos, min_new, suppress_tokens, begin_suppress_tokens))

    def __bool__(self) -> bool:
        return bool(self.items)

    @property
    def key(self) -> tuple:
        """What a captured graph depends on (the processors' constants; their state is read at its address)."""
        return tuple(p.key for p in self.items)

    def start(self, state, sequences: list[list[int]], counts: list[int], replayed: bool) -> None:
        """Before the first step: each row's ``sequences`` (prompt and any tokens so far) and ``counts`` of new
        tokens; ``replayed``: the steps are CUDA graphs."""
        for p in self.items:
            p.start(state, sequences, counts, replayed)

    def add(self, tokens: list[list[int]], counts: list[int]) -> None:
        """After a step: each row's committed ``tokens`` and its new count of new tokens."""
        for p in self.items:
            p.add(tokens, counts)

    def keep(self, kept: list[int]) -> None:
        for p in self.items:
            p.keep(kept)

    def rows(self, logits: torch.Tensor) -> torch.Tensor:
        """``x``'s rows ``[B, V]``, processed (a new tensor)."""
        for p in self.items:
            logits = p.rows(logits)
        return logits

    def tree(self, node_logits: torch.Tensor, tokens: torch.Tensor, end: torch.Tensor,
             depth: torch.Tensor) -> torch.Tensor:
        """A tree's node rows ``[B, N, V]`` (tokens ``[B, N]``; the tree's ``end`` and ``depth``, ``[N]`` or
        ``[B, N]``), processed."""
        for p in self.items:
            node_logits = p.tree(node_logits, tokens, end, depth)
        return node_logits


__all__ = ["LogitsProcessors"]
