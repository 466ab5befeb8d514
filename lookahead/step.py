"""Building one packed lookahead step for a batch of rows: tokens, positions, layout and the logit rows read back."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from lookahead_kernels import StepLayout
from lookahead_kernels.cpu_ops import host_ops
from lookahead_kernels.tree import TreeShape

from .draft import DraftTree, DraftTrees, Proposals, row_starts, trees_in_batch
from .runner import input_spans


@dataclasses.dataclass(frozen=True)
class Step:
    """One step's inputs, for ``B`` rows of one shape.

    Attributes:
        tokens: LongTensor ``[B, T]`` in layout order (``x``, lookahead levels, tree nodes).
        positions: LongTensor ``[B, T]``, absolute positions (``p + layout.position_offsets()`` per row).
        layout: the :class:`StepLayout` (its tree shared ``[V]`` for one row, ``[B, V]`` for several).
        logits_rows: LongTensor ``[R]``: step rows whose logits are computed, in this order: ``x``, the last
            lookahead level (``W`` rows, minus ``x`` when there is a single level), then every tree node.
        logits_tokens: LongTensor ``[B, R]`` on the host: the token fed at each of those rows.
        num_nodes: LongTensor ``[B]``: real (not padding) tree nodes per row (zeros without a tree).
        packed: with ``build_step(..., pack=True)``, every input above in one contiguous int64 host tensor laid
            out as a :class:`lookahead.runner.StepRunner`'s buffers (:func:`lookahead.runner.input_spans`), the
            tensors above being views of it; else ``None``.
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    layout: StepLayout
    logits_rows: torch.Tensor
    logits_tokens: torch.Tensor
    num_nodes: torch.Tensor
    packed: torch.Tensor | None = None

    @property
    def window_rows(self) -> slice:
        """Slice of the returned logits holding the last level, column 0 first."""
        return logits_slices(self.layout.window, self.layout.levels, self.layout.tree_size)[0]

    @property
    def node_rows(self) -> slice:
        """Slice of the returned logits holding the tree nodes, in node order."""
        return logits_slices(self.layout.window, self.layout.levels, self.layout.tree_size)[1]


def logits_slices(window: int, levels: int, tree_size: int) -> tuple[slice, slice]:
    """``(window rows, node rows)`` of a step's returned logits, ordered ``x``, the last level, the tree nodes."""
    start = 0 if levels == 1 else 1  # with one level, column 0 of the last level is x itself (row 0)
    return slice(start, start + window), slice(start + window, start + window + tree_size)


def build_step(positions: list[int], lookahead_tokens: torch.Tensor, levels: int, window: int,
               trees: DraftTrees | list[DraftTree] | None, device, constants: dict | None = None,
               pack: bool = False) -> Step:
    """Pack each row's window (``levels x window`` tokens, ``x`` first) and tree nodes into one step.

    Args:
        positions: per row, the position ``p`` of its ``x``.
        lookahead_tokens: LongTensor ``[B, levels * window]``, ``x`` at column 0.
        trees: the rows' :class:`DraftTrees` (or a list of one :class:`DraftTree` per row), all of one size ``V``
            (padded); ``None`` or ``V == 0``: no verification branch.
        constants: a dict the caller keeps across its steps (one a ``generate`` call), where the parts that every
            step of a shape packs the same are kept (:func:`constant_parts`); ``None``: made anew.
        pack: build the step in one host block laid out as a step runner's buffers (``Step.packed``), which the
            runner takes in one copy; ``device`` must then be the CPU.
    """
    B = len(positions)
    if isinstance(trees, list):
        trees = DraftTrees.stack(trees)
    V = trees.tokens.shape[1] if trees is not None else 0
    rows, head = _constant_parts(constants, window, levels, window * levels + V)
    if pack:
        if torch.device(device).type != "cpu":
            raise ValueError(f"build_step packs a step on the host: device must be the CPU, got {device}")
        return _packed_step(positions, lookahead_tokens, levels, window, trees, rows, head)
    depth = end = None
    if V:
        depth, end = (trees.depth, trees.end) if B > 1 else (trees.depth[0], trees.end[0])
    layout = StepLayout(window, levels, None if depth is None else TreeShape.trusted(depth, end))
    tokens = lookahead_tokens.reshape(B, -1)
    if depth is not None:
        tokens = torch.cat([tokens, trees.tokens], dim=1)
    if depth is None:
        offsets = head
    else:
        offsets = torch.cat([head.expand(B, head.numel()) if depth.dim() == 2 else head, depth], dim=-1)
    if B == 1:  # a scalar add: no tensor of positions to make
        positions_host = (offsets + positions[0]).reshape(1, layout.T)
    else:
        positions_host = (torch.tensor(positions, dtype=torch.long)[:, None] + offsets).expand(B, layout.T)
    num_nodes = torch.tensor(trees.num_nodes if depth is not None else [0] * B, dtype=torch.long)
    host = [tokens, positions_host, rows, num_nodes]
    if depth is not None:
        host += [depth, end]
    moved = upload(host, device)
    if depth is not None and moved[4] is not depth:  # moved to the device; checked when each tree was made
        layout = StepLayout(window, levels, TreeShape.trusted(moved[4], moved[5]))
    # With one level every row's logits are read back, in step order: the tokens themselves.
    return Step(tokens=moved[0], positions=moved[1], layout=layout, logits_rows=moved[2],
                logits_tokens=tokens if levels == 1 else tokens[:, rows], num_nodes=moved[3])


