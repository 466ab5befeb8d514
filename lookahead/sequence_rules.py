"""transformers' processors that read a row's recent tokens, on a step's logits rows for plain and lookahead steps
alike: ``no_repeat_ngram_size`` (a token that would repeat an n-gram of the row's sequence scores ``-inf``),
``encoder_no_repeat_ngram_size`` (the same for the n-grams of the row's prompt), ``sequence_bias`` (a bias on a
sequence's last token where the sequence's other tokens end the row's sequence) and ``bad_words_ids`` (the same
with ``-inf``).

What a row's rules see is the sequence its token would follow: the committed sequence (prompt included) for
``x``'s row, and for a tree node's row that sequence followed by the tokens of the node's path (its ancestors and
itself, ``j <= i < end[j]``, ``shared/design/draft-tree.md``), so that greedy verification accepts exactly what plain
decoding under these rules would emit and rejection sampling keeps its distribution. The committed sequences are
kept on the device (:class:`TokenHistory`); each node's recent tokens are gathered from them and from the tree, with
no host work per step. As with the repetition penalty, a row's sequence is its own (a batch row's left padding is
not part of it): each row decodes as it would alone.
"""

from __future__ import annotations

import math
import numbers

import torch

from lookahead_kernels.tree import ancestor_matrix

NEG_INF = float("-inf")
BEFORE_START = -1  # a tail's position before its sequence's first token (never a token id)
ANY = -2  # a sequence bias's prefix position that is not part of that (shorter) sequence


class TokenHistory:
    """Each row's committed tokens, int64 ``tokens [B, capacity]`` and ``lengths [B]``, on the model's device.

    :meth:`start` takes a factory of the tensors it keeps (a runner's, whose addresses captured graphs hold, or the
    call's own); :meth:`add` appends each step's committed tokens (one upload of positions and values)."""

    def __init__(self):
        self.tokens: torch.Tensor | None = None
        self.lengths: torch.Tensor | None = None
        self.host: list[int] = []
        self.replayed = False

    def start(self, state, sequences: list[list[int]], capacity: int, replayed: bool) -> None:
        """``capacity``: the longest a row's sequence can grow (the KV cache's rows); ``replayed``: steps are
        graphs, which read every column (an eager step reads only as far as the longest row)."""
        _check_fits(sequences, capacity)
        self.tokens = state("history:tokens", (len(sequences), capacity), torch.long)
        self.lengths = state("history:lengths", (len(sequences),), torch.long)
        self.host = [0] * len(sequences)
        self.replayed = replayed
        self.add(sequences)

    def restart(self, rows: list[int], sequences: list[list[int]]) -> None:
        """Batch rows ``rows`` hold new ``sequences`` (a finished row's place refilled)."""
        _check_fits(sequences, self.tokens.shape[1])
        for b in rows:
            self.host[b] = 0
        self._append(rows, sequences)

    def add(self, tokens: list[list[int]]) -> None:
        """Appends ``tokens[b]`` to row ``b``."""
        self._append(range(len(tokens)), tokens)

    def _append(self, rows, tokens: list[list[int]]) -> None:
        C = self.tokens.shape[1]
        flat = [b * C + self.host[b] + k for b, t in zip(rows, tokens) for k in range(len(t))]
        if flat:
            values = [v for t in tokens for v in t]
            device = self.tokens.device
            self.tokens.view(-1)[torch.tensor(flat, device=device)] = torch.tensor(values, device=device)
            for b, t in zip(rows, tokens):
                self.host[b] += len(t)
            self.lengths.copy_(torch.tensor(self.host, dtype=torch.long))

    def keep(self, kept: list[int]) -> None:
        """The rows ``kept`` stay in the batch (the eager loop drops finished rows)."""
        index = torch.as_tensor(kept, device=self.tokens.device)
        self.tokens, self.lengths = self.tokens[index], self.lengths[index]
        self.host = [self.host[i] for i in kept]

    @property
    def span(self) -> int:
        """Columns a step reads: every one under graphs (the lengths change between replays), else the longest
        row's."""
        return self.tokens.shape[1] if self.replayed else max(self.host, default=0)

    def tails(self, width: int, depth: torch.Tensor, tokens: torch.Tensor | None = None,
              end: torch.Tensor | None = None) -> torch.Tensor:
        """int64 ``[B, R, width]``: the last ``width`` tokens of each query row's sequence, ``BEFORE_START`` where
        it is shorter.

        ``depth``: int64 ``[B, R]``, the query rows' depths (0: ``x``'s row, the committed sequence alone). With a
        tree, ``tokens [B, R]`` and ``end`` (``[R]`` or ``[B, R]``) are its nodes' (a node's sequence ends with
        its path, whose token at depth ``q`` is its ancestor's at that depth)."""
        B, R = depth.shape
        back = torch.arange(width - 1, -1, -1, device=depth.device)  # tokens from the end: width - 1 ... 0
        q = depth[:, :, None] - back  # [B, R, width]: a path token's depth where >= 1, else the sequence's
        at = (self.lengths[:, None, None] - 1 + q).clamp(min=0)
        committed = self.tokens.gather(1, at.view(B, -1).clamp(max=self.tokens.shape[1] - 1)).view(B, R, width)
        committed = committed.masked_fill(self.lengths[:, None, None] - 1 + q < 0, BEFORE_START)
        if tokens is None:
            return committed
        on_path = ancestor_matrix(end.expand(B, R)).transpose(1, 2)  # [B, i, j]: j on node i's path
        at_depth = depth[:, None, :, None] == q[:, :, None, :]  # [B, i, j, width]: j at the tail position's depth
        path = ((on_path[..., None] & at_depth).long() * tokens[:, None, :, None]).sum(2)
        return torch.where(q >= 1, path, committed)


