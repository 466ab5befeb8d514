"""Triton attention for one lookahead step, with the step's visibility rule evaluated inside the kernel.

Queries of one key/value head are packed token-major into the M dimension of a tile: row ``m`` is step token
``m // G`` and query head ``h * G + m % G`` (``G = Hq // Hkv``), so the ``G`` query heads that share a key head
read each key/value row once. Key rows before ``cache_len[b]`` (the committed prefix) are visible to every
query and are read with no mask but the row bound; rows ``cache_len[b] .. cache_len[b] + T - 1`` are the step's
own tokens, and there the rule of :meth:`StepLayout.visible` is recomputed per tile: lookahead tokens from two
layout integers by index arithmetic, verification-tree nodes from the tree's ``end`` array (one integer loaded per
key row of the tile, so O(BLOCK_N) loads; node ``j`` is visible to node ``i`` iff ``j <= i < end[j]``). No
``[T, S]`` or ``[T, T]`` mask exists anywhere on this path.

Split-KV (flash-decoding): when ``B * Hkv`` query tiles would leave the GPU idle, the key rows
``0 .. cache_len + T - 1`` of each sequence are cut into ``num_splits`` ranges, one program each; every program
writes a normalised partial output and its log-sum-exp, and a second small kernel merges them, reading only the
ranges the sequence's keys fill (a graph's split count is chosen for its cache's capacity, not the context).

The torch reference is :func:`lookahead_kernels.attention_ref.attention_torch` (CPU path, same arguments);
the test oracle is :func:`lookahead_kernels.attention_ref.attention_dense_reference`.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .attention_ref import check_attention_args
from .launch import interpreted, on_device
from .layout import StepLayout

SUPPORTED_HEAD_DIMS = (16, 32, 64, 80, 96, 128)  # 16 and 32: small test models
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

_LOG2E = 1.4426950408889634
# Smallest key range worth a program of its own (a multiple of every BLOCK_N used below): 128 rows for query
# tiles of up to 64 packed rows (up to 21 tokens of SmolLM2's 3 query heads a key head), 256 above
# (:func:`_min_chunk`). On the H200 at SmolLM2's shape (session 57, ``gpu_profile.py smoltiles``), a context of
# 256: one row's attention 9.1 us a layer in 4 ranges of at least 128 rows against 13.4 with ranges of at least 256
# (one range did all the work), 16 rows 11.3 against 17.9; at 75 and 120 rows and a context of 1024, 128 lost.
_MIN_CHUNK = 256
_MIN_CHUNK_FEW_ROWS = 128
_FEW_ROWS = 64
_MAX_SPLITS = 64
# Used to size the split when no CUDA device is involved (the interpreter): an H100's SM count.
_DEFAULT_SMS = 132
# Resident programs per SM assumed by the split heuristic (tiles of 64 rows, 4 warps).
_PROGRAMS_PER_SM = 2
# How float32 tiles are multiplied on a GPU: "tf32x3" splits each operand into two tf32 parts on the tensor
# cores (about float32's accuracy); "ieee" (exact products on the CUDA cores) was 25x slower on an H100 at
# SmolLM2's shape (385-457 us against 15-16 us a call, T = 16 to 120, bench/gpu_profile.py smolstep).
_FP32_DOT = "tf32x3"


# ---------------------------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------------------------
# The step's sizes change from step to step (warm-up, tree size): do not compile a variant per value. The
# tree strides follow V (a [B, V] tree's row stride is V; 0 for a tree shared by the batch).
@triton.jit
def _key_range(total, num_splits, BLOCK_N: tl.constexpr, MIN_CHUNK: tl.constexpr):
    # The key rows of one split-KV range for a sequence of `total` keys: whole key tiles, at least MIN_CHUNK. The
    # forward kernel cuts the keys so, and the merge reads the ranges that holds.
    return tl.maximum(tl.cdiv(tl.cdiv(total, num_splits), BLOCK_N) * BLOCK_N, MIN_CHUNK)


@triton.jit(do_not_specialize=["T", "M", "S", "window", "lookahead_len", "tree_size", "num_splits",
                               "stride_eb", "stride_ev"])
def _attn_fwd_kernel(
    # pointers
    Q, K, V, CACHE_LEN, END, OUT, O_PART, LSE_PART,
    # sizes
    T, M, S, HKV, GROUP, window, lookahead_len, tree_size, num_splits, scale_log2,
    # strides
    stride_qb, stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_ob, stride_ot, stride_oh, stride_od,
    stride_eb, stride_ev,
    stride_ps, stride_ls,
    # meta-parameters
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    MIN_CHUNK: tl.constexpr, SPLIT: tl.constexpr, F32_INPUTS: tl.constexpr, UPCAST: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    split = tl.program_id(2)
    b = pid_bh // HKV
    h = pid_bh % HKV
    L = tl.load(CACHE_LEN + b).to(tl.int32)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    t = offs_m // GROUP
    row_ok = offs_m < M
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM  # all true unless D is padded to a power of two (80, 96)
    offs_n = tl.arange(0, BLOCK_N)

    # 64-bit batch/head offsets: a long cache times many heads overflows int32.
    q_ptrs = (Q + b.to(tl.int64) * stride_qb + t[:, None] * stride_qt
              + (h * GROUP + offs_m % GROUP)[:, None] * stride_qh + offs_d[None, :] * stride_qd)
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    k_base = K + b.to(tl.int64) * stride_kb + h.to(tl.int64) * stride_kh + offs_d[:, None] * stride_kd
    v_base = V + b.to(tl.int64) * stride_vb + h.to(tl.int64) * stride_vh + offs_d[None, :] * stride_vd

    # Key rows this program covers.
    total = L + T
    if SPLIT:
        chunk = _key_range(total, num_splits, BLOCK_N, MIN_CHUNK)
        lo = split * chunk
        hi = tl.minimum(lo + chunk, total)
    else:
        lo = 0
        hi = total
    # A step token only sees step tokens with an index <= its own: stop after the tile's last query token.
    t_last = tl.minimum((pid_m * BLOCK_M + BLOCK_M - 1) // GROUP, T - 1)
    hi = tl.minimum(hi, L + t_last + 1)
    # Tiles wholly inside the prefix need no mask; lo is a multiple of BLOCK_N so tiles stay aligned.
    full_end = tl.maximum(tl.minimum(hi, (L // BLOCK_N) * BLOCK_N), lo)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    for start in range(lo, full_end, BLOCK_N):
        n = start + offs_n
        k = tl.load(k_base + n[None, :] * stride_ks, mask=d_ok[:, None], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        if F32_INPUTS:
            s = tl.dot(q, k, input_precision=FP32_DOT)
        else:
            s = tl.dot(q, k)
        s = s * scale_log2
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + n[:, None] * stride_vs, mask=d_ok[None, :], other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        if F32_INPUTS:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=FP32_DOT)
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    # The tile straddling cache_len and the step's own rows: prefix bound plus the layout rule. Per query row:
    # lookahead (level, column), or tree node uq (rows t >= T are never stored; their values do not matter).
    q_look = t < lookahead_len
    lq = t // window
    cq = t % window
    uq = t - lookahead_len
    end_base = END + b.to(tl.int64) * stride_eb
    for start in range(full_end, hi, BLOCK_N):
        n = start + offs_n
        # Rows past the step (or the cache) may hold anything, NaN included: never load them.
        n_ok = (n < hi) & (n < S)
        k = tl.load(k_base + n[None, :] * stride_ks, mask=n_ok[None, :] & d_ok[:, None], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        if F32_INPUTS:
            s = tl.dot(q, k, input_precision=FP32_DOT)
        else:
            s = tl.dot(q, k)
        s = s * scale_log2
        kidx = n - L
        # Lookahead keys: a level-0 token at a column <= the query's, or the query's own column at a level <=.
        k_look = (kidx >= 0) & (kidx < lookahead_len)
        lk = kidx // window
        ck = kidx % window
        look = (q_look[:, None] & k_look[None, :]
                & (((lk[None, :] == 0) & (ck[None, :] <= cq[:, None]))
                   | ((ck[None, :] == cq[:, None]) & (lk[None, :] <= lq[:, None]))))
        # Tree keys: node uk is visible to node uq iff uk <= uq < end[uk]; one end load per key row. A lookahead
        # query has uq < 0 <= uk, so it sees no tree key.
        uk = kidx - lookahead_len
        k_tree = (uk >= 0) & (uk < tree_size) & n_ok
        end_k = tl.load(end_base + tl.where(k_tree, uk, 0).to(tl.int64) * stride_ev, mask=k_tree, other=0)
        end_k = end_k.to(tl.int32)
        tree = k_tree[None, :] & (uk[None, :] <= uq[:, None]) & (uq[:, None] < end_k[None, :])
        # x (step index 0) is visible to every step token; rows before it are the committed prefix.
        visible = n_ok[None, :] & ((kidx <= 0)[None, :] | look | tree)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row may see nothing in this tile (or this split): keep exp2 away from (-inf) - (-inf).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + n[:, None] * stride_vs, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        if F32_INPUTS:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=FP32_DOT)
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    has = l_i > 0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    if SPLIT:
        # Partials are contiguous [splits, B, Hkv, M, D] and [splits, B, Hkv, M]; lse in base 2.
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        row = pid_bh * M + offs_m
        tl.store(LSE_PART + split * stride_ls + row, lse, mask=row_ok)
        tl.store(O_PART + split * stride_ps + row[:, None] * HEAD_DIM + offs_d[None, :], o,
                 mask=row_ok[:, None] & d_ok[None, :])
    else:
        o_ptrs = (OUT + b.to(tl.int64) * stride_ob + t[:, None] * stride_ot
                  + (h * GROUP + offs_m % GROUP)[:, None] * stride_oh + offs_d[None, :] * stride_od)
        tl.store(o_ptrs, o.to(OUT.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=["T", "M", "num_splits"])
def _attn_merge_kernel(
    # pointers
    O_PART, LSE_PART, CACHE_LEN, OUT,
    # sizes
    T, M, HKV, GROUP, num_splits,
    # strides
    stride_ps, stride_ls, stride_ob, stride_ot, stride_oh, stride_od,
    # meta-parameters
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, FWD_BLOCK_N: tl.constexpr,
    MIN_CHUNK: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // HKV
    h = pid_bh % HKV
    # Only the ranges the forward kernel gave rows (its chunk rule): a graph's split count is set for its cache's
    # capacity, while a sequence's keys may fill a few ranges of it; the others hold empty partials, left unread.
    total = tl.load(CACHE_LEN + b).to(tl.int32) + T
    used = tl.minimum(tl.cdiv(total, _key_range(total, num_splits, FWD_BLOCK_N, MIN_CHUNK)), num_splits)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < M
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    row = pid_bh * M + offs_m

    m_run = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_run = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for s in range(0, used):
        lse = tl.load(LSE_PART + s * stride_ls + row, mask=row_ok, other=float("-inf"))
        o = tl.load(O_PART + s * stride_ps + row[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        m_new = tl.maximum(m_run, lse)
        # Empty splits carry lse = -inf; rows stay -inf until their first non-empty split.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_run - m_safe)
        w = tl.exp2(lse - m_safe)
        acc = acc * alpha[:, None] + o * w[:, None]
        l_run = l_run * alpha + w
        m_run = m_new

    o = acc / tl.where(l_run > 0, l_run, 1.0)[:, None]
    t = offs_m // GROUP
    o_ptrs = (OUT + b.to(tl.int64) * stride_ob + t[:, None] * stride_ot
              + (h * GROUP + offs_m % GROUP)[:, None] * stride_oh + offs_d[None, :] * stride_od)
    tl.store(o_ptrs, o.to(OUT.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


# ---------------------------------------------------------------------------------------------------------------
# launch
# ---------------------------------------------------------------------------------------------------------------
def _tile_config(M: int, D: int, dtype: torch.dtype):
    """(BLOCK_M, BLOCK_N, BLOCK_D, num_warps, num_stages) for a head dim, packed row count and dtype."""
    block_m = 16 if M <= 16 else (32 if M <= 32 else 64)
    if dtype == torch.float32:
        # float32 tiles of 64 rows spill registers: 25x slower on an H100 (SmolLM2 shape, T = 16 to 120).
        block_m = 16
    block_d = triton.next_power_of_2(D)
    # fp32 tiles are twice the bytes: halve the key tile to stay within shared memory.
    block_n = 32 if dtype == torch.float32 and block_d >= 128 else 64
    return block_m, block_n, block_d, 4, 2


def _min_chunk(M: int) -> int:
    """The least key range of a program for query tiles of ``M`` packed rows (``G * T``)."""
    return _MIN_CHUNK_FEW_ROWS if M <= _FEW_ROWS else _MIN_CHUNK


def choose_num_splits(programs: int, max_rows: int, num_sms: int = _DEFAULT_SMS,
                      min_chunk: int = _MIN_CHUNK) -> int:
    """How many key ranges to give each query tile.

    ``programs`` is the number of programs without splitting (query tiles x ``B * Hkv``); ``max_rows`` an upper
    bound on ``cache_len + T``. Split only while the GPU is not already busy, keep every range at least
    ``min_chunk`` rows (:func:`_min_chunk`), and among the counts that fit pick the fewest splits whose last wave
    is nearly full. Where ``max_rows`` is a cache's capacity (a graph's), the kernels use as many of the ranges as
    the sequence's keys fill.
    """
    slots = max(1, num_sms * _PROGRAMS_PER_SM)
    max_useful = max(1, min(_MAX_SPLITS, -(-max_rows // min_chunk)))
    if programs >= 0.8 * slots or max_useful == 1:
        return 1
    eff = []
    for s in range(1, max_useful + 1):
        waves = programs * s / slots
        eff.append(waves / math.ceil(waves))
    best = max(eff)
    return next(s for s, e in enumerate(eff, start=1) if e >= 0.85 * best)


def _launch(q, k_cache, v_cache, cache_len, window, levels, tree_size, end, sm_scale, num_splits, out,
            o_part=None, lse_part=None):
    """Run the kernels into ``out``. Arguments are already validated; ``end`` is the tree's end array (``[V]``
    shared or ``[B, V]`` per sequence, integer, on ``q``'s device; empty with ``tree_size == 0``).
    ``o_part``/``lse_part`` let tests poison the split workspace (``[num_splits, B, Hkv, M, D]`` and
    ``[num_splits, B, Hkv, M]`` float32)."""
    B, T, Hq, D = q.shape
    if tree_size:
        stride_eb = end.stride(0) if end.dim() == 2 else 0
        stride_ev = end.stride(-1)
    else:
        stride_eb = stride_ev = 0
    S, Hkv = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    M = G * T
    block_m, block_n, block_d, warps, stages = _tile_config(M, D, q.dtype)
    split = num_splits > 1
    # Triton's CPU interpreter computes tl.dot of bfloat16 operands wrongly: give it float32 there.
    upcast = q.dtype == torch.bfloat16 and interpreted(_attn_fwd_kernel)
    if split:
        if o_part is None:
            o_part = torch.empty((num_splits, B, Hkv, M, D), dtype=torch.float32, device=q.device)
        if lse_part is None:
            lse_part = torch.empty((num_splits, B, Hkv, M), dtype=torch.float32, device=q.device)
        stride_ps, stride_ls = o_part.stride(0), lse_part.stride(0)
    else:
        o_part = lse_part = out  # unused by the kernel when SPLIT is False
        stride_ps = stride_ls = 0
    grid = (triton.cdiv(M, block_m), B * Hkv, num_splits)
    _attn_fwd_kernel[grid](
        q, k_cache, v_cache, cache_len, end, out, o_part, lse_part,
        T, M, S, Hkv, G, window, window * levels, tree_size, num_splits, sm_scale * _LOG2E,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(),
        stride_eb, stride_ev,
        stride_ps, stride_ls,
        HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        MIN_CHUNK=_min_chunk(M), SPLIT=split, F32_INPUTS=q.dtype == torch.float32 or upcast, UPCAST=upcast,
        FP32_DOT="ieee" if interpreted(_attn_fwd_kernel) else _FP32_DOT,
        num_warps=warps, num_stages=stages,
    )
    if split:
        _merge(o_part, lse_part, cache_len, out, G, block_n)


def _merge(o_part, lse_part, cache_len, out, G: int, block_n: int) -> None:
    """The split partials (``o_part [splits, B, Hkv, M, D]``, ``lse_part [splits, B, Hkv, M]`` float32, as the
    forward kernel wrote them for ``out``'s step and ``cache_len`` with key tiles of ``block_n``) merged into
    ``out [B, T, Hq, D]``; only the ranges each sequence's keys fill are read."""
    num_splits, B, Hkv, M, D = o_part.shape
    T = out.shape[1]
    block_d = triton.next_power_of_2(D)
    merge_m = 32
    _attn_merge_kernel[(triton.cdiv(M, merge_m), B * Hkv)](
        o_part, lse_part, cache_len, out,
        T, M, Hkv, G, num_splits,
        o_part.stride(0), lse_part.stride(0), *out.stride(),
        HEAD_DIM=D, BLOCK_M=merge_m, BLOCK_D=block_d, FWD_BLOCK_N=block_n, MIN_CHUNK=_min_chunk(M),
        num_warps=4,
    )


def tree_end(layout: StepLayout, batch: int, device) -> torch.Tensor:
    """The ``end`` argument of the custom ops for ``layout``: its tree's end array (``[V]`` or ``[B, V]``, int32
    or int64) on ``device``, or an empty int64 tensor when the layout has no tree (``tree_size == 0``).

    Raises ``ValueError`` when a per-sequence tree does not have ``batch`` rows."""
    tree = layout.tree
    if tree is None or tree.size == 0:
        return torch.empty(0, dtype=torch.int64, device=device)
    end = tree.end
    if end.dim() == 2 and end.shape[0] != batch:
        raise ValueError(f"the layout's per-sequence tree has {end.shape[0]} rows but the batch has B={batch}")
    if end.dtype not in (torch.int32, torch.int64):
        end = end.to(torch.int64)
    # No copy when the tree already lives on the device (build it there: a host tree costs a copy per call).
    return end.to(device)


@torch.library.custom_op("lookahead::attention", mutates_args=())
def _attention_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_len: torch.Tensor,
                  window: int, levels: int, tree_size: int, end: torch.Tensor, sm_scale: float,
                  num_splits: int) -> torch.Tensor:
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    with on_device(q):
        _launch(q, k_cache, v_cache, cache_len, window, levels, tree_size, end, sm_scale, num_splits, out)
    return out


