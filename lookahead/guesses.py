"""Where a step's verification candidates come from: the n-gram pool, behind one small interface.

The decoding loop talks only to a :class:`GuessSource`; it never touches the pool directly. With every
``pool_*`` improvement off, the source is the original implementation's: one pool keyed by the input token ``x``
(any backend of :func:`lookahead.pools.make_pool`), fed with the window's n-grams (and the prompt's when
``pool_from_prompt``). Three options of :class:`LookaheadConfig` improve the guesses; none changes what is
verified or accepted, only which candidates are offered, so greedy output stays the model's own:

* ``pool_two_token_key``: a bounded hashed :class:`NGramTable` keyed by ``(sequence[-2], x)`` is asked first;
  the one-token pool fills up the rest, de-duplicated.
* ``pool_rank_by_hits``: continuations remember how many of their tokens were accepted; keys offer the most hit,
  then the most recently used first, and a full key evicts its least-hit one. The one-token pool is then a
  Python :class:`NGramTable` (the C++/CUDA tables keep no hit counts).
* ``pool_from_output``: the n-grams ending in each step's committed tokens are added too.

Two-token keys of the window's n-grams. Column ``i``'s n-gram ``(L0[i], .., L_{N-2}[i], new[i])`` starts at
position ``p + i`` (``L0[0] = x`` at ``p``). The token before it, at ``p + i - 1``, is on the column's own chain:
for ``i = 0`` it is the committed token before ``x`` (``sequence[p - 1]``), for ``i > 0`` it is ``L0[i-1]``, the
previous column's level-0 token (``ngrams[i-1, 0]``). So column ``i`` is stored under ``(ngrams[i-1, 0],
ngrams[i, 0])`` and column 0 under ``(sequence[p-1], x)``, exactly the key a later step looks up when the
sequence reaches that point. Prompt and output n-grams take the previous token of the sequence.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from .config import LookaheadConfig

# How many consecutive slots a two-token key may occupy (linear probing); a full run evicts its least recently
# used key. Small, so that a lookup reads a bounded, contiguous part of the table.
PROBE = 4


def _mix(key: tuple[int, ...]) -> int:
    """A fixed 64-bit mix of the key tokens (Python's ``hash`` is fine too, but this one is spelled out so a
    table port to C++/CUDA can reproduce the slot choice)."""
    h = 0x9E3779B97F4A7C15
    for t in key:
        h = ((h ^ (t & 0xFFFFFFFF)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h


class NGramTable:
    """Continuations of ``ngram - 1`` tokens under keys of ``key_len`` tokens, with hit counts.

    Each key keeps at most ``per_key`` continuations in an ``OrderedDict[continuation -> hits]`` ordered by
    recency (oldest first; inserting or crediting one moves it to the newest end).

    Args:
        key_len: tokens per key (1: the original pool's key ``x``; 2: ``(previous token, x)``).
        ngram: ``N``; rows given to :meth:`insert` have ``key_len + N - 1`` tokens.
        per_key: continuations kept per key (``G``).
        ranked: offer by hits then most recently used, and evict the least-hit (oldest among equals, never the
            one just inserted); otherwise offer oldest first and evict the oldest, like the original pool.
        slots: ``None``: one entry per key, unbounded in the number of keys (a one-token table holds at most the
            vocabulary). An integer: a fixed table of that many slots; each slot stores its full key, so keys
            that hash to the same slots are told apart on lookup and never share continuations; a key whose
            ``PROBE`` slots are all taken by other keys replaces the least recently used of them.
    """

    def __init__(self, key_len: int, ngram: int, per_key: int, ranked: bool, slots: int | None = None):
        if key_len < 1 or ngram < 2 or per_key < 0 or (slots is not None and slots < 1):
            raise ValueError(f"NGramTable needs key_len >= 1, ngram >= 2, per_key >= 0 and slots None or >= 1, got "
                             f"key_len={key_len}, ngram={ngram}, per_key={per_key}, slots={slots}")
        self.key_len, self.ngram, self.per_key, self.ranked, self.slots = key_len, ngram, per_key, ranked, slots
        self._dict: dict[tuple, OrderedDict] = {}
        if slots is not None:
            self._keys: list[tuple | None] = [None] * slots
            self._conts: list[OrderedDict | None] = [None] * slots
            self._used = [0] * slots  # per-slot clock of the last insert or credit, for eviction
            self._clock = 0

    def __len__(self) -> int:
        """Stored continuations, all keys together."""
        if self.slots is None:
            return sum(len(c) for c in self._dict.values())
        return sum(len(c) for c in self._conts if c is not None)

    def keys(self) -> list[tuple]:
        """The keys currently stored."""
        if self.slots is None:
            return [k for k, c in self._dict.items() if c]
        return [k for k, c in zip(self._keys, self._conts) if k is not None and c]

    def _entry(self, key: tuple, create: bool) -> OrderedDict | None:
        if self.slots is None:
            if create:
                return self._dict.setdefault(key, OrderedDict())
            return self._dict.get(key)
        start = _mix(key) % self.slots
        run = [(start + i) % self.slots for i in range(min(PROBE, self.slots))]
        for s in run:
            if self._keys[s] == key:
                if create:
                    self._clock += 1
                    self._used[s] = self._clock
                return self._conts[s]
        if not create:
            return None
        free = [s for s in run if self._keys[s] is None]
        s = free[0] if free else min(run, key=self._used.__getitem__)
        self._clock += 1
        self._keys[s], self._conts[s], self._used[s] = key, OrderedDict(), self._clock
        return self._conts[s]

    def insert(self, rows) -> None:
        """Insert rows (lists of ``key_len + ngram - 1`` ints) in order: key first, continuation after."""
        if self.per_key == 0:
            return
        k = self.key_len
        for row in rows:
            row = [int(t) for t in row]
            if len(row) != k + self.ngram - 1:
                raise ValueError(f"rows must have {k + self.ngram - 1} tokens (key {k} + continuation "
                                 f"{self.ngram - 1}), got {len(row)}")
            conts = self._entry(tuple(row[:k]), create=True)
            cont = tuple(row[k:])
            if cont in conts:
                conts.move_to_end(cont)
                continue
            conts[cont] = 0
            if len(conts) > self.per_key:
                if self.ranked:  # least hit, oldest among equals; the newcomer always gets in
                    victim = min(list(conts.items())[:-1], key=lambda kv: kv[1])[0]
                    del conts[victim]
                else:
                    conts.popitem(last=False)

    def lookup(self, key: tuple) -> list[tuple]:
        """The key's continuations in offering order (see ``ranked``); changes nothing."""
        conts = self._entry(tuple(int(t) for t in key), create=False)
        if not conts:
            return []
        if not self.ranked:
            return list(conts)
        newest_first = list(reversed(conts.items()))
        return [c for c, _ in sorted(newest_first, key=lambda kv: -kv[1])]  # stable: ties stay newest first

    def hits(self, key: tuple, cont: tuple) -> int:
        """Accepted tokens credited to ``cont`` under ``key`` (0 when it is not stored)."""
        conts = self._entry(tuple(key), create=False)
        return conts.get(tuple(cont), 0) if conts else 0

    def credit(self, key: tuple, cont: tuple, tokens: int) -> None:
        """Add ``tokens`` accepted tokens to a stored continuation (no-op if it was evicted meanwhile)."""
        conts = self._entry(tuple(key), create=False)
        if conts is None or cont not in conts:
            return
        conts[cont] += tokens
        conts.move_to_end(cont)
        if self.slots is not None:
            self._entry(tuple(key), create=True)  # refreshes the slot's use clock


class HistoryIndex:
    """Where every 1-, 2- and 3-token context ends in the committed sequence (prompt and output), so a step can
    be offered what followed the latest earlier occurrences of its own last tokens.

    Unlike the pool, nothing here is ever evicted, and a longer matching context ranks first. Indexing is
    incremental (each committed token is indexed once), and a lookup stops after ``limit`` continuations.

    Args:
        ngram: ``N``; continuations have ``N - 1`` tokens.
        max_context: longest context matched (3).
    """

    def __init__(self, ngram: int, max_context: int = 3):
        self.cont_len, self.max_context = ngram - 1, max_context
        self._ends: list[dict[tuple, list[int]]] = [{} for _ in range(max_context)]
        self._indexed = 0

    def _extend(self, sequence: list[int]) -> None:
        for j in range(self._indexed, len(sequence)):
            for c in range(1, min(self.max_context, j + 1) + 1):
                self._ends[c - 1].setdefault(tuple(sequence[j - c + 1: j + 1]), []).append(j)
        self._indexed = len(sequence)

    def continuations(self, sequence: list[int], limit: int) -> list[tuple]:
        """Up to ``limit`` distinct continuations (tuples of ``N-1`` ids) that followed earlier occurrences of the
        last 3, then 2, then 1 tokens of ``sequence``, most recent occurrence first within each context length.
        Occurrences whose continuation would run into ``x`` itself are skipped."""
        if len(sequence) < self._indexed:
            raise ValueError("HistoryIndex: the sequence got shorter; use a new index for a new sequence")
        self._extend(sequence)
        out: dict[tuple, None] = {}
        last, k = len(sequence) - 1, self.cont_len
        for c in range(min(self.max_context, len(sequence)), 0, -1):
            for j in reversed(self._ends[c - 1].get(tuple(sequence[-c:]), ())):
                if len(out) >= limit:
                    return list(out)
                if j + k <= last:
                    out.setdefault(tuple(sequence[j + 1: j + 1 + k]), None)
        return list(out)


def common_prefix(a, b) -> int:
    """How many leading tokens two sequences share (what a greedy verifier accepts of ``a`` if ``b`` is true)."""
    n = 0
    for s, t in zip(a, b):
        if s != t:
            break
        n += 1
    return n


class GuessSource:
    """Candidates for each step from the n-gram pool(s); see the module docstring for the options.

    Args:
        config: the lookahead parameters (``ngram``, ``guess``, ``pool_*``).
        vocab_size: the model's vocabulary size (fixed-size pools are allocated from it).
        device: where the plain one-token pool lives (``auto`` picks CUDA / C++ / Python from it). The two-token
            table and the ranked one-token table are Python tables on the host.
    """

    def __init__(self, config: LookaheadConfig, vocab_size: int, device):
        from .pools import TableNGramPool, make_pool

        self.config = config
        n, g = config.ngram, config.guess
        self.ranked = config.pool_rank_by_hits
        # The one-token key: the original pool (any backend), or a Python table when it must keep hit counts.
        self.pool = None if self.ranked else make_pool(config, vocab_size, device)
        self.one = NGramTable(1, n, g, ranked=True) if self.ranked else None
        self.two = (NGramTable(2, n, g, ranked=self.ranked, slots=config.two_token_slots)
                    if config.pool_two_token_key else None)
        self.history = HistoryIndex(n) if config.guess_from_history else None
        # C++/CUDA tables: inserts can skip the id check (a host sync on CUDA) and lookups can stay padded.
        self._table_pool = isinstance(self.pool, TableNGramPool)
        self._x_index: int | None = None  # where the last candidates' x sits in the sequence
        self._offered: list[tuple[tuple, list]] = []  # (continuation, [(table, key), ..]) to credit hits to

    @property
    def _plain(self) -> bool:
        return self.two is None and self.one is None and self.history is None

    def _insert_one(self, rows: list[list[int]]) -> None:
        if not rows:
            return
        if self.one is not None:
            self.one.insert(rows)
        else:
            self._insert_window(torch.tensor(rows, dtype=torch.long))

    def _insert_window(self, ngrams: torch.Tensor) -> None:
        """Insert n-grams of ids the model produced (window guesses, committed tokens) into the one-token pool."""
        if self._table_pool:
            # The model's own ids are in range: skip the check, which on CUDA is a host sync.
            self.pool.insert(ngrams, check=False)
        else:
            self.pool.insert(ngrams)

    def start(self, prompt: torch.Tensor) -> None:
        """Called once with the prompt (1-D LongTensor) before the first step."""
        self._x_index, self._offered = None, []
        if self.history is not None:
            self.history = HistoryIndex(self.config.ngram)
        if not self.config.pool_from_prompt or self.config.guess == 0:
            return
        if self._plain:
            self.pool.insert_sequence(prompt.reshape(-1).cpu())
            return
        toks, n = prompt.reshape(-1).tolist(), self.config.ngram
        self._insert_one([toks[e - n + 1: e + 1] for e in range(n - 1, len(toks))])
        if self.two is not None:
            self.two.insert([toks[e - n: e + 1] for e in range(n, len(toks))])

    def candidates(self, sequence: list[int]) -> torch.Tensor:
        """LongTensor ``[g, N-1]`` (``g <= guess``) for the step whose ``x`` is ``sequence[-1]``."""
        k, g = self.config.ngram - 1, self.config.guess
        self._x_index, self._offered = len(sequence) - 1, []
        if g == 0:
            return torch.empty(0, k, dtype=torch.long)
        x = sequence[-1]
        if self._plain:
            return self.pool.lookup(x)[:g].cpu()
        # Most specific key first; the one-token key fills up. A continuation found under both keys is offered
        # once and credited to both entries.
        offered: dict[tuple, list] = {}
        if self.two is not None and len(sequence) >= 2:
            key = (sequence[-2], x)
            for cont in self.two.lookup(key)[:g]:
                offered[cont] = [(self.two, key)]
        one = self.one.lookup((x,)) if self.one is not None else [tuple(c) for c in self.pool.lookup(x).tolist()]
        for cont in one:
            if cont in offered:
                offered[cont].append((self.one, (x,)))
            elif len(offered) < g:
                offered[cont] = [(self.one, (x,))]
        if self.history is not None:
            offered = self._with_history(self.history.continuations(sequence, g), offered, g)
        if self.ranked:
            self._offered = list(offered.items())
        if not offered:
            return torch.empty(0, k, dtype=torch.long)
        return torch.tensor(list(offered), dtype=torch.long)

    @staticmethod
    def _with_history(history: list[tuple], offered: dict, g: int) -> dict:
        """History continuations take up to half the ``g`` slots first, the pool's the rest; whichever has more
        tops up the slots the other leaves empty. Keeps each continuation's crediting sources."""
        half = (g + 1) // 2
        merged = {cont: offered.get(cont, []) for cont in history[:half]}
        for cont, sources in offered.items():
            if cont in merged:
                merged[cont] = sources
            elif len(merged) < g:
                merged[cont] = sources
        for cont in history[half:]:
            if len(merged) >= g:
                break
            merged.setdefault(cont, offered.get(cont, []))
        return merged

    def padded_candidates(self, sequence: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
        """The candidates of :meth:`candidates` padded to ``guess`` rows, for steps of constant shape.

        Returns ``(candidates, count)`` on ``device``: int64 ``[guess, N-1]`` whose rows ``count..`` are padding
        (token 0, a valid id to embed; verification ignores them), and int64 ``[1]``. With the plain one-token
        pool of a table backend the lookup runs where the pool lives and nothing is read back to the host.
        """
        k, g = self.config.ngram - 1, self.config.guess
        if self._plain and g > 0 and self._table_pool:
            self._x_index, self._offered = len(sequence) - 1, []
            out, count = self.pool.lookup_padded(sequence[-1])
            return out.clamp_min(0).to(device), count.reshape(1).to(device)
        cands = self.candidates(sequence)
        padded = torch.zeros(g, k, dtype=torch.long)
        padded[: cands.shape[0]] = cands
        return padded.to(device), torch.tensor([cands.shape[0]], dtype=torch.long, device=device)

    def observe(self, ngrams: torch.Tensor | None, sequence: list[int], accepted: int, best: int) -> None:
        """After a step: the window's n-grams ``[W, N]`` (or ``None`` while warming up), the committed sequence
        (the step's emitted tokens included), how many candidate tokens were accepted and from which candidate
        (``-1`` when none)."""
        cfg = self.config
        if cfg.guess == 0:
            return
        if self._plain and not cfg.pool_from_output:
            if ngrams is not None:
                self._insert_window(ngrams)
            return
        n = cfg.ngram
        # x's index: remembered from candidates(); the step committed accepted + 1 tokens after it otherwise.
        xi = self._x_index if self._x_index is not None else len(sequence) - accepted - 2
        if self.ranked and accepted > 0 and 0 <= best < len(self._offered):
            # Every offered continuation is credited with how many of the accepted tokens it predicted (the best
            # candidate gets ``accepted``; others sharing its prefix get their share).
            taken = sequence[xi + 1: xi + 1 + accepted]
            for cont, sources in self._offered:
                m = common_prefix(cont, taken)
                if m:
                    for table, key in sources:
                        table.credit(key, cont, m)
        if ngrams is not None:
            # Host lists only for the Python tables; the one-token pool takes the tensor as it is.
            rows = ngrams.tolist() if self.one is not None or self.two is not None else None
            if self.one is not None:
                self.one.insert(rows)
            else:
                self._insert_window(ngrams)
            if self.two is not None:
                before = [sequence[xi - 1] if xi >= 1 else None] + [r[0] for r in rows[:-1]]
                self.two.insert([[b] + r for b, r in zip(before, rows) if b is not None])
        if cfg.pool_from_output:
            # N-grams ending in this step's committed tokens (positions xi+1 ..), after the window's: newest.
            ends = range(max(xi + 1, n - 1), len(sequence))
            self._insert_one([sequence[e - n + 1: e + 1] for e in ends])
            if self.two is not None:
                self.two.insert([sequence[e - n: e + 1] for e in ends if e >= n])
        self._x_index, self._offered = None, []
