"""Each logits row's ``k`` largest entries and their softmax among themselves, on the GPU: what a tree step's graph
hands the successor table (``lookahead/successors.py``, ``SuccessorTable.top``) for every row it computed.

Why a kernel: ``torch.topk`` selects by several radix passes, each a few launches, and sorts what it selected. On
an H200 (session 54) reading one row's top 8 of SmolLM2's 49152 logits back from a plain step's graph, and
recording them, cost 0.25-0.28 ms a step (1.65 against 1.37-1.41 ms); a tree step's graph runs the same selection
over every row it computed (x and its tree's nodes: mostly 16-33 at one row, up to 256). Here: two launches. The
first cuts each row into slices of :data:`SLICE` entries and keeps each slice's ``k`` largest (``k`` rounds of a
maximum over the slice, in registers); the second takes each row's largest ``k`` among its slices' and their
softmax.

Order, as ``csrc/row_topk.cpp`` (the CPU op): larger first, NaN the largest (as ``torch.topk``), the lower index
first among equal entries. Entries are compared through an int32 key with float32's order (NaN above +inf).

:func:`row_top_k` checks its inputs (``ValueError``), allocates and launches; it is the torch custom op
``lookahead::row_top_k``. On CPU tensors it runs only under Triton's interpreter (``TRITON_INTERPRET=1`` set before
this module is imported). The reference is ``SuccessorTable.top_reference`` (``torch.topk`` and a softmax; the
tests also compare with a stable top-k in float64, which fixes the order of ties).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import interpreted, on_device

# Entries a first-pass program takes of a row (a power of two, a multiple of 16: 16-byte loads).
SLICE = 2048
# Keys below every entry's (masked or taken entries) and an index above every row's.
_INT32_MIN = tl.constexpr(-2147483648)
_INT32_MAX = tl.constexpr(2147483647)


@triton.jit
def _sortable_key(v):
    # float32 -> int32 with the same order (negative floats' bits flipped but for the sign), NaN the largest.
    bits = v.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    key = tl.where(v == 0.0, 0, key)  # -0.0 equals 0.0
    return tl.where(v != v, 2147483647, key)


@triton.jit
def _slice_top_kernel(logits_ptr, vals_ptr, idx_ptr, V, R, stride_b, stride_r, num_slices,
                      K: tl.constexpr, KP: tl.constexpr, SLICE: tl.constexpr):
    # Program (row, s): the K largest of row's entries s * SLICE .. (s + 1) * SLICE, largest first, into the
    # workspace [rows, num_slices, KP] (values, and indices into the row; positions past K left as they are).
    row = tl.program_id(0)
    s = tl.program_id(1)
    base = logits_ptr + (row // R).to(tl.int64) * stride_b + (row % R).to(tl.int64) * stride_r
    cols = s * SLICE + tl.arange(0, SLICE)
    ok = cols < V
    v = tl.load(base + cols, mask=ok, other=0.0).to(tl.float32)
    key = tl.where(ok, _sortable_key(v), _INT32_MIN)
    out = (row.to(tl.int64) * num_slices + s) * KP
    for j in tl.static_range(K):
        best = tl.max(key, axis=0)
        at = tl.min(tl.where(key == best, cols, _INT32_MAX), axis=0)  # the lower index among equals
        tl.store(vals_ptr + out + j, tl.sum(tl.where(cols == at, v, 0.0), axis=0))
        tl.store(idx_ptr + out + j, tl.where(best == _INT32_MIN, -1, at))  # -1: the slice had fewer than K
        key = tl.where(cols == at, _INT32_MIN, key)


@triton.jit
def _merge_top_kernel(vals_ptr, idx_ptr, ids_ptr, probs_ptr, num_slices,
                      K: tl.constexpr, KP: tl.constexpr, CAND: tl.constexpr):
    # Program row: the K largest of the row's num_slices * K candidates, largest first, and exp(v - v_max) over
    # their sum.
    row = tl.program_id(0)
    c = tl.arange(0, CAND)
    ok = (c // KP < num_slices) & (c % KP < K)
    src = row.to(tl.int64) * num_slices * KP + c
    v = tl.load(vals_ptr + src, mask=ok, other=0.0)
    at = tl.load(idx_ptr + src, mask=ok, other=-1)
    ok = ok & (at >= 0)
    key = tl.where(ok, _sortable_key(v), _INT32_MIN)
    ks = tl.arange(0, KP)
    top_v = tl.zeros((KP,), dtype=tl.float32)
    top_i = tl.zeros((KP,), dtype=tl.int64)
    for j in tl.static_range(K):
        best = tl.max(key, axis=0)
        pick = tl.min(tl.where(ok & (key == best), at, _INT32_MAX), axis=0)  # the lower index among equals
        chosen = ok & (at == pick)
        top_v = tl.where(ks == j, tl.sum(tl.where(chosen, v, 0.0), axis=0), top_v)
        top_i = tl.where(ks == j, pick.to(tl.int64), top_i)
        key = tl.where(chosen, _INT32_MIN, key)
        ok = ok & ~chosen
    first = tl.sum(tl.where(ks == 0, top_v, 0.0), axis=0)  # a sum, not a max: a NaN first entry stays NaN
    e = tl.where(ks < K, tl.exp(top_v - first), 0.0)
    probs = e / tl.sum(e, axis=0)
    out = row.to(tl.int64) * K + ks
    tl.store(ids_ptr + out, top_i, mask=ks < K)
    tl.store(probs_ptr + out, probs, mask=ks < K)


def _launch(logits: torch.Tensor, k: int, ids: torch.Tensor, probs: torch.Tensor) -> None:
    """``ids``/``probs [N, k]`` from ``logits [B, R, V]`` (``N = B * R`` rows, the last dimension contiguous), inputs
    already checked, ``1 <= k <= V``."""
    B, R, V = logits.shape
    N = B * R
    if N == 0:
        return
    kp = max(2, triton.next_power_of_2(k))
    slices = triton.cdiv(V, SLICE)
    vals = torch.empty((N, slices, kp), dtype=torch.float32, device=logits.device)
    idx = torch.empty((N, slices, kp), dtype=torch.int32, device=logits.device)
    with on_device(logits):
        _slice_top_kernel[(N, slices)](logits, vals, idx, V, R, logits.stride(0), logits.stride(1), slices,
                                       K=k, KP=kp, SLICE=SLICE, num_warps=4)
        _merge_top_kernel[(N,)](vals, idx, ids, probs, slices, K=k, KP=kp,
                                CAND=max(16, triton.next_power_of_2(slices * kp)), num_warps=4)


@torch.library.custom_op("lookahead::row_top_k", mutates_args=())
def _row_top_k_op(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    lead, V = logits.shape[:-1], logits.shape[-1]
    k = min(k, V)
    x = logits.reshape(-1, 1, V) if logits.dim() == 2 else logits
    ids = torch.empty((*lead, k), dtype=torch.long, device=logits.device)
    probs = torch.empty((*lead, k), dtype=torch.float32, device=logits.device)
    _launch(x, k, ids.view(-1, k), probs.view(-1, k))
    return ids, probs


@_row_top_k_op.register_fake
def _row_top_k_fake(logits, k):
    shape = (*logits.shape[:-1], min(k, logits.shape[-1]))
    return logits.new_empty(shape, dtype=torch.long), logits.new_empty(shape, dtype=torch.float32)


def row_top_k(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's ``k`` largest logits and their softmax among themselves.

    Args:
        logits: float32, bfloat16 or float16 ``[R, V]`` or ``[B, R, V]``, the last dimension contiguous (any
            strides before it: a slice of a step's rows serves), ``V >= 1``.
        k: ``>= 1``; ``min(k, V)`` entries a row are kept.
    Returns:
        ``(ids, probs)``: int64 and float32, the leading shape + ``[min(k, V)]``: the largest entries' indices,
        largest first (NaN the largest; the lower index first among equal entries), and ``exp(v - v_max)`` over
        their sum (NaN where a NaN was kept).
    Raises:
        ValueError: on another dtype or rank, a non-contiguous last dimension, an empty vocabulary, ``k < 1``, or
            CPU tensors without Triton's interpreter.
    """
    problem = unreadable(logits)
    if problem is not None:
        raise ValueError(f"row_top_k: {problem}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"row_top_k: k must be an int >= 1, got {k!r}")
    return _row_top_k_op(logits, k)


def unreadable(logits) -> str | None:
    """Why :func:`row_top_k` cannot take ``logits`` (what it needs, and what was given), or ``None`` where it can:
    the one check its callers share (``SuccessorTable.top`` falls back to ``torch.topk`` instead)."""
    if not isinstance(logits, torch.Tensor) or logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        got = logits.dtype if isinstance(logits, torch.Tensor) else type(logits).__name__
        return f"logits must be a float32, bfloat16 or float16 tensor, got {got}"
    if logits.dim() not in (2, 3) or logits.shape[-1] == 0 or (logits.shape[-1] > 1 and logits.stride(-1) != 1):
        return (f"logits must be [R, V] or [B, R, V] with V >= 1 and the last dimension contiguous, got shape "
                f"{tuple(logits.shape)} strides {logits.stride()}")
    if logits.device.type != "cuda" and not interpreted(_slice_top_kernel):
        return (f"the Triton kernels need CUDA tensors (or CPU tensors with TRITON_INTERPRET=1 set before "
                f"lookahead_kernels.row_topk is imported), got {logits.device}")
    return None