@_attention_op.register_fake
def _attention_fake(q, k_cache, v_cache, cache_len, window, levels, tree_size, end, sm_scale, num_splits):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


@torch.library.custom_op("lookahead::attention_out", mutates_args=("out",))
def _attention_out_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_len: torch.Tensor,
                      window: int, levels: int, tree_size: int, end: torch.Tensor, sm_scale: float,
                      num_splits: int, out: torch.Tensor) -> None:
    with on_device(q):
        _launch(q, k_cache, v_cache, cache_len, window, levels, tree_size, end, sm_scale, num_splits, out)


@_attention_out_op.register_fake
def _attention_out_fake(q, k_cache, v_cache, cache_len, window, levels, tree_size, end, sm_scale,
                        num_splits, out):
    return None


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _DEFAULT_SMS


def lookahead_attention(q, k_cache, v_cache, *, cache_len, layout: StepLayout, sm_scale=None, num_splits=None,
                        out=None):
    """Attention of one lookahead step over a KV cache, the step's mask evaluated in the kernel.

    Args:
        q: ``[B, T, Hq, D]`` queries with rotary applied, ``T == layout.T``; float16, bfloat16 or float32;
            ``D`` in 16, 32, 64, 80, 96, 128. Any strides.
        k_cache, v_cache: ``[B, S, Hkv, D]``, same dtype and device as ``q``, ``Hq % Hkv == 0``; the step's own
            keys/values already written at rows ``cache_len[b] .. cache_len[b] + T - 1``; rows past those are
            never read. Any strides.
        cache_len: int, or int32/int64 tensor ``[B]`` (or 0-d): committed rows per sequence, ``>= 0`` and
            ``cache_len + T <= S`` (checked when it is an int or a CPU tensor; a CUDA tensor is not read on the
            host).
        layout: the step's :class:`StepLayout`. Rows before ``cache_len`` are visible to every query; among the
            step's rows ``layout.visible`` holds. Its tree (``[V]`` shared, or ``[B, V]`` per sequence) is read
            on ``q``'s device: build it there, or it is copied there on every call.
        sm_scale: softmax scale, default ``1/sqrt(D)``.
        num_splits: key ranges per query tile (split-KV); ``None`` chooses from the prefix length and the
            device's SM count; ``1`` disables splitting.
        out: optional ``[B, T, Hq, D]`` tensor of ``q``'s dtype and device to write into (any strides).
    Returns:
        ``[B, T, Hq, D]`` in ``q``'s dtype (``out`` when given). Computed in float32.
    Raises:
        ValueError: on any argument outside the above.
    """
    lens = check_attention_args(q, k_cache, v_cache, cache_len, layout)
    B, T, Hq, D = q.shape
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"lookahead_attention supports float16, bfloat16, float32; got {q.dtype}")
    if D not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"lookahead_attention supports head dims {SUPPORTED_HEAD_DIMS}; got D={D}")
    if q.device.type != "cuda" and not (q.device.type == "cpu" and interpreted(_attn_fwd_kernel)):
        raise ValueError(f"lookahead_attention needs CUDA tensors (CPU only under TRITON_INTERPRET=1), got "
                         f"{q.device}; use lookahead_kernels.attention_torch on CPU")
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(D)
    elif isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float)) or not math.isfinite(sm_scale) \
            or sm_scale <= 0:
        raise ValueError(f"sm_scale must be a positive finite float or None, got {sm_scale!r}")
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.shape != q.shape or out.dtype != q.dtype \
                or out.device != q.device:
            got = (tuple(out.shape), out.dtype, out.device) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValueError(f"out must be a tensor of shape {tuple(q.shape)}, dtype {q.dtype} on {q.device}; "
                             f"got {got}")
    Hkv, S = k_cache.shape[2], k_cache.shape[1]
    if B == 0:  # nothing to attend; a grid of size 0 cannot launch
        return out if out is not None else torch.empty(q.shape, dtype=q.dtype, device=q.device)
    # A host-side cache_len (int or CPU tensor) is checked here even when the kernel runs on the GPU; a device
    # tensor is never read back (no sync), and the cache size then bounds the rows to read.
    if isinstance(cache_len, torch.Tensor) and cache_len.device.type != "cpu":
        max_rows = S
    else:
        host = torch.as_tensor(cache_len).reshape(-1)
        if int(host.min()) < 0:
            raise ValueError(f"cache_len must be >= 0, got {host.tolist()}")
        if int(host.max()) + T > S:
            raise ValueError(f"cache too short: cache_len {int(host.max())} + T {T} > S {S} rows")
        max_rows = int(host.max()) + T
    if num_splits is None:
        M = (Hq // Hkv) * T
        programs = triton.cdiv(M, _tile_config(M, D, q.dtype)[0]) * B * Hkv
        num_splits = choose_num_splits(programs, max_rows, _num_sms(q.device), _min_chunk(M))
    elif isinstance(num_splits, bool) or not isinstance(num_splits, int) or not 1 <= num_splits <= _MAX_SPLITS:
        raise ValueError(f"num_splits must be None or an int in 1..{_MAX_SPLITS}, got {num_splits!r}")
    args = (q, k_cache, v_cache, lens, layout.window, layout.levels, layout.tree_size, tree_end(layout, B, q.device),
            float(sm_scale), num_splits)
    if out is None:
        return torch.ops.lookahead.attention(*args)
    torch.ops.lookahead.attention_out(*args, out)
    return out


def lookahead_flex_attention(q, k_cache, v_cache, *, cache_len, layout: StepLayout, sm_scale=None,
                             compiled=False, return_block_mask=False):
    """The same attention through ``torch.nn.attention.flex_attention`` with ``layout.mask_mod`` (a peer).

    Same arguments and result as :func:`lookahead_attention`. ``compiled=True`` runs the fused kernel through
    ``torch.compile`` (GPU); otherwise flex_attention runs eagerly (it then materialises scores, test-sized
    inputs only). Attends over rows ``0 .. max(cache_len) + T - 1``. With ``return_block_mask`` also returns
    the block mask (for benchmarks that time its construction separately).
    """
    from torch.nn.attention.flex_attention import create_block_mask

    lens = check_attention_args(q, k_cache, v_cache, cache_len, layout)
    B, T, Hq, D = q.shape
    kv_len = int(lens.max()) + T
    block_mask = create_block_mask(layout.mask_mod(lens), B, None, T, kv_len, device=q.device)
    out = run_flex_attention(q, k_cache, v_cache, block_mask, kv_len, sm_scale=sm_scale, compiled=compiled)
    return (out, block_mask) if return_block_mask else out


def run_flex_attention(q, k_cache, v_cache, block_mask, kv_len, *, sm_scale=None, compiled=False):
    """flex_attention of q ``[B, T, Hq, D]`` over cache rows ``0 .. kv_len - 1`` under a prebuilt block mask."""
    from torch.nn.attention.flex_attention import flex_attention

    fn = torch.compile(flex_attention) if compiled else flex_attention
    qh = q.transpose(1, 2)
    kh = k_cache[:, :kv_len].transpose(1, 2)
    vh = v_cache[:, :kv_len].transpose(1, 2)
    gqa = q.shape[2] != k_cache.shape[2]
    o = fn(qh, kh, vh, block_mask=block_mask, scale=sm_scale, enable_gqa=gqa)
    return o.transpose(1, 2)
