"""transformers' processors that depend on how many new tokens a row has, on a step's logits rows for plain and
lookahead steps alike, in transformers' order: ``min_new_tokens`` and ``min_length`` (the EOS tokens suppressed
until a row has that many new tokens), ``forced_bos_token_id`` (the first new token, where the prompt is one token
long), ``forced_eos_token_id`` (the last new token ``max_new_tokens`` allows), ``remove_invalid_values`` (which
sits among them: NaN and infinite scores made finite), ``exponential_decay_length_penalty`` (the EOS scores
raised more with each new token past a start), ``suppress_tokens`` (always) and ``begin_suppress_tokens`` (the
first new token).

What a row's rules see depends on how many new tokens come before the token chosen from it: ``g`` for ``x``'s
row (the sequence has emitted ``g``), ``g + d`` for a tree node at depth ``d`` (the step's ``TreeShape.depth``:
the ``d`` nodes of its path, itself included, ``shared/design/draft-tree.md``). So greedy verification accepts
exactly what plain decoding would emit, and rejection sampling keeps its distribution. A suppressed score becomes
``-inf`` and a forced row is ``-inf`` but for its forced tokens' ``0``, before temperature, top-k and top-p, as
transformers' processors set them (and a repetition penalty leaves ``-inf`` as it is, so the two commute).
"""

from __future__ import annotations

import math

import torch

NEG_INF = float("-inf")