def _check_fits(sequences: list[list[int]], capacity: int) -> None:
    if any(len(s) > capacity for s in sequences):
        raise ValueError(f"a row's sequence is longer than the history's capacity {capacity}")


def _ban(logits: torch.Tensor, index: torch.Tensor, hit: torch.Tensor) -> torch.Tensor:
    """``logits [B, R, V]`` with ``index [B, R, M]``'s tokens at ``-inf`` where ``hit`` (a new tensor; repeated
    indices are fine: the smallest value wins)."""
    src = torch.full(index.shape, float("inf"), dtype=logits.dtype, device=logits.device)
    return logits.scatter_reduce(2, index, src.masked_fill(hit, NEG_INF), reduce="amin", include_self=True)


def _as_queries(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x``'s rows ``[B, V]`` (or ``[B, R, V]``) as ``[B, R, V]`` query rows of depth 0."""
    rows = logits[:, None] if logits.dim() == 2 else logits
    return rows, torch.zeros(rows.shape[:2], dtype=torch.long, device=rows.device)


def _ngram_bans(history: TokenHistory, n: int, prefix: torch.Tensor, lengths: torch.Tensor,
                span: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The n-grams among each row's first ``lengths [B]`` committed tokens (of the first ``span`` columns) that
    ``prefix [B, R, n - 1]`` starts: (their last tokens, hit) ``[B, R, P]``."""
    B, R, _ = prefix.shape
    if span < n:
        empty = torch.zeros(B, R, 0, dtype=torch.long, device=prefix.device)
        return empty, empty.bool()
    windows = history.tokens[:, :span].unfold(1, n, 1)  # [B, P, n]
    whole = torch.arange(windows.shape[1], device=prefix.device) + n - 1 < lengths[:, None]  # [B, P]
    hit = (windows[:, None, :, :-1] == prefix[:, :, None, :]).all(-1) & whole[:, None, :]
    return windows[:, None, :, -1].expand(B, R, -1), hit


class NoRepeatNGram:
    """transformers' ``no_repeat_ngram_size``: a row's token scores ``-inf`` where it would complete an n-gram
    its sequence already holds (the last ``n - 1`` tokens followed by it)."""

    def __init__(self, n: int, history: TokenHistory):
        self.n = int(n)
        self.history = history

    @property
    def key(self) -> tuple:
        return ("no_repeat_ngram", self.n)

    def start(self, state, sequences, counts, replayed) -> None:  # the history is started by its owner
        pass

    def restart(self, rows, sequences, counts) -> None:
        pass

    def add(self, tokens, counts) -> None:
        pass

    def keep(self, kept) -> None:
        pass

    def rows(self, logits: torch.Tensor) -> torch.Tensor:
        rows, depth = _as_queries(logits)
        h = self.history
        index, hit = _ngram_bans(h, self.n, h.tails(self.n - 1, depth), h.lengths, h.span)
        out = _ban(rows, index, hit)
        return out[:, 0] if logits.dim() == 2 else out

    def tree(self, node_logits: torch.Tensor, tokens: torch.Tensor, end: torch.Tensor,
             depth: torch.Tensor) -> torch.Tensor:
        """``node_logits [B, N, V]``: a node's sequence ends with its path; the n-grams that end on its path are
        those whose last token is an ancestor ``j`` (or itself) and whose other tokens end ``j``'s parent's
        sequence, so each node's ``n`` last tokens give them all."""
        B, N, _ = node_logits.shape
        if N == 0:
            return node_logits
        depth = depth.expand(B, N)
        last = self.history.tails(self.n, depth, tokens, end)  # [B, N, n]
        prefix = last[:, :, 1:]  # what a node's token would follow
        h = self.history
        index, hit = _ngram_bans(h, self.n, prefix, h.lengths, h.span)
        on_path = ancestor_matrix(end.expand(B, N)).transpose(1, 2)  # [B, i, j]
        # n-gram ending at node j: last[j][:-1] then token j; it bans token j's repeat at node i when i's prefix
        # equals its first n - 1 tokens (a position before the sequence's start never matches, so an n-gram
        # reaching before it never bans)
        path_hit = on_path & (last[:, None, :, :-1] == prefix[:, :, None, :]).all(-1)
        index = torch.cat([index, tokens[:, None, :].expand(B, N, N)], dim=2)
        return _ban(node_logits, index, torch.cat([hit, path_hit], dim=2))


class _TailRule:
    """A rule whose rows read only their sequence's last tokens: ``x``'s rows and a tree's nodes take the same
    ``_apply(rows [B, R, V], depth [B, R], tokens, end)``, a node's path through ``tokens``/``end``."""

    def rows(self, logits: torch.Tensor) -> torch.Tensor:
        rows, depth = _as_queries(logits)
        out = self._apply(rows, depth)
        return out[:, 0] if logits.dim() == 2 else out

    def tree(self, node_logits: torch.Tensor, tokens: torch.Tensor, end: torch.Tensor,
             depth: torch.Tensor) -> torch.Tensor:
        B, N, _ = node_logits.shape
        if N == 0:
            return node_logits
        return self._apply(node_logits, depth.expand(B, N), tokens, end)


class PromptNGrams(_TailRule):
    """transformers' ``encoder_no_repeat_ngram_size`` (a decoder-only model's encoder ids are its prompt): a row's
    token scores ``-inf`` where it would complete an n-gram of the row's prompt (the row's own, without a batch's
    left padding). A node's last ``n - 1`` tokens may lie on its path; the n-grams are the prompt's alone."""

    def __init__(self, n: int, history: TokenHistory):
        self.n = int(n)
        self.history = history
        self.lengths: torch.Tensor | None = None
        self.longest = 0

    @property
    def key(self) -> tuple:
        return ("prompt_ngrams", self.n)

    def start(self, state, sequences, counts, replayed) -> None:
        prompt = [len(s) - c for s, c in zip(sequences, counts)]
        self.lengths = state("prompt_ngrams:lengths", (len(prompt),), torch.long)
        self.lengths.copy_(torch.tensor(prompt, dtype=torch.long))
        # a graph reads every column (a later call's prompts may be longer); an eager step only the prompts'
        self.longest = None if replayed else max(prompt, default=0)

    def restart(self, rows: list[int], sequences, counts) -> None:
        prompt = [len(s) - c for s, c in zip(sequences, counts)]
        self.lengths[torch.as_tensor(rows, device=self.lengths.device)] = torch.tensor(prompt, dtype=torch.long,
                                                                                       device=self.lengths.device)
        if self.longest is not None:  # a longer span than the rows' prompts reads only columns the lengths mask
            self.longest = max([self.longest, *prompt])

    def add(self, tokens, counts) -> None:
        pass

    def keep(self, kept) -> None:
        self.lengths = self.lengths[torch.as_tensor(kept, device=self.lengths.device)]

    def _apply(self, rows: torch.Tensor, depth: torch.Tensor, tokens=None, end=None) -> torch.Tensor:
        h = self.history
        span = h.tokens.shape[1] if self.longest is None else self.longest
        index, hit = _ngram_bans(h, self.n, h.tails(self.n - 1, depth, tokens, end), self.lengths, span)
        return _ban(rows, index, hit)


class SequenceBias(_TailRule):
    """transformers' ``sequence_bias`` (and ``bad_words_ids``: every bias ``-inf``): a sequence's bias is added to
    its last token's score where the row's sequence ends with the sequence's other tokens; a one-token sequence's
    bias applies always. Biases of sequences sharing a last token add up in transformers' order (one-token biases
    first, then the longer sequences grouped by length, each group in the given order).

    (transformers 5.17 and older applied a sequence only where the row's sequence was at least as long as the whole
    sequence, not just its other tokens; the two differ only where a row's whole sequence is one of those prefixes.)

    ``biases``: ``{tuple of token ids: float}`` in the given order."""

    def __init__(self, biases: dict, history: TokenHistory, name: str = "sequence_bias"):
        self.name = name
        self.biases = dict(biases)
        self.history = history
        columns = sorted({seq[-1] for seq in self.biases})
        slot = {t: k for k, t in enumerate(columns)}
        alone = [0.0] * len(columns)
        for seq, bias in self.biases.items():
            if len(seq) == 1:
                alone[slot[seq[0]]] = float(bias)  # transformers sets (a later entry of the same token wins)
        longer = [(seq, bias) for seq, bias in self.biases.items() if len(seq) > 1]
        first_of_length = {}
        for seq, _ in longer:
            first_of_length.setdefault(len(seq), len(first_of_length))
        longer.sort(key=lambda item: first_of_length[len(item[0])])  # stable: the given order within a length
        self.width = max((len(s) - 1 for s, _ in longer), default=0)
        self.constants = dict(
            columns=columns, alone=alone,
            prefixes=[[ANY] * (self.width - len(s) + 1) + list(s[:-1]) for s, _ in longer],
            values=[float(b) for _, b in longer],
            slots=[slot[s[-1]] for s, _ in longer])
        self.tensors: dict = {}

    @property
    def key(self) -> tuple:
        return (self.name, tuple(self.biases.items()))

    def start(self, state, sequences, counts, replayed) -> None:
        c = self.constants
        dtypes = dict(columns=torch.long, alone=torch.float32, prefixes=torch.long, values=torch.float32,
                      slots=torch.long)
        self.tensors = {}
        for name, values in c.items():
            t = torch.tensor(values, dtype=dtypes[name])
            kept = state(f"{self.name}:{name}", tuple(t.shape), t.dtype)
            kept.copy_(t)
            self.tensors[name] = kept

    def restart(self, rows, sequences, counts) -> None:  # constants, and the history its owner restarts
        pass

    def add(self, tokens, counts) -> None:
        pass

    def keep(self, kept) -> None:
        pass

    def _apply(self, rows: torch.Tensor, depth: torch.Tensor, tokens=None, end=None) -> torch.Tensor:
        t = self.tensors
        B, R, _ = rows.shape
        bias = t["alone"].expand(B, R, -1).clone()
        if self.width:
            tail = self.history.tails(self.width, depth, tokens, end)  # [B, R, width]
            prefixes = t["prefixes"]
            # [B, R, S]; a prefix reaching before the row's first token meets BEFORE_START and does not match
            match = ((tail[:, :, None, :] == prefixes) | (prefixes == ANY)).all(-1)
            added = torch.where(match, t["values"], 0.0)
            bias = bias.scatter_add_(2, t["slots"].expand(B, R, -1), added)
        columns = t["columns"]
        return rows.index_copy(2, columns, rows.index_select(2, columns) + bias)


# ---- arguments ---------------------------------------------------------------------------------------------------

def check_no_repeat_ngram_size(value, name: str = "no_repeat_ngram_size") -> int:
    """``value`` as an int >= 0 (0: off); ``name`` is the argument's."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"{name} must be an int >= 0 (0: off), got {value!r}")
    return int(value)


def _ids(value, what: str) -> tuple:
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if not isinstance(value, (list, tuple)) or not value or any(
            isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0 for v in value):
        raise ValueError(f"{what} must be a non-empty list of token ids (ints >= 0), got {value!r}")
    return tuple(int(v) for v in value)


def sequence_biases(value) -> dict:
    """transformers' ``sequence_bias`` (a list of ``[[ids...], bias]`` or a dict ``{(ids...): bias}``) as a dict in
    its order (a later entry of the same sequence wins); ``{}`` for ``None``."""
    if value is None:
        return {}
    if isinstance(value, dict):
        pairs = list(value.items())
    elif isinstance(value, (list, tuple)) and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in value):
        pairs = [tuple(p) for p in value]
    else:
        raise ValueError(f"sequence_bias must be a list of [[token ids], bias] pairs or a dict {{(token ids): "
                         f"bias}}, got {value!r}")
    if not pairs:
        raise ValueError("sequence_bias is empty; pass None for no bias")
    out = {}
    for seq, bias in pairs:
        ids = _ids(seq, "each sequence_bias sequence")
        if isinstance(bias, bool) or not isinstance(bias, numbers.Real) or math.isnan(bias) or bias == math.inf:
            raise ValueError(f"sequence_bias's bias for {list(ids)} must be a number (finite, or -inf), got {bias!r}")
        out[ids] = float(bias)
    return out


def bad_word_list(value) -> list[tuple]:
    """transformers' ``bad_words_ids`` (a list of token id lists) as a list of tuples; ``[]`` for ``None``."""
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"bad_words_ids must be a non-empty list of token id lists, got {value!r}")
    return [_ids(w, "each bad_words_ids entry") for w in value]


def bad_words(words: list[tuple], eos) -> dict:
    """``words`` (:func:`bad_word_list`) as ``-inf`` biases; a one-token bad word that is an EOS is dropped, as
    transformers drops it."""
    eos = set(eos)
    return {w: NEG_INF for w in words if not (len(w) == 1 and w[0] in eos)}


def check_vocabulary(name: str, sequences, vocab_size: int) -> None:
    """``ValueError`` naming ``name`` unless every id of ``sequences`` (token id lists) is below ``vocab_size``."""
    bad = sorted({t for s in sequences for t in s if t >= vocab_size})
    if bad:
        raise ValueError(f"{name} must hold token ids in [0, {vocab_size}), got {bad}")


# ---- references ---------------------------------------------------------------------------------------------------

def reference_no_repeat(logits_row: torch.Tensor, sequence: list[int], n: int) -> torch.Tensor:
    """The oracle: a row ``[V]`` after ``sequence``, its repeated n-grams' tokens at ``-inf``."""
    out = logits_row.clone()
    if len(sequence) < n:
        return out
    prefix = sequence[len(sequence) - n + 1:]
    for p in range(len(sequence) - n + 1):
        if sequence[p: p + n - 1] == prefix:
            out[sequence[p + n - 1]] = NEG_INF
    return out


def reference_prompt_ngrams(logits_row: torch.Tensor, prompt: list[int], sequence: list[int],
                            n: int) -> torch.Tensor:
    """The oracle: a row ``[V]`` after ``sequence``, the tokens completing an n-gram of ``prompt`` at ``-inf``."""
    out = logits_row.clone()
    if len(sequence) < n - 1:
        return out
    prefix = sequence[len(sequence) - n + 1:] if n > 1 else []
    for p in range(len(prompt) - n + 1):
        if prompt[p: p + n - 1] == prefix:
            out[prompt[p + n - 1]] = NEG_INF
    return out


def reference_sequence_bias(logits_row: torch.Tensor, sequence: list[int], biases: dict) -> torch.Tensor:
    """The oracle: a row ``[V]`` after ``sequence`` with ``biases`` (``{ids: bias}``) added as transformers adds
    them (one-token biases first, then each longer sequence's whose other tokens end ``sequence``, by length)."""
    bias = torch.zeros_like(logits_row)
    for seq, b in biases.items():
        if len(seq) == 1:
            bias[seq[0]] = b
    lengths = list(dict.fromkeys(len(seq) for seq in biases if len(seq) > 1))
    for m in lengths:
        for seq, b in biases.items():
            if len(seq) == m and m - 1 <= len(sequence) and tuple(sequence[len(sequence) - m + 1:]) == seq[:-1]:
                bias[seq[-1]] += b
    return logits_row + bias


__all__ = ["TokenHistory", "NoRepeatNGram", "PromptNGrams", "SequenceBias", "check_no_repeat_ngram_size",
           "sequence_biases", "bad_word_list", "bad_words", "check_vocabulary", "reference_no_repeat",
           "reference_prompt_ngrams", "reference_sequence_bias"]
