"""A verified device-tree step's tops written into its rows' successor tables in one launch
(``lookahead/device_tree.py``, ``DeviceSuccessors.record``).

Why a kernel: in torch the write is about 25 small launches a step (the accepted path's rows, their tokens and the
tokens before them, the pair slots and keys, three scatters, the token before the next ``x``), a microsecond or two
each in a GPU's graph. Here one program a row walks the nodes, then ``x`` and its accepted nodes, in order, so a
token or slot written twice in one step keeps the later write (the torch scatters leave that order unspecified on a
GPU).

What is written, per row: first each tree node's ``j`` tops (accepted or not, in node order) become the first ``j``
successors of its token; then for ``x`` and each accepted node in path order (the rows that saw their true
context) its ``j`` tops become the first ``j`` successors of its token and of the pair (the token before it, its
token); the token before ``x`` (``prev``) becomes the last of them. ``DeviceSuccessors.record_reference`` is the
reference.

:func:`tree_record` checks its inputs (``ValueError``) and launches; it is the torch custom op
``lookahead::tree_record`` (it writes ``table``, ``pairs``, ``pair_keys`` and ``prev`` in place). On CPU tensors it
runs only under Triton's interpreter (``TRITON_INTERPRET=1`` set before this module is imported).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import interpreted, on_device
from .tree_draft import pair_slot_key


@triton.jit
def _tree_record_kernel(fed_ptr, tops_ptr, path_ptr, table_ptr, pairs_ptr, keys_ptr, prev_ptr,
                        fed_s0, fed_s1, tops_s0, tops_s1, path_s0, path_s1, vocab, j, V,
                        K: tl.constexpr, SLOTS: tl.constexpr, A: tl.constexpr, J: tl.constexpr):
    # Program b: every node's tops under its token, in node order; then x's row and each accepted node's, in
    # order, under token and pair (a row past the path writes nothing). The same columns go to the same threads
    # in every write, so a later write to an entry lands after an earlier one.
    b = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, J)
    take = cols < j
    for i in range(1, V + 1):
        token = tl.load(fed_ptr + b * fed_s0 + i * fed_s1)
        tops = tl.load(tops_ptr + b * tops_s0 + i * tops_s1 + cols, mask=take, other=0).to(tl.int32)
        tl.store(table_ptr + (b * vocab + token) * K + cols, tops, mask=take)
    before = tl.load(prev_ptr + b)
    live = True
    for a in tl.static_range(A + 1):
        if a == 0:
            row = 0
        else:
            node = tl.load(path_ptr + b * path_s0 + (a - 1) * path_s1)
            live = live & (node >= 0)
            row = tl.maximum(node, 0) + 1
        token = tl.load(fed_ptr + b * fed_s0 + row * fed_s1)
        tops = tl.load(tops_ptr + b * tops_s0 + row * tops_s1 + cols, mask=take, other=0).to(tl.int32)
        tl.store(table_ptr + (b * vocab + token) * K + cols, tops, mask=take & live)
        slot, key = pair_slot_key(before, token, vocab, SLOTS)
        tl.store(keys_ptr + b * SLOTS + slot, key, mask=live)
        tl.store(pairs_ptr + (b * SLOTS + slot) * K + cols, tops, mask=take & live)
        before = tl.where(live, token, before)
    tl.store(prev_ptr + b, before)


@torch.library.custom_op("lookahead::tree_record", mutates_args=("table", "pairs", "pair_keys", "prev"))
def _tree_record_op(fed: torch.Tensor, tops: torch.Tensor, path: torch.Tensor, table: torch.Tensor,
                    pairs: torch.Tensor, pair_keys: torch.Tensor, prev: torch.Tensor) -> None:
    B, vocab, k = table.shape
    j, A = tops.shape[2], path.shape[1]
    if B:
        with on_device(fed):
            _tree_record_kernel[(B,)](fed, tops, path, table, pairs, pair_keys, prev, fed.stride(0), fed.stride(1),
                                      tops.stride(0), tops.stride(1), path.stride(0), path.stride(1), vocab, j,
                                      fed.shape[1] - 1, K=k, SLOTS=pairs.shape[1], A=A,
                                      J=max(2, triton.next_power_of_2(j)), num_warps=1)


@_tree_record_op.register_fake
def _tree_record_fake(fed, tops, path, table, pairs, pair_keys, prev):
    return None


def tree_record(fed: torch.Tensor, tops: torch.Tensor, path: torch.Tensor, table: torch.Tensor,
                pairs: torch.Tensor, pair_keys: torch.Tensor, prev: torch.Tensor) -> None:
    """Write a verified step's tops into the rows' tables, in place: every node's under its token, then ``x``'s
    and the accepted nodes' under token and pair (the module docstring).

    Args:
        fed: int64 ``[B, 1 + V]`` (any strides): ``x`` and the tree's tokens.
        tops: int64 ``[B, 1 + V, j]`` (the last dimension contiguous): the most likely next tokens after each of
            them, ``j <= k``.
        path: int64 ``[B, A]`` (any strides): the accepted nodes' indexes in path order, ``-1`` past them
            (``A <= 64``).
        table: int32 ``[B, vocab, k]``, pairs: int32 ``[B, S, k]`` (``S`` a power of two), pair_keys: int64
            ``[B, S]``, prev: int64 ``[B]``, all contiguous: the tables (``lookahead.device_tree.DeviceSuccessors``),
            written in place.
        All on one device.
    Raises:
        ValueError: on other dtypes, shapes or devices, or CPU tensors without Triton's interpreter.
    """
    named = dict(fed=fed, tops=tops, path=path, table=table, pairs=pairs, pair_keys=pair_keys, prev=prev)
    dtypes = dict(fed=torch.long, tops=torch.long, path=torch.long, table=torch.int32, pairs=torch.int32,
                  pair_keys=torch.long, prev=torch.long)
    for name, t in named.items():
        if not isinstance(t, torch.Tensor) or t.dtype != dtypes[name]:
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"tree_record: {name} must be a {dtypes[name]} tensor, got {got}")
        if name in ("table", "pairs", "pair_keys", "prev") and not t.is_contiguous():
            raise ValueError(f"tree_record: {name} must be contiguous")
        if t.device != fed.device:
            raise ValueError(f"tree_record: every tensor on fed's device ({fed.device}), got {name} on {t.device}")
    B = fed.shape[0] if fed.dim() == 2 else -1
    S = pairs.shape[1] if pairs.dim() == 3 else 0
    k = table.shape[2] if table.dim() == 3 else 0
    if B < 0 or tops.dim() != 3 or tops.shape[:2] != fed.shape or not 1 <= tops.shape[2] <= k \
            or (tops.shape[2] > 1 and tops.stride(2) != 1) or path.dim() != 2 or path.shape[0] != B \
            or path.shape[1] > 64 or table.shape[0] != B or tuple(pairs.shape) != (B, S, k) or S < 1 \
            or S & (S - 1) or tuple(pair_keys.shape) != (B, S) or tuple(prev.shape) != (B,):
        raise ValueError("tree_record: needs fed [B, 1 + V], tops [B, 1 + V, j] (last dimension contiguous), "
                         "path [B, A <= 64], table [B, vocab, k >= j], pairs [B, S, k] (S a power of two), "
                         "pair_keys [B, S], prev [B]; got "
                         + ", ".join(f"{name} {tuple(t.shape)}" for name, t in named.items()))
    if fed.device.type != "cuda" and not interpreted(_tree_record_kernel):
        raise ValueError(f"tree_record: the Triton kernel needs CUDA tensors (or CPU tensors with "
                         f"TRITON_INTERPRET=1 set before lookahead_kernels.tree_record is imported), got {fed.device}")
    _tree_record_op(fed, tops, path, table, pairs, pair_keys, prev)
