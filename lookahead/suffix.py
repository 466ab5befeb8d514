"""Suffix matches: what followed earlier occurrences of the sequence's last tokens (prompt and output).

Code and answers grounded in their input copy long spans; a match of the last ``k`` tokens predicts that what
came after that earlier occurrence comes again. The longer the match, the longer the copy it is trusted with.
Prompt lookup (transformers' ``prompt_lookup_num_tokens``) is the one-candidate, fixed-length special case.
"""

from __future__ import annotations

import torch

from lookahead_kernels.cpu_ops import cpu_ops_available, host_ops


class SuffixIndex:
    """Where each token occurs in the committed sequence; matches are measured from there. Never evicted.

    Indexing is incremental and costs one list append per committed token. A query compares the tokens before
    each earlier occurrence of ``x`` with those before ``x`` itself (up to ``max_match``). Why not a table of every
    context of 1 to ``max_match`` tokens: that costs ``max_match`` tuples per token, which a batch that starts
    lookahead late pays for every prompt at once (16 MT-Bench rows spent ~3% of their call on it).

    Args:
        max_match: longest context matched.
        max_len: longest continuation offered.
    """

    def __init__(self, max_match: int = 8, max_len: int = 32):
        if max_match < 1 or max_len < 1:
            raise ValueError(f"SuffixIndex needs max_match >= 1 and max_len >= 1, got {max_match}, {max_len}")
        self.max_match, self.max_len = max_match, max_len
        self._at: dict[int, list[int]] = {}
        self._indexed = 0
        # The C++ op's copy of the sequence (suffix_spans): int64 [capacity], its first _copied tokens written.
        self._copy = torch.empty(0, dtype=torch.long)
        self._copied = 0

    def _extend(self, sequence: list[int]) -> None:
        # Index every position but the last: an occurrence must have something after it.
        at = self._at
        for j in range(self._indexed, len(sequence) - 1):
            at.setdefault(sequence[j], []).append(j)
        self._indexed = max(self._indexed, len(sequence) - 1)

    def _copy_room(self, sequence: list[int]) -> tuple[torch.Tensor, int]:
        """For :func:`suffix_spans`: the op's copy of the sequence, with room for all of ``sequence`` (grown by
        doubling, so later steps' tokens fit too), and how many of its tokens it holds; the op appends the rest,
        which this counts as copied from now on."""
        n, copied = len(sequence), self._copied
        if n < copied:
            raise ValueError("SuffixIndex: the sequence got shorter; use a new index for a new sequence")
        if n > self._copy.numel():
            grown = torch.empty(max(2 * n, 64), dtype=torch.long)
            grown[:copied] = self._copy[:copied]
            self._copy = grown
        self._copied = n
        return self._copy, copied

    @staticmethod
    def length_for(match: int, max_len: int) -> int:
        """Continuation length trusted to a match of ``match`` tokens: ``4 * match``, at most ``max_len``."""
        return min(max_len, 4 * match)

    def matches(self, sequence: list[int], limit: int) -> list[tuple[tuple, int]]:
        """Up to ``limit`` distinct continuations for the step whose ``x`` is ``sequence[-1]``.

        Returns ``(continuation, match_len)`` pairs, longest match first, most recent occurrence first among
        equal matches; each continuation has ``length_for(match_len)`` tokens or fewer where the sequence ends,
        and one that is a prefix of a continuation already returned is left out.
        """
        if len(sequence) - 1 < self._indexed:
            raise ValueError("SuffixIndex: the sequence got shorter; use a new index for a new sequence")
        self._extend(sequence)
        n = len(sequence)
        cap = min(self.max_match, n - 1)
        found = []
        for j in self._at.get(sequence[-1], ()) if n > 1 else ():
            m = 1  # tokens matched, ending at j and at n - 1
            while m < cap and m <= j and sequence[j - m] == sequence[n - 1 - m]:
                m += 1
            found.append((m, j))
        found.sort(reverse=True)
        out: dict[tuple, int] = {}
        for m, j in found:
            if len(out) >= limit:
                break
            cont = tuple(sequence[j + 1: j + 1 + self.length_for(m, self.max_len)])
            if not covered(cont, out):
                out[cont] = m
        return list(out.items())


def covered(cont: tuple, kept) -> bool:
    """Whether continuation ``cont`` is a prefix of (or equal to) one of the continuations ``kept``: a trie holding
    that one already holds it."""
    return any(prev[: len(cont)] == cont for prev in kept)


def flatten_matches(rows: list[list[tuple[tuple, int]]]) -> tuple[list[int], list[int], list[int], list[int]]:
    """Per row its ``(continuation, match length)`` pairs, flattened as :func:`suffix_spans` returns them."""
    tokens, lens, matches, counts = [], [], [], []
    for found in rows:
        counts.append(len(found))
        for cont, match in found:
            tokens.extend(cont)
            lens.append(len(cont))
            matches.append(match)
    return tokens, lens, matches, counts


def suffix_spans(indexes: list[SuffixIndex], sequences: list[list[int]], limit: int) \
        -> tuple[list[int], list[int], list[int], list[int]]:
    """Every row's :meth:`SuffixIndex.matches` (index ``i`` for ``sequences[i]``) flattened as the C++ draft
    builder takes them (``lookahead_draft.propose``): ``(tokens, lens, matches, counts)``, ``counts[i]``
    continuations for row ``i``, each one's length in ``lens`` and match length in ``matches``, their tokens one
    after another in ``tokens``. One C++ call where the CPU ops are built (the same matches in the same order: 7.5
    us for 4 rows against 10-18 in Python; one row 2.2-2.4 us warm against 2.9-6.1 since the call goes through the
    bindings, session 65), else (or where the indexes' ``max_match`` or ``max_len`` differ) the reference row by
    row."""
    if not indexes:
        return [], [], [], []
    limits = shared_limits(indexes)
    if limits is None or not cpu_ops_available(build=False):
        return flatten_matches([index.matches(sequence, limit) for index, sequence in zip(indexes, sequences)])
    return host_ops().suffix_spans(*span_inputs(indexes, sequences), *limits, limit)


def shared_limits(indexes: list[SuffixIndex]) -> tuple[int, int] | None:
    """``(max_match, max_len)`` where every index has the same ones, as one C++ call takes them (``(1, 1)`` for no
    index); ``None`` where they differ."""
    if not indexes:
        return 1, 1
    limits = (indexes[0].max_match, indexes[0].max_len)
    return limits if all((i.max_match, i.max_len) == limits for i in indexes) else None


def span_inputs(indexes: list[SuffixIndex], sequences: list[list[int]]) -> tuple[list, list[int], list[int], list[int]]:
    """What the C++ op reads for these rows (``lookahead_draft.suffix_spans``' first arguments): each index's copy
    of its sequence, the tokens it holds, the tokens committed since (all rows', one after another) and how many a
    row; each index counts them as copied from now on."""
    buffers, lengths, new_tokens, new_counts = [], [], [], []
    for index, sequence in zip(indexes, sequences):
        buffer, copied = index._copy_room(sequence)
        buffers.append(buffer)
        lengths.append(copied)
        new_tokens.extend(sequence[copied:])
        new_counts.append(len(sequence) - copied)
    return buffers, lengths, new_tokens, new_counts