class LengthRules:
    """A call's rules, and each row's count of new tokens, ``new``: int64 ``[B]`` on the model's device.

    Args:
        eos: the EOS ids, suppressed while a row has fewer than ``min_new`` new tokens, and raised by ``decay``.
        min_new: ``min_new_tokens`` (0: none).
        forced_first: a token id forced as the first new token (``forced_bos_token_id`` where the padded prompt is
            one token, as transformers applies it), or ``None``.
        forced_last: ids forced where a row has ``last`` new tokens (``forced_eos_token_id``, with ``last`` one
            less than ``max_new_tokens``); maybe empty.
        remove_invalid: ``remove_invalid_values``: NaN becomes 0, ``+-inf`` the dtype's largest and smallest.
        decay: ``(start, factor)`` (``exponential_decay_length_penalty``): with ``g > start`` new tokens, each
            finite EOS score ``s`` becomes ``s + |s| * (factor ** (g - start) - 1)``; or ``None``.
        always: ``suppress_tokens``.
        at_start: ``begin_suppress_tokens``, suppressed where a row has ``begin`` new tokens (0; 1 where a first
            token is forced, as transformers moves them).

    :meth:`start` takes a factory of the tensors it keeps (a runner's, whose addresses captured graphs hold, or
    the call's own) and the rows' counts; :meth:`add` updates the counts after a step, uploading only while a row
    is below its last threshold (past it, nothing a count decides changes; the decay never stops counting)."""

    def __init__(self, eos=(), min_new: int = 0, forced_first: int | None = None, forced_last=(),
                 last: int | None = None, remove_invalid: bool = False, decay=None, always=(), at_start=(),
                 begin: int = 0):
        self.min_new = int(min_new)
        self.last = None if last is None or not forced_last else int(last)
        self.decay = None if decay is None or not eos else (int(decay[0]), float(decay[1]))
        self.remove_invalid = bool(remove_invalid)
        self.begin = int(begin)
        eos = tuple(sorted(set(eos)))
        self.ids = {"eos": eos if self.min_new > 0 else (),
                    "forced_first": () if forced_first is None else (int(forced_first),),
                    "forced_last": tuple(sorted(set(forced_last))) if self.last is not None else (),
                    "decay": eos if self.decay is not None else (),
                    "always": tuple(sorted(set(always))), "at_start": tuple(sorted(set(at_start)))}
        thresholds = [self.min_new, 1 if self.ids["forced_first"] else 0,
                      self.last + 1 if self.last is not None else 0, self.begin + 1 if self.ids["at_start"] else 0]
        self.threshold = None if self.decay is not None else max(thresholds)  # None: counts matter always
        self.tensors: dict = {}
        self.new: torch.Tensor | None = None
        self.uploaded: list[int] = []
        self.replayed = False

    def __bool__(self) -> bool:
        return self.remove_invalid or any(self.ids.values())

    @property
    def key(self) -> tuple:
        return ("length", self.min_new, self.last, self.decay, self.remove_invalid, self.begin, *self.ids.values())

    def start(self, state, sequences: list[list[int]], counts: list[int], replayed: bool) -> None:
        """``state(name, shape, dtype)``: a tensor to keep; ``counts``: each row's new tokens so far (its
        ``sequences`` do not matter here); ``replayed``: whether the steps are graphs (which always run every
        rule; an eager step skips the count-dependent ones once no row is below its threshold)."""
        self.replayed = replayed
        self.tensors = {}
        for name, ids in self.ids.items():
            if ids:
                t = state(f"length:{name}", (len(ids),), torch.long)
                t.copy_(torch.tensor(ids, dtype=torch.long))
                self.tensors[name] = t
        self.new = state("length:new", (len(counts),), torch.long)
        self.uploaded = []
        self.add(sequences, counts)

    def restart(self, rows: list[int], sequences, counts: list[int]) -> None:
        """Batch rows ``rows`` hold new rows with ``counts`` new tokens (a finished row's place refilled)."""
        full = list(self.uploaded)  # the other rows' counts as uploaded (capped: capping again keeps them)
        for b, c in zip(rows, counts):
            full[b] = c
        self.add(None, full)

    def add(self, tokens: list[list[int]], counts: list[int]) -> None:
        """After a step: each row's count of new tokens (its committed ``tokens`` do not matter here)."""
        capped = list(counts) if self.threshold is None else [min(c, self.threshold) for c in counts]
        if capped != self.uploaded:
            self.new.copy_(torch.tensor(capped, dtype=torch.long))
            self.uploaded = capped

    def keep(self, kept: list[int]) -> None:
        """The rows ``kept`` stay in the batch (the eager loop drops finished rows)."""
        self.new = self.new[torch.as_tensor(kept, device=self.new.device)]
        self.uploaded = [self.uploaded[i] for i in kept]

    def _counting(self) -> bool:
        return self.replayed or self.threshold is None or any(c < self.threshold for c in self.uploaded)

    def _apply(self, logits: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        t = self.tensors
        if self._counting():
            return apply_length_rules(logits, new, eos=t.get("eos"), min_new=self.min_new,
                                      forced_first=t.get("forced_first"), forced_last=t.get("forced_last"),
                                      last=self.last, remove_invalid=self.remove_invalid, decay_ids=t.get("decay"),
                                      decay=self.decay, always=t.get("always"), at_start=t.get("at_start"),
                                      begin=self.begin)
        return apply_length_rules(logits, new, remove_invalid=self.remove_invalid, always=t.get("always"))

    def rows(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits [B, V]`` (or ``[B, R, V]``, every row choosing the next token), processed."""
        new = self.new if logits.dim() == 2 else self.new[:, None].expand(logits.shape[:2])
        return self._apply(logits, new)

    def tree(self, node_logits: torch.Tensor, tokens: torch.Tensor, end: torch.Tensor,
             depth: torch.Tensor) -> torch.Tensor:
        """``node_logits [B, N, V]`` of a tree's nodes (``depth`` ``[N]`` or ``[B, N]``), each processed for its
        depth."""
        if not self._counting():
            return self._apply(node_logits, self.new[:, None])
        return self._apply(node_logits, self.new[:, None] + depth)


def _forced(out: torch.Tensor, ids: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """``out`` with the rows ``where`` holds replaced by ``-inf`` but ``0`` at ``ids``."""
    row = out.new_full(out.shape[-1:], NEG_INF).index_fill(0, ids, 0.0)
    return torch.where(where[..., None], row, out)


def apply_length_rules(logits: torch.Tensor, new: torch.Tensor, *, eos=None, min_new: int = 0, forced_first=None,
                       forced_last=None, last=None, remove_invalid: bool = False, decay_ids=None, decay=None,
                       always=None, at_start=None, begin: int = 0) -> torch.Tensor:
    """``logits [..., V]`` processed (a new tensor; the input is untouched), in transformers' order.

    ``new``: int64 ``[...]``, the new tokens before each row's choice. The id arguments are int64 tensors of
    distinct ids in ``[0, V)`` or ``None`` (that rule off); the others are :class:`LengthRules`'."""
    out = logits
    if eos is not None and eos.numel():
        out = _where_columns(out, eos, new < min_new, NEG_INF)
    if forced_first is not None and forced_first.numel():
        out = _forced(out, forced_first, new == 0)
    if forced_last is not None and forced_last.numel():
        out = _forced(out, forced_last, new == last)
    if remove_invalid:
        info = torch.finfo(out.dtype)
        clean = torch.where(out != out, 0.0, out)
        clean = torch.where(out == math.inf, info.max, clean)
        out = torch.where(out == NEG_INF, info.min, clean)
    if decay_ids is not None and decay_ids.numel():
        start, factor = decay
        steps = (new - start).clamp(min=0).to(torch.float64)
        # transformers multiplies by the Python float ``factor ** k - 1``: a float32 product with its float32 value
        scale = (torch.pow(torch.full_like(steps, factor), steps) - 1).to(out.dtype)
        columns = out.index_select(-1, decay_ids)
        penalty = (columns.abs() * scale[..., None]).masked_fill(~torch.isfinite(columns), 0.0)
        out = out.index_copy(-1, decay_ids, torch.where((new > start)[..., None], columns + penalty, columns))
    if always is not None and always.numel():
        out = out.index_fill(-1, always, NEG_INF)
    if at_start is not None and at_start.numel():
        out = _where_columns(out, at_start, new == begin, NEG_INF)
    return out


def _where_columns(out: torch.Tensor, ids: torch.Tensor, where: torch.Tensor, value: float) -> torch.Tensor:
    columns = out.index_select(-1, ids)
    return out.index_copy(-1, ids, torch.where(where[..., None], value, columns))


def reference_length_rules(logits_row: torch.Tensor, new: int, *, eos=(), min_new: int = 0, forced_first=None,
                           forced_last=(), last=None, remove_invalid: bool = False, decay=None, always=(),
                           at_start=(), begin: int = 0) -> torch.Tensor:
    """The oracle: rows ``[..., V]`` whose choice follows ``new`` new tokens, processed as transformers does it,
    one rule after another (``decay`` raises the ``eos`` ids)."""
    out = logits_row.clone()
    if new < min_new:
        out[..., list(eos)] = NEG_INF
    for ids, hit in (([forced_first] if forced_first is not None else [], new == 0),
                     (list(forced_last), last is not None and new == last)):
        if ids and hit:
            out = torch.full_like(out, NEG_INF)
            out[..., ids] = 0.0
    if remove_invalid:
        info = torch.finfo(out.dtype)
        out = out.nan_to_num(nan=0.0, posinf=info.max, neginf=info.min)
    if decay is not None and eos and new > decay[0]:
        cols = out[..., list(eos)]
        penalty = (cols.abs() * (decay[1] ** (new - decay[0]) - 1)).masked_fill(~torch.isfinite(cols), 0.0)
        out[..., list(eos)] = cols + penalty
    out[..., sorted(set(always))] = NEG_INF
    if new == begin:
        out[..., sorted(set(at_start))] = NEG_INF
    return out


__all__ = ["LengthRules", "apply_length_rules", "reference_length_rules"]
