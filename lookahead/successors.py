"""Successor table: for each token, the model's own most likely next tokens, read off logits a step computes.

Every row whose logits a step computes says what the model expects after the token fed there. Keeping the top
``k`` of each (the latest row wins) gives a table ``token -> k next tokens`` from which a draft tree can be grown
breadth-first from ``x`` at no extra model cost ("token recycling").
"""

from __future__ import annotations

import torch

from lookahead_kernels.cpu_ops import cpu_ops_available, host_ops


class SuccessorTable:
    """For each token seen, the top-``k`` next tokens last predicted after it with their probabilities among
    those ``k``. The probability, not the rank, is what says how sure the model was, so the builder calibrates
    acceptance by it. Compact host tensors, which the C++ draft builder reads in place: a token's first record
    takes the next free entry. Why not a dense ``[vocab_size, k]`` row per token: at SmolLM2's vocabulary that is
    3.3 MB a row, 53 MB for a 16-row batch, and the draft builder's reads of it missed the cache; a row's index is
    0.4 MB and its entries a few kilobytes.

    Args:
        vocab_size: token ids lie in ``[0, vocab_size)``.
        k: successors kept per token.

    Attributes:
        tensors: ``(index, entries)`` once made (at the first record), else ``None``:

            - index: int32 ``[vocab_size + 1, 2]``: ``index[t] = (entry, count)``, token ``t``'s entry and how many
              successors it holds (count 0: none recorded, entry unset); ``index[vocab_size, 0]``: entries in use.
            - entries: int32 ``[S, 2, k]`` (``S >= `` entries in use; grown by doubling, in place, by the record):
              ``entries[e, 0]`` the entry's successors, most likely first, ``entries[e, 1]`` their probabilities'
              float32 bits (only the first ``count`` of each are written).
        allocated: whether those exist yet: a row whose batch never takes a tree never pays for them (readers
            take a table not yet made as empty).
    """

    def __init__(self, vocab_size: int, k: int = 8):
        if vocab_size < 1 or k < 1:
            raise ValueError(f"SuccessorTable needs vocab_size >= 1 and k >= 1, got {vocab_size}, {k}")
        self.k, self.vocab_size = k, vocab_size
        self.tensors = None

    def _made(self) -> tuple[torch.Tensor, torch.Tensor]:
        # Made at first use, not with the row's lookahead state (its allocations took 0.12 ms of each row's start
        # on the H200 machine's host when they were dense, 2 ms of a 16-row batch whose planner then declined every
        # tree, session 57). Entries left unwritten: only each token's count of them is read.
        if self.tensors is None:
            self.tensors = (torch.zeros(self.vocab_size + 1, 2, dtype=torch.int32),
                            torch.empty(min(_FIRST_ENTRIES, self.vocab_size), 2, self.k, dtype=torch.int32))
        return self.tensors

    @property
    def allocated(self) -> bool:
        return self.tensors is not None

    @property
    def recorded(self) -> int:
        """Tokens with successors recorded."""
        return 0 if self.tensors is None else int(self.tensors[0][self.vocab_size, 0])

    @staticmethod
    def top(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids int64 [R, k'], probs float32 [R, k'])``: each row's top ``k' = min(k, vocab)`` and their softmax
        among themselves, where ``logits [R, vocab]`` are (on their device: a GPU step reads back only these)."""
        if _native_applies(logits):  # one pass over each row (torch.topk took 3-4% of a CPU step)
            return torch.ops.lookahead_draft.top_successors(logits, k)
        if logits.is_cuda:  # two launches in the step's graph, where torch.topk makes radix passes and a sort
            from lookahead_kernels import row_topk

            if row_topk.unreadable(logits) is None:
                return row_topk.row_top_k(logits, k)
        return SuccessorTable.top_reference(logits, k)

    @staticmethod
    def top_reference(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`top` in torch: the reference of the C++ op (CPU) and of the Triton kernels (CUDA,
        ``lookahead_kernels.row_topk``), and the path where neither applies."""
        top = logits.float().topk(min(k, logits.shape[-1]), dim=-1)
        # The probability among the top k only: a confidence the builder calibrates by measured acceptance, at
        # a fraction of the cost of a softmax over the vocabulary (which took ~6% of a CPU step).
        return top.indices, top.values.softmax(dim=-1)

    def record(self, tokens: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor) -> None:
        """Row ``r`` of ``ids``/``probs`` (as :meth:`top` gives them, on the CPU) becomes the successors of
        ``tokens[r]``; a later row for the same token wins."""
        if tokens.numel() == 0:
            return
        tokens = tokens.reshape(-1).cpu()
        if int(tokens.min()) < 0 or int(tokens.max()) >= self.vocab_size:
            raise ValueError(f"SuccessorTable: token ids must be in [0, {self.vocab_size})")
        record_step([self], tokens[None], pack_tops(ids.cpu()[None], probs.cpu()[None]), [0], [tokens.numel()], [[]])

    def update(self, tokens: torch.Tensor, logits: torch.Tensor) -> None:
        """Record the top-``k`` of ``logits [R, vocab]`` as the successors of ``tokens [R]`` (later rows win)."""
        if tokens.numel() == 0:
            return
        self.record(tokens, *self.top(logits, self.k))

    def successors(self, token: int) -> list[tuple[int, float]]:
        """``(next token, probability)`` pairs after ``token``, most likely first (empty when none recorded)."""
        if not self.allocated:
            return []
        index, entries = self.tensors
        entry, n = index[token].tolist()
        if n == 0:
            return []
        return list(zip(entries[entry, 0, :n].tolist(), entries[entry, 1, :n].view(torch.float32).tolist()))

    def _write(self, token: int, ids: torch.Tensor, prob_bits: torch.Tensor) -> None:
        """:func:`record_step_reference`'s one write: ``ids`` and ``prob_bits`` (int32 ``[j]``) become
        ``token``'s successors, in its entry (the next free one at its first record, the entries doubled in place
        where none is left)."""
        index, entries = self._made()
        if int(index[token, 1]) == 0:
            used = int(index[self.vocab_size, 0])
            if used == entries.shape[0]:
                entries.resize_(min(max(2 * used, _FIRST_ENTRIES), self.vocab_size), 2, self.k)
            index[token, 0] = used
            index[self.vocab_size, 0] = used + 1
        j = ids.numel()
        entry = int(index[token, 0])
        entries[entry, 0, :j] = ids
        entries[entry, 1, :j] = prob_bits
        index[token, 1] = j