def _packed_step(positions: list[int], lookahead_tokens: torch.Tensor, levels: int, window: int,
                 trees: DraftTrees | None, rows: torch.Tensor, head: torch.Tensor) -> Step:
    """:func:`build_step` with ``pack``: every input in one block in the runner's layout (written by
    :func:`pack_step_reference`), the step's tokens, positions and node counts views of it. Trees from the C++
    builder take :func:`build_tree_step` instead, which encodes and packs them in one call."""
    B, L = len(positions), window * levels
    V = trees.tokens.shape[1] if trees is not None else 0
    block = pack_step_reference(positions, lookahead_tokens, L, trees, rows, head)
    layout = StepLayout(window, levels, TreeShape.trusted(trees.depth, trees.end) if V else None)
    return _packed(block, layout, B, L + V, rows)


def _packed(block: torch.Tensor, layout: StepLayout, B: int, T: int, rows: torch.Tensor) -> Step:
    """The :class:`Step` whose inputs ``block`` packs (:func:`lookahead.runner.input_spans`' layout)."""
    spans = input_spans(B, T, layout.tree_size, rows.numel())
    tokens = block[spans["tokens"][0]].view(B, T)
    return Step(tokens=tokens, positions=block[spans["positions"][0]].view(B, T), layout=layout, logits_rows=rows,
                logits_tokens=tokens if layout.levels == 1 else tokens[:, rows], num_nodes=block[spans["num_nodes"][0]],
                packed=block)


def build_tree_step(positions: list[int], xs: list[int], window_tokens: torch.Tensor | None, levels: int,
                    window: int, proposals: Proposals, picks: list[int], keeps: list[int], size: int,
                    constants: dict | None = None) -> tuple[Step, DraftTrees]:
    """A packed tree step (:func:`build_step` with ``pack``) from the C++ builder's proposals, and its trees
    (:func:`lookahead.draft.encode_rows`), in one C++ call (``lookahead_draft.encode_step``, ``csrc/pack_step.cpp``):
    38-41 us a one-row tree step in the decoding loop where encoding, stacking the step's tokens and packing took
    58-75 (the H200's steps replayed on this project's CPU, session 61). The block's layout and the trees are those
    of :func:`lookahead.draft.encode_rows`, :func:`lookahead.window.stack_step_tokens` and :func:`build_step`
    (``tests/test_draft_native.py`` checks them against the Python encoding and :func:`pack_step_reference`).

    Args:
        positions, xs: per row, the position of its ``x`` and ``x``.
        window_tokens: LongTensor ``[B, levels * window]``, each row's lookahead branch (``x`` at column 0, as
            :func:`lookahead.window.stack_step_tokens` stacks it); ``None`` where that branch is ``x`` alone.
        proposals, picks, keeps, size: as :func:`lookahead.draft.encode_rows` takes them.
        constants: as :func:`build_step` takes it.
    """
    B, L = len(positions), window * levels
    T = L + size
    rows, head = _constant_parts(constants, window, levels, T)
    starts = row_starts(proposals, picks)
    block, meta = host_ops().encode_step(proposals.parents, proposals.tokens, starts, keeps, size, positions, xs,
                                         window_tokens, head, rows)
    spans = input_spans(B, T, size, rows.numel())
    depth, end = block[spans["depth"][0]].view(B, size), block[spans["end"][0]].view(B, size)
    step = _packed(block, StepLayout(window, levels, TreeShape.trusted(depth, end) if size else None), B, T, rows)
    K = sum(keeps)
    trees = trees_in_batch(proposals, starts, keeps, (step.tokens[:, L:], depth, end), meta[:K], meta[K: 2 * K],
                           meta[2 * K:])
    return step, trees


