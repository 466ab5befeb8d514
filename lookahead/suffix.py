"""Suffix matches: what followed earlier occurrences of the sequence's last tokens (prompt and output).

Code and answers grounded in their input copy long spans; a match of the last ``k`` tokens predicts that what
came after that earlier occurrence comes again. The longer the match, the longer the copy it is trusted with.
Prompt lookup (transformers' ``prompt_lookup_num_tokens``) is the one-candidate, fixed-length special case.
"""

from __future__ import annotations


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

    def _extend(self, sequence: list[int]) -> None:
        # Index every position but the last: an occurrence must have something after it.
        at = self._at
        for j in range(self._indexed, len(sequence) - 1):
            at.setdefault(sequence[j], []).append(j)
        self._indexed = max(self._indexed, len(sequence) - 1)

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
            if not any(prev[: len(cont)] == cont for prev in out):
                out[cont] = m
        return list(out.items())