_FIRST_ENTRIES = 64  # a table's first entries (the C++ record grows them likewise)


def _native_applies(logits: torch.Tensor) -> bool:
    """Whether :meth:`SuccessorTable.top` runs the C++ op on ``logits``: float32 on the CPU, 2-D or 3-D, the last
    dimension contiguous, the ops already loaded (a GPU process never builds them for this)."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() not in (2, 3) \
            or logits.shape[-1] == 0 or logits.stride(-1) != 1:
        return False
    return cpu_ops_available(build=False)


def pack_tops(ids: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """int32 ``[B, 2, R, j]``: ids ``[B, R, j]`` (int) and probs float32 ``[B, R, j]`` as a step reads them back,
    the ids then the probabilities' float32 bits (what :func:`record_step` takes; on a step's device, so that the
    host reads both in one copy)."""
    return torch.stack([ids.to(torch.int32), probs.to(torch.float32).view(torch.int32)], dim=1)


def record_step(tables: list[SuccessorTable], tokens: torch.Tensor, tops: torch.Tensor, rows: list[int],
                computed: list[int], last: list[list[int]]) -> None:
    """One step's successor tops into each row's table, in one call where the C++ ops are built (a call a row
    cost a 16-row batch a quarter of a millisecond a step).

    Table ``i`` reads batch row ``b = rows[i]`` of ``tokens`` (int64 ``[B, R]``, the token fed at each logits row)
    and ``tops`` (int32 ``[B, 2, R', j]`` as :func:`pack_tops` lays them out: a view of a step's read-back, each
    row contiguous) and takes its logits rows ``0 .. computed[i] - 1`` in order; then every table takes its rows
    ``last[i]`` again, in order. A later row for the same token wins, so the rows that saw their true context are
    listed last (and win over other rows' where tables are shared). Tokens must be the model's own ids (the C++
    op checks them; :meth:`SuccessorTable.record` says which are allowed).
    """
    if not tables:
        return
    if cpu_ops_available(build=False):
        made = [t._made() for t in tables]  # each table's (index, entries), made at its first record
        host_ops().record_successors([m[0] for m in made], [m[1] for m in made], tokens, tops, rows, computed,
                                     [len(r) for r in last], [r for listed in last for r in listed])
        return
    record_step_reference(tables, tokens, tops, rows, computed, last)


def record_step_reference(tables: list[SuccessorTable], tokens: torch.Tensor, tops: torch.Tensor, rows: list[int],
                          computed: list[int], last: list[list[int]]) -> None:
    """:func:`record_step` in Python, row by row: the C++ op's reference and the path without it."""
    j = tops.shape[3]
    writes = [(i, r) for i in range(len(tables)) for r in range(computed[i])] + \
        [(i, r) for i in range(len(tables)) for r in last[i]]
    if j < 1:
        raise ValueError("record_step: tops must hold at least one successor a row")
    for i, r in writes:  # in order: later rows win
        b = rows[i]
        t = int(tokens[b, r])
        if not 0 <= t < tables[i].vocab_size:
            raise ValueError(f"SuccessorTable: token ids must be in [0, {tables[i].vocab_size})")
        tables[i]._write(t, tops[b, 0, r], tops[b, 1, r])