class Repositioned:
    """A packed step (``build_step(..., pack=True)``) rewritten in place for each step of rows that feed one token
    before a fixed tree: :meth:`__call__` writes each row's ``x``, its positions and its cache length into the
    block, the rest (the tree's tokens, depth, end and node counts; the logits rows) staying as packed. Where a
    step's trees never change (:mod:`lookahead.device_tree`) this is its packing, in a few NumPy writes where
    :func:`pack_step_reference` made the block anew (5.5 us warm for 16 rows against about 140 us in the decoding
    loop under a line profiler, on this project's CPU).

    Args:
        template: the step packed with every row at position 0, ``x`` alone before the tree (one level of one
            column). Its block is the one rewritten: a step runner copies it in before the next call."""

    def __init__(self, template: Step):
        if template.packed is None or template.layout.lookahead_len != 1:
            raise ValueError("Repositioned needs a packed step of x alone before its tree")
        self.step = template
        B, T = template.tokens.shape
        flat = template.packed.numpy()
        spans = input_spans(B, T, template.layout.tree_size, template.logits_rows.numel())
        self._tokens = flat[spans["tokens"][0]].reshape(B, T)
        self._positions = flat[spans["positions"][0]].reshape(B, T)
        self._offsets = self._positions.copy()  # at position 0: each column's offset from x's position
        self._cache_len = flat[spans["cache_len"][0]]

    def __call__(self, xs: list[int], positions: list[int]) -> Step:
        p = np.asarray(positions, dtype=np.int64)
        self._tokens[:, 0] = xs
        np.add(self._offsets, p[:, None], out=self._positions)
        self._cache_len[:] = p
        return self.step


def pack_step_reference(positions: list[int], lookahead_tokens: torch.Tensor, L: int, trees: DraftTrees | None,
                        rows: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
    """A packed step's block (:func:`lookahead.runner.input_spans`' layout), written through NumPy views: the
    reference of the block ``lookahead_draft.encode_step`` writes (:func:`build_tree_step`), and the packing of
    trees the Python builder made."""
    B = len(positions)
    V = trees.tokens.shape[1] if trees is not None else 0
    T = L + V
    spans = input_spans(B, T, V, rows.numel())
    block = torch.empty(spans["rows"][0].stop, dtype=torch.long)
    flat = block.numpy()
    p = np.asarray(positions, dtype=np.int64)[:, None]
    tokens, places = flat[spans["tokens"][0]].reshape(B, T), flat[spans["positions"][0]].reshape(B, T)
    tokens[:, :L] = lookahead_tokens.numpy().reshape(B, L)
    places[:, :L] = head.numpy() + p
    flat[spans["cache_len"][0]] = p[:, 0]
    flat[spans["rows"][0]] = rows.numpy()
    if V:
        tokens[:, L:] = trees.tokens.numpy()
        depth = trees.depth.numpy()
        places[:, L:] = depth + p
        flat[spans["depth"][0]] = depth.reshape(-1)
        flat[spans["end"][0]] = trees.end.numpy().reshape(-1)
        flat[spans["num_nodes"][0]] = trees.num_nodes
    else:
        flat[spans["num_nodes"][0]] = 0
    return block


def packed_plain_step(tokens: list[int], positions: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A plain step's inputs (one token a row at its position, no tree, every row's logits) in a step runner's
    layout (:func:`lookahead.runner.input_spans` with ``T = 1``, ``V = 0``, no rows): ``(block int64 [4 B], tokens
    [B, 1], positions [B, 1])``, the last two views of the block (tokens, positions, the cache lengths (the positions
    again), zero nodes a row)."""
    B = len(tokens)
    block = torch.tensor(tokens + positions + positions + [0] * B, dtype=torch.long)
    spans = input_spans(B, 1, 0, None)
    return block, block[spans["tokens"][0]].view(B, 1), block[spans["positions"][0]].view(B, 1)


def _constant_parts(constants: dict | None, window: int, levels: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`constant_parts`, kept in ``constants`` (``None``: made anew)."""
    key = (window, levels, T)
    parts = None if constants is None else constants.get(key)
    if parts is None:
        parts = constant_parts(*key)
        if constants is not None:
            constants[key] = parts
    return parts


def constant_parts(window: int, levels: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What every step of ``T`` tokens with this window packs the same: the logits rows read back (LongTensor
    ``[R]``) and the lookahead branch's position offsets (LongTensor ``[window * levels]``). Steps share them (never
    written): made each step, they were a third of packing one (about 12 us of 30 at one row, on the CPU)."""
    layout = StepLayout(window, levels)
    rows = ([] if levels == 1 else [0]) + list(layout.last_level_rows()) + list(range(layout.lookahead_len, T))
    return torch.tensor(rows, dtype=torch.long), layout.position_offsets()


def upload(tensors: list[torch.Tensor], device) -> list[torch.Tensor]:
    """Host int64 tensors on ``device``, in one copy (from a pinned block on CUDA, so it does not wait for the
    device): each small copy of a step's inputs would cost a launch of its own. On the CPU they are returned as
    they are (made contiguous)."""
    device = torch.device(device)
    if device.type == "cpu":
        return [t.contiguous() for t in tensors]
    flat = torch.cat([t.reshape(-1) for t in tensors])
    if device.type == "cuda":
        flat = flat.pin_memory()
    flat = flat.to(device, non_blocking=True)
    out, start = [], 0
    for t in tensors:
        out.append(flat[start: start + t.numel()].view(t.shape))
        start += t.numel()
    return out
