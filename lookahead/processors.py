"""A call's logits processors: what transformers' processors do to a row's scores before it samples or takes the
argmax, applied to every row a step chooses or verifies a token from (``x``'s row and the tree's nodes; the
window's guesses need no exactness), each with its own context.

Four kinds, each in its own module: the repetition penalties (:mod:`lookahead.repetition`, the row's tokens or
its prompt's), the rules that count a row's new tokens (:mod:`lookahead.length_rules`: the EOS held off, forced
tokens, the EOS's length penalty, the suppressions), the rules on a row's recent tokens
(:mod:`lookahead.sequence_rules`: ``no_repeat_ngram_size``, ``encoder_no_repeat_ngram_size``, ``sequence_bias``,
``bad_words_ids``, which read the rows' committed sequences, one :class:`~lookahead.sequence_rules.TokenHistory`
they share) and the caller's own (:mod:`lookahead.custom_processors`). Each keeps its per-row state on the model's
device in tensors a ``state(name, shape, dtype)`` factory gives it (a runner's, whose addresses captured graphs
hold, or the call's own), and updates it from the host after each step. All take the same calls:
``start(state, sequences, counts, replayed)``, ``restart(rows, sequences, counts)``, ``add(tokens, counts)``,
``keep(rows)``, ``rows(logits)``, ``tree(node_logits, tokens, end, depth)`` and ``key``.
"""

from __future__ import annotations

import torch

from .custom_processors import CustomProcessors
from .length_rules import LengthRules
from .repetition import PromptPenalty, RepetitionPenalty
from .sequence_rules import NoRepeatNGram, PromptNGrams, SequenceBias, TokenHistory


class LogitsProcessors:
    """The processors of one ``generate`` call, in transformers' order: the sequence bias, the prompt's penalty,
    the repetition penalty, the repeated n-grams, the prompt's n-grams, the bad words, the length rules, then the
    caller's.

    Args:
        vocab_size: the model's vocabulary.
        repetition_penalty: transformers' ``repetition_penalty`` (1.0: none).
        prompt_penalty: ``encoder_repetition_penalty`` (1.0: none).
        no_repeat_ngram_size, prompt_ngram_size: ban a token that would repeat an n-gram of this size of the row's
            sequence, or of its prompt (``encoder_no_repeat_ngram_size``) (0: none).
        sequence_bias, bad_words: ``{tuple of ids: bias}`` (:func:`lookahead.sequence_rules.sequence_biases`,
            :func:`~lookahead.sequence_rules.bad_words`), maybe empty.
        eos: the EOS ids; ``length``: the keywords of :class:`lookahead.length_rules.LengthRules` but ``eos``
            (``min_new``, ``forced_first``, ``forced_last``, ``last``, ``remove_invalid``, ``decay``, ``always``,
            ``at_start``, ``begin``).
        custom: the caller's ``logits_processor`` and ``prefix_allowed_tokens_fn``
            (:class:`lookahead.custom_processors.CustomProcessors`), last, or ``None``.
    """

    def __init__(self, vocab_size: int, repetition_penalty: float = 1.0, *, eos=(), prompt_penalty: float = 1.0,
                 no_repeat_ngram_size: int = 0, prompt_ngram_size: int = 0, sequence_bias=None, bad_words=None,
                 length: dict | None = None, custom: CustomProcessors | None = None):
        self.vocab_size = vocab_size
        self.items = []
        self.custom = custom
        needs_history = no_repeat_ngram_size or prompt_ngram_size or sequence_bias or bad_words
        self.history = TokenHistory() if needs_history else None
        if sequence_bias:
            self.items.append(SequenceBias(sequence_bias, self.history))
        if prompt_penalty != 1.0:
            self.items.append(PromptPenalty(prompt_penalty, vocab_size))
        if repetition_penalty != 1.0:
            self.items.append(RepetitionPenalty(repetition_penalty, vocab_size))
        if no_repeat_ngram_size:
            self.items.append(NoRepeatNGram(no_repeat_ngram_size, self.history))
        if prompt_ngram_size:
            self.items.append(PromptNGrams(prompt_ngram_size, self.history))
        if bad_words:
            self.items.append(SequenceBias(bad_words, self.history, name="bad_words"))
        eos = [t for t in eos if t < vocab_size]  # an EOS outside the vocabulary is never chosen anyway
        rules = LengthRules(eos, **(length or {}))
        if rules:
            self.items.append(rules)
        if custom is not None:
            self.items.append(custom)

    def __bool__(self) -> bool:
        return bool(self.items)

    @property
    def key(self) -> tuple:
        """What a captured graph depends on (the processors' constants; their state is read at its address)."""
        return tuple(p.key for p in self.items)

    def start(self, state, sequences: list[list[int]], counts: list[int], replayed: bool, capacity: int,
              batch_ids: list[int] | None = None) -> None:
        """Before the first step: each row's ``sequences`` (prompt and any tokens so far) and ``counts`` of new
        tokens; ``replayed``: the steps are CUDA graphs; ``capacity``: the longest a row's sequence can grow;
        ``batch_ids``: each row's index among the call's prompts (default: its place), what the caller's
        ``prefix_allowed_tokens_fn`` is called with. Every per-row state is a function of these, so it runs again
        whenever a batch moves to fewer rows (a place refilled restarts alone: :meth:`restart`)."""
        if self.history is not None:
            self.history.start(state, sequences, capacity, replayed)
        for p in self.items:
            p.start(state, sequences, counts, replayed)
        if self.custom is not None and batch_ids is not None:
            self.custom.batch_ids = list(batch_ids)

    def restart(self, rows: list[int], sequences: list[list[int]], counts: list[int], batch_ids: list[int]) -> None:
        """Batch rows ``rows`` now hold other rows (finished rows' places refilled by waiting prompts): their state
        from these rows' ``sequences``, ``counts`` and ``batch_ids``, as :meth:`start` would give it; the other
        rows' stays."""
        if self.history is not None:
            self.history.restart(rows, sequences)
        for p in self.items:
            p.restart(rows, sequences, counts)
        if self.custom is not None:
            for b, i in zip(rows, batch_ids):
                self.custom.batch_ids[b] = i

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
