"""Draft memory: the text of earlier calls as a guess source for later ones.

A model asked many prompts (a file of prompts, a server's requests, a session of code completions) writes the same
phrases, idioms and boilerplate again from one answer to the next. A :class:`DraftMemory` keeps finished sequences
(prompt and output) and offers, for a step whose last tokens occurred in them, what followed there: the suffix
source's matches (:mod:`lookahead.suffix`), looked up in earlier calls' text instead of the call's own. Its
continuations join the row's own suffix matches and are verified like any guess, so the output stays the model's
own (greedy: the same tokens; sampling: the same distribution). Predicted on the H200's step table
(session 59, ``bench/MEASUREMENTS.md``): HumanEval 2.13x -> 2.55x plain decoding, MT-Bench 1.65x -> 1.70x, 40
prompts a set decoded one after another with one memory.

It also carries each model's successor table (:mod:`lookahead.successors`) from one call to the next: a call that
starts with the table its model's earlier calls filled has successors to offer from its first step, where a table
of its own is empty until its steps fill it. Predicted as above (session 62): MT-Bench 1.70x -> 1.75x (1.99 -> 2.12
tokens a step), HumanEval 2.55x -> 2.61x (3.11 -> 3.27).

The memory is an explicit object: ``generate(..., draft_memory=memory)`` reads it at each lookahead step and adds
each row's sequence to it as the row finishes. Nothing is kept unless one is passed.
"""

from __future__ import annotations

import bisect
import threading
import weakref
from array import array

from .successors import SuccessorTable
from .suffix import SuffixIndex, covered

# A match is keyed by its last two tokens: one token of an earlier call's text matches too often (every comma) to
# be worth a guess, and a key of two keeps each lookup to the occurrences that can match.
MIN_MATCH = 2


