"""A call's logits processors: what transformers' processors do to a row's scores before it samples or takes the
argmax, applied to every row a step chooses or verifies a token from (``x``'s row and the tree's nodes; the
window's guesses need no exactness), each with its own context.

Three kinds, each in its own module: the repetition penalty (:mod:`lookahead.repetition`, the row's tokens), the
token suppressions (:mod:`lookahead.suppression`, the row's count of new tokens) and the rules on a row's recent
tokens (:mod:`lookahead.sequence_rules`: ``no_repeat_ngram_size``, ``sequence_bias``, ``bad_words_ids``, which
read the rows' committed sequences, one :class:`~lookahead.sequence_rules.TokenHistory` they share). Each keeps
its per-row state on the model's device in tensors a ``state(name, shape, dtype)`` factory gives it (a runner's,
whose addresses captured graphs hold, or the call's own), and updates it from the host after each step. All take
the same calls: ``start(state, sequences, counts, replayed)``, ``add(tokens, counts)``, ``keep(rows)``,
``rows(logits)``, ``tree(node_logits, tokens, end, depth)`` and ``key``.
"""

from __future__ import annotations

import torch

from .custom_processors import CustomProcessors
from .repetition import RepetitionPenalty
from .sequence_rules import NoRepeatNGram, SequenceBias, TokenHistory
from .suppression import TokenSuppression


class LogitsProcessors:
    """The processors of one ``generate`` call, in transformers' order (the sequence bias, the penalty, the repeated
    n-grams, the bad words, then the suppressions).

    Args:
        repetition_penalty: transformers' ``repetition_penalty`` (1.0: none).
        eos: the EOS ids; ``min_new``: suppress them until a row has that many new tokens.
        suppress_tokens, begin_suppress_tokens: ids suppressed always, and for the first new token.
        no_repeat_ngram_size: ban a token that would repeat an n-gram of this size (0: none).
        sequence_bias, bad_words: ``{tuple of ids: bias}`` (:func:`lookahead.sequence_rules.sequence_biases`,
            :func:`~lookahead.sequence_rules.bad_words`), maybe empty.
        custom: the caller's ``logits_processor`` and ``prefix_allowed_tokens_fn``
            (:class:`lookahead.custom_processors.CustomProcessors`), last, or ``None``.
        vocab_size: the model's vocabulary.
    """

    def __init__(self, vocab_size: int, repetition_penalty: float = 1.0, eos=(), min_new: int = 0,
                 suppress_tokens=(), begin_suppress_tokens=(), no_repeat_ngram_size: int = 0, sequence_bias=None,
                 bad_words=None, custom: CustomProcessors | None = None):
        self.vocab_size = vocab_size
        self.items = []
        self.history = TokenHistory() if no_repeat_ngram_size or sequence_bias or bad_words else None
        if sequence_bias:
            self.items.append(SequenceBias(sequence_bias, self.history))
        if repetition_penalty != 1.0:
            self.items.append(RepetitionPenalty(repetition_penalty, vocab_size))
        if no_repeat_ngram_size:
            self.items.append(NoRepeatNGram(no_repeat_ngram_size, self.history))
        if bad_words:
            self.items.append(SequenceBias(bad_words, self.history, name="bad_words"))
        eos = [t for t in eos if t < vocab_size]  # an EOS outside the vocabulary is never chosen anyway
        if (min_new > 0 and eos) or suppress_tokens or begin_suppress_tokens:
            self.items.append(TokenSuppression(eos, min_new, suppress_tokens, begin_suppress_tokens))
        if custom is not None:
            self.items.append(custom)

    def __bool__(self) -> bool:
        return bool(self.items)

    @property
    def key(self) -> tuple:
        """What a captured graph depends on (the processors' constants; their state is read at its address)."""
        return tuple(p.key for p in self.items)

    def start(self, state, sequences: list[list[int]], counts: list[int], replayed: bool, capacity: int) -> None:
        """Before the first step: each row's ``sequences`` (prompt and any tokens so far) and ``counts`` of new
        tokens; ``replayed``: the steps are CUDA graphs; ``capacity``: the longest a row's sequence can grow."""
        if self.history is not None:
            self.history.start(state, sequences, capacity, replayed)
        for p in self.items:
            p.start(state, sequences, counts, replayed)

    def add(self, tokens: list[list[int]], counts: list[int]) -> None:
        """After a step: each row's committed ``tokens`` and its new count of new tokens."""
        if self.history is not None:
            self.history.add(tokens)
        for p in self.items:
            p.add(tokens, counts)

    def keep(self, kept: list[int]) -> None:
        if self.history is not None:
            self.history.keep(kept)
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
