"""Suffix matches: what followed earlier occurrences of the sequence's last tokens (prompt and output).

Code and answers grounded in their input copy long spans; a match of the last ``k`` tokens predicts that what
came after that earlier occurrence comes again. The longer the match, the longer the copy it is trusted with.
Prompt lookup (transformers' ``prompt_lookup_num_tokens``) is the one-candidate, fixed-length special case.
"""

from __future__ import annotations


class SuffixIndex:
    """Where every context of 1 to ``max_match`` tokens ends in the committed sequence; never evicted.

    Indexing is incremental: each committed token is indexed once (``max_match`` dictionary entries).

    Args:
        max_match: longest context matched.
        max_len: longest continuation offered.
    """

    def __init__(self, max_match: int = 8, max_len: int = 32):
        if max_match < 1 or max_len < 1:
            raise ValueError(f"SuffixIndex needs max_match >= 1 and max_len >= 1, got {max_match}, {max_len}")
        self.max_match, self.max_len = max_match, max_len
        self._ends: list[dict[tuple, list[int]]] = [{} for _ in range(max_match)]
        self._indexed = 0

    def _extend(self, sequence: list[int]) -> None:
        # Index contexts ending at every position but the last: an occurrence must have something after it.
        for j in range(self._indexed, len(sequence) - 1):
            for c in range(1, min(self.max_match, j + 1) + 1):
                self._ends[c - 1].setdefault(tuple(sequence[j - c + 1: j + 1]), []).append(j)
        self._indexed = max(self._indexed, len(sequence) - 1)

    @staticmethod
    def length_for(match: int, max_len: int) -> int:
        """Continuation length trusted to a match of ``match`` tokens: ``4 * match``, at most ``max_len``."""
        return min(max_len, 4 * match)

    def matches(self, sequence: list[int], limit: int) -> list[tuple[tuple, int]]:
        """Up to ``limit`` distinct continuations for the step whose ``x`` is ``sequence[-1]``.

        Returns ``(continuation, match_len)`` pairs, longest match first, most recent occurrence first among
        equal matches; each continuation has ``length_for(match_len)`` tokens or fewer where the sequence ends.
        """
        if len(sequence) - 1 < self._indexed:
            raise ValueError("SuffixIndex: the sequence got shorter; use a new index for a new sequence")
        self._extend(sequence)
        out: dict[tuple, int] = {}
        n = len(sequence)
        for c in range(min(self.max_match, n - 1), 0, -1):
            for j in reversed(self._ends[c - 1].get(tuple(sequence[n - c:]), ())):
                if len(out) >= limit:
                    return list(out.items())
                cont = tuple(sequence[j + 1: j + 1 + self.length_for(c, self.max_len)])
                if cont and not any(prev[: len(cont)] == cont for prev in out):
                    out[cont] = c
        return list(out.items())
