"""The n-gram pool, plain Python: the reference every other pool backend must match exactly.

The pool maps a key token to at most ``guess`` continuations of ``ngram - 1`` tokens each, in
least-recently-inserted order (oldest first), as the original implementation keeps them:

* ``insert`` takes n-grams row by row; a continuation already stored under its key is moved to the newest
  end (no duplicate is kept); a key holding more than ``guess`` continuations drops its oldest.
* ``lookup`` returns a key's continuations oldest first and changes nothing.
"""

from __future__ import annotations

from collections import OrderedDict

import torch


class NGramPool:
    """Python n-gram pool: ``key -> OrderedDict[continuation tuple -> None]``."""

    def __init__(self, ngram: int, guess: int):
        if ngram < 2:
            raise ValueError(f"ngram must be >= 2, got {ngram}")
        if guess < 0:
            raise ValueError(f"guess must be >= 0, got {guess}")
        self.ngram = ngram
        self.guess = guess
        self._table: dict[int, OrderedDict] = {}

    def __len__(self) -> int:
        """Number of stored continuations, all keys together."""
        return sum(len(v) for v in self._table.values())

    def insert(self, ngrams: torch.Tensor) -> None:
        """Insert n-grams ``[K, ngram]`` (int); row ``r`` is key ``ngrams[r, 0]``, continuation ``ngrams[r, 1:]``."""
        if self.guess == 0:
            return
        if ngrams.dim() != 2 or ngrams.shape[1] != self.ngram:
            raise ValueError(f"ngrams must be [K, {self.ngram}], got {tuple(ngrams.shape)}")
        for row in ngrams.tolist():
            slot = self._table.setdefault(row[0], OrderedDict())
            cont = tuple(row[1:])
            if cont in slot:
                slot.move_to_end(cont)
            else:
                slot[cont] = None
                if len(slot) > self.guess:
                    slot.popitem(last=False)

    def insert_sequence(self, tokens: torch.Tensor) -> None:
        """Insert every n-gram of a 1-D token sequence, in order."""
        tokens = tokens.reshape(-1)
        if tokens.numel() >= self.ngram:
            self.insert(tokens.unfold(0, self.ngram, 1))

    def lookup(self, key: int) -> torch.Tensor:
        """LongTensor ``[g, ngram-1]`` (``g <= guess``, possibly 0): the key's continuations, oldest first."""
        slot = self._table.get(int(key))
        if not slot:
            return torch.empty(0, self.ngram - 1, dtype=torch.long)
        return torch.tensor(list(slot.keys()), dtype=torch.long)