class DraftMemory:
    """Finished sequences kept for suffix matches of later calls' steps.

    Args:
        max_tokens: tokens kept; past it the oldest sequences are dropped (a quarter of it at a time).
        max_match: longest match measured, in tokens.
        max_len: longest continuation offered.
        scan: most recent occurrences of a step's last two tokens examined per lookup (bounds a lookup's cost
            however much is kept).
    Raises:
        ValueError: on a size below its minimum (``max_tokens``, ``scan`` >= 1; ``max_match`` >= 2;
            ``max_len`` >= 1).

    One memory may serve any models with the same tokenizer: the text is token ids only, and each model has a
    successor table of its own (:meth:`successor_table`; 8 bytes a vocabulary entry, 0.4 MB for SmolLM2, plus 8 k
    bytes a token it has seen), kept while the model lives. Safe to share between threads (a lock guards it; a
    model's calls, which alone touch its table, run one at a time).
    """

    def __init__(self, max_tokens: int = 1_000_000, *, max_match: int = 8, max_len: int = 32, scan: int = 64):
        for name, value, least in (("max_tokens", max_tokens, 1), ("max_match", max_match, MIN_MATCH),
                                   ("max_len", max_len, 1), ("scan", scan, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"DraftMemory's {name} must be an int >= {least}, got {value!r}")
        self.max_tokens, self.max_match, self.max_len, self.scan = max_tokens, max_match, max_len, scan
        self._lock = threading.Lock()
        self._clear()
        self._tables = weakref.WeakKeyDictionary()  # model -> its SuccessorTable

    def _clear(self) -> None:
        self._tokens = array("q")  # every kept sequence, one after another
        self._starts: list[int] = []  # where each begins in _tokens
        self._at: dict[tuple[int, int], list[int]] = {}  # (token before, token) -> positions of the token, oldest first

    def __len__(self) -> int:
        """Tokens kept."""
        return len(self._tokens)

    @property
    def sequences(self) -> int:
        """Sequences kept."""
        return len(self._starts)

    def clear(self) -> None:
        """Forget everything kept: the text and the successor tables."""
        with self._lock:
            self._clear()
            self._tables.clear()

    def successor_table(self, model, vocab_size: int, k: int) -> SuccessorTable:
        """The successor table that ``model``'s calls with this memory share (``generate`` reads and fills it in
        place of a table of the call's own): made on the first ask, and anew if asked with another ``vocab_size``
        or ``k``."""
        with self._lock:
            table = self._tables.get(model)
            if table is None or (table.vocab_size, table.k) != (vocab_size, k):
                table = self._tables[model] = SuccessorTable(vocab_size, k)
            return table

    def add(self, sequence) -> None:
        """Keep ``sequence`` (a list of token ids or a 1-D integer tensor: a prompt and its output). Sequences of
        fewer than three tokens have nothing to offer and are not kept; one longer than ``max_tokens`` keeps its
        last ``max_tokens``."""
        tokens = [int(t) for t in (sequence.tolist() if hasattr(sequence, "tolist") else sequence)]
        if tokens and min(tokens) < 0:
            raise ValueError(f"DraftMemory.add takes token ids >= 0, got {min(tokens)}")
        if len(tokens) < MIN_MATCH + 1:
            return
        tokens = tokens[-self.max_tokens:]
        with self._lock:
            if len(self._tokens) + len(tokens) > self.max_tokens:
                self._drop_oldest(len(self._tokens) + len(tokens) - self.max_tokens // 4 * 3)
            self._append(tokens)

    def _append(self, tokens: list[int]) -> None:
        start = len(self._tokens)
        self._starts.append(start)
        self._tokens.extend(tokens)
        at = self._at
        # Index every position with a token before it and one after it (a match needs both), in the same sequence.
        for j in range(1, len(tokens) - 1):
            at.setdefault((tokens[j - 1], tokens[j]), []).append(start + j)

    def _drop_oldest(self, at_least: int) -> None:
        """Drop whole sequences from the oldest until ``at_least`` tokens are gone (all of them if need be), and
        index the rest again."""
        ends = self._starts[1:] + [len(self._tokens)]
        keep = next((i for i, end in enumerate(ends) if end >= at_least), len(ends)) + 1
        kept = [self._tokens[s:e].tolist() for s, e in zip(self._starts[keep:], ends[keep:])]
        self._clear()
        for tokens in kept:
            self._append(tokens)

    def matches(self, sequence: list[int], limit: int, vocab_size: int | None = None) -> list[tuple[tuple, int]]:
        """Up to ``limit`` distinct continuations from the kept sequences for the step whose ``x`` is
        ``sequence[-1]``, as :meth:`lookahead.suffix.SuffixIndex.matches` gives them: ``(continuation,
        match_len)`` pairs, longest match first (at least two tokens), most recent first among equal matches,
        each continuation ``SuffixIndex.length_for(match_len)`` tokens long or shorter where its sequence ends (or,
        given ``vocab_size``, before its first token outside ``[0, vocab_size)``: a memory another tokenizer's model
        filled offers only what this model can be fed); one that is a prefix of a continuation already returned is
        left out."""
        n = len(sequence)
        if n < MIN_MATCH or limit < 1:
            return []
        with self._lock:
            occurrences = self._at.get((sequence[-2], sequence[-1]))
            if not occurrences:
                return []
            tokens, starts = self._tokens, self._starts
            found = []
            for p in reversed(occurrences[-self.scan:]):  # most recent first: sort keeps their order per length
                first = starts[bisect.bisect_right(starts, p) - 1]
                m = MIN_MATCH
                while m < self.max_match and m < n and p - m >= first and tokens[p - m] == sequence[n - 1 - m]:
                    m += 1
                found.append((m, p))
            found.sort(key=lambda f: -f[0])
            out: list[tuple[tuple, int]] = []
            for m, p in found:
                index = bisect.bisect_right(starts, p)
                end = starts[index] if index < len(starts) else len(tokens)
                cont = tuple(tokens[p + 1: min(end, p + 1 + SuffixIndex.length_for(m, self.max_len))])
                if vocab_size is not None and max(cont) >= vocab_size:
                    cont = cont[: next(i for i, t in enumerate(cont) if t >= vocab_size)]
                if cont and not covered(cont, (prev for prev, _ in out)):
                    out.append((cont, m))
                    if len(out) >= limit:
                        break
            return out


def merged_matches(own: list[tuple[tuple, int]], remembered: list[tuple[tuple, int]]) \
        -> list[tuple[tuple, int]]:
    """A row's own suffix matches followed by the memory's that are not a prefix of one of them, longest match
    first (the row's own first among equal lengths): the suffix source's list for the draft builder."""
    out = list(own)
    for cont, match in remembered:
        if not covered(cont, (prev for prev, _ in out)):
            out.append((cont, match))
    out.sort(key=lambda cm: -cm[1])
    return out
