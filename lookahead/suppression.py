"""transformers' token suppressions on a step's logits rows, for plain and lookahead steps alike:
``min_new_tokens`` and ``min_length`` (the EOS tokens, until a row has that many new tokens), ``suppress_tokens``
(always) and ``begin_suppress_tokens`` (the first new token only).

What a row suppresses depends on how many new tokens come before the token chosen from it: ``g`` for ``x``'s
row (the sequence has emitted ``g``), ``g + d`` for a tree node at depth ``d`` (the step's ``TreeShape.depth``:
the ``d`` nodes of its path, itself included, ``shared/design/draft-tree.md``). So greedy verification accepts exactly
what plain decoding would emit, and rejection sampling keeps its distribution. A suppressed score becomes
``-inf`` before temperature, top-k and top-p, as transformers' processors set it (and a repetition penalty leaves
``-inf`` as it is, so the two commute).
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def suppress(logits: torch.Tensor, new: torch.Tensor, *, eos: torch.Tensor | None = None, min_new: int = 0,
             always: torch.Tensor | None = None, at_start: torch.Tensor | None = None) -> torch.Tensor:
    """``logits [..., V]`` with each row's suppressed tokens at ``-inf`` (a new tensor; the input is untouched).

    ``new``: int64 ``[...]``, the new tokens before each row's choice. ``eos``, ``always``, ``at_start``: int64 id
    tensors (distinct ids in ``[0, V)``) or ``None``: ``eos`` is suppressed where ``new < min_new``, ``at_start``
    where ``new == 0``, ``always`` everywhere."""
    out = logits
    if always is not None:
        out = out.index_fill(-1, always, NEG_INF)
    for ids, where in ((eos, new < min_new), (at_start, new == 0)):
        if ids is None or ids.numel() == 0:
            continue
        columns = out.index_select(-1, ids)
        out = out.index_copy(-1, ids, torch.where(where[..., None], NEG_INF, columns))
    return out


class TokenSuppression:
    """A call's suppressions, and each row's count of new tokens, ``new``: int64 ``[B]`` on the model's device.

    Args:
        eos: the EOS ids suppressed while a row has fewer than ``min_new`` new tokens.
        min_new: ``min_new_tokens`` (0: none).
        always: ``suppress_tokens``.
        at_start: ``begin_suppress_tokens``.

    :meth:`start` takes a factory of the tensors it keeps (a runner's, whose addresses captured graphs hold, or
    the call's own) and the rows' counts; :meth:`add` updates the counts after a step, uploading only while a row
    is below its last threshold (past it, nothing a count decides changes)."""

    def __init__(self, eos=(), min_new: int = 0, always=(), at_start=()):
        self.min_new = int(min_new)
        self.ids = {"eos": tuple(sorted(set(eos))) if self.min_new > 0 else (),
                    "always": tuple(sorted(set(always))), "at_start": tuple(sorted(set(at_start)))}
        self.threshold = max(self.min_new, 1 if self.ids["at_start"] else 0)
        self.tensors: dict = {}
        self.new: torch.Tensor | None = None
        self.uploaded: list[int] = []
        self.replayed = False

    @property
    def key(self) -> tuple:
        return ("suppress", self.min_new, *self.ids.values())

    def start(self, state, sequences: list[list[int]], counts: list[int], replayed: bool) -> None:
        """``state(name, shape, dtype)``: a tensor to keep; ``counts``: each row's new tokens so far (its
        ``sequences`` do not matter here); ``replayed``: whether the steps are graphs (which always run every
        suppression; an eager step skips the count-dependent ones once no row is below its threshold)."""
        self.replayed = replayed
        self.tensors = {}
        for name, ids in self.ids.items():
            if ids:
                t = state(f"suppress:{name}", (len(ids),), torch.long)
                t.copy_(torch.tensor(ids, dtype=torch.long))
                self.tensors[name] = t
        self.new = state("suppress:new", (len(counts),), torch.long)
        self.uploaded = []
        self.add(sequences, counts)

    def add(self, tokens: list[list[int]], counts: list[int]) -> None:
        """After a step: each row's count of new tokens (its committed ``tokens`` do not matter here)."""
        capped = [min(c, self.threshold) for c in counts]
        if capped != self.uploaded:
            self.new.copy_(torch.tensor(capped, dtype=torch.long))
            self.uploaded = capped

    def keep(self, kept: list[int]) -> None:
        """The rows ``kept`` stay in the batch (the eager loop drops finished rows)."""
        self.new = self.new[torch.as_tensor(kept, device=self.new.device)]
        self.uploaded = [self.uploaded[i] for i in kept]

    def _counting(self) -> bool:
        return self.replayed or any(c < self.threshold for c in self.uploaded)

    def _apply(self, logits: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        counting = self._counting()
        return suppress(logits, new, eos=self.tensors.get("eos") if counting else None, min_new=self.min_new,
                        always=self.tensors.get("always"), at_start=self.tensors.get("at_start") if counting else None)

    def rows(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits [B, V]`` (or ``[B, R, V]``, every row choosing the next token), suppressed."""
        new = self.new if logits.dim() == 2 else self.new[:, None].expand(logits.shape[:2])
        return self._apply(logits, new)

    def tree(self, node_logits: torch.Tensor, tokens: torch.Tensor, end: torch.Tensor,
             depth: torch.Tensor) -> torch.Tensor:
        """``node_logits [B, N, V]`` of a tree's nodes (``depth`` ``[N]`` or ``[B, N]``), each suppressed for its
        depth."""
        if not self._counting():
            return self._apply(node_logits, self.new[:, None])
        return self._apply(node_logits, self.new[:, None] + depth)


def reference_suppressed(logits_row: torch.Tensor, new: int, *, eos=(), min_new: int = 0, always=(),
                         at_start=()) -> torch.Tensor:
    """The oracle: rows ``[..., V]`` whose choice follows ``new`` new tokens, suppressed as transformers does it."""
    out = logits_row.clone()
    banned = set(always) | (set(eos) if new < min_new else set()) | (set(at_start) if new == 0 else set())
    for t in banned:
        out[..., t] = NEG_INF
    return out


__all__ = ["TokenSuppression", "suppress", "reference_suppressed"]
