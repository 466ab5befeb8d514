"""KV compaction on the GPU: one launch that moves each sequence's accepted tree nodes' keys and values to the
slots after its ``x``, in every layer, reading the accepted path where verification wrote it (on the device).

Why a kernel: done with torch, compaction needs the accepted path on the host (a read-back before the copy) and
about eight launches for the index tensors, the gathers and the writes, all of them between two CUDA graph
replays; reading the path on the device lets the copy join the step's graph, and copying only accepted rows keeps
its traffic to what moves (a static graph cannot size a torch copy by the accepted length).

Exactly :func:`lookahead_kernels.kv_compact_ref.compact_kv_reference` (a copy, bit for bit). The launcher checks
its inputs (``ValueError``) and launches; the op is the torch custom op ``lookahead::compact_kv``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kv_compact_ref import check_compact_inputs
from .launch import on_device

_MAX_BLOCK = 1024


@triton.jit
def _copy_rows(base, len_ptr, acc_ptr, path_ptr, b, offset, A, ROW, stride_s, stride_pb, BLOCK: tl.constexpr):
    n = tl.load(len_ptr + b)
    a = tl.minimum(tl.maximum(tl.load(acc_ptr + b), 0), A)
    offs = tl.arange(0, BLOCK)
    for j in range(0, a):
        node = tl.load(path_ptr + b * stride_pb + j)
        src = base + (n + offset + node) * stride_s
        dst = base + (n + 1 + j) * stride_s
        for c in range(0, ROW, BLOCK):
            mask = c + offs < ROW
            tl.store(dst + c + offs, tl.load(src + c + offs, mask=mask), mask=mask)
        # A later destination may be this step's source row (never the reverse): keep the steps in order.
        tl.debug_barrier()


@triton.jit
def _compact_kv_kernel(k_ptr, v_ptr, len_ptr, acc_ptr, path_ptr, offset, A, ROW,
                       stride_kl, stride_kb, stride_ks, stride_vl, stride_vb, stride_vs, stride_pb,
                       BLOCK: tl.constexpr):
    # Program (b, 2 l + c): sequence b, layer l, keys (c = 0) or values (c = 1).
    b = tl.program_id(0).to(tl.int64)
    lc = tl.program_id(1)
    layer = (lc // 2).to(tl.int64)
    if lc % 2 == 0:
        _copy_rows(k_ptr + layer * stride_kl + b * stride_kb, len_ptr, acc_ptr, path_ptr, b, offset, A, ROW,
                   stride_ks, stride_pb, BLOCK)
    else:
        _copy_rows(v_ptr + layer * stride_vl + b * stride_vb, len_ptr, acc_ptr, path_ptr, b, offset, A, ROW,
                   stride_vs, stride_pb, BLOCK)


@torch.library.custom_op("lookahead::compact_kv", mutates_args=("k_cache", "v_cache"))
def _compact_kv_op(k_cache: torch.Tensor, v_cache: torch.Tensor, cache_len: torch.Tensor, offset: int,
                   accept_len: torch.Tensor, path: torch.Tensor) -> None:
    L, B, _, H, D = k_cache.shape
    A = path.shape[1]
    if L == 0 or B == 0 or A == 0 or H * D == 0:
        return
    row = H * D
    block = min(triton.next_power_of_2(row), _MAX_BLOCK)
    with on_device(k_cache):
        _compact_kv_kernel[(B, 2 * L)](
            k_cache, v_cache, cache_len, accept_len, path, offset, A, row,
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), path.stride(0),
            BLOCK=block, num_warps=max(1, min(4, block // 256)))


@_compact_kv_op.register_fake
def _(k_cache, v_cache, cache_len, offset, accept_len, path):
    return None


def compact_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, cache_len: torch.Tensor, offset: int,
               accept_len: torch.Tensor, path: torch.Tensor) -> None:
    """KV compaction in place, as :func:`~lookahead_kernels.kv_compact_ref.compact_kv_reference` (see it for the
    arguments): ``k_cache, v_cache [L, B, S, Hkv, D]`` with each row's ``Hkv x D`` contiguous; ``cache_len``,
    ``accept_len`` int64 ``[B]`` and ``path`` int64 ``[B, A]`` on the caches' device, read there (no host
    synchronisation: a CUDA graph can hold the call). Row bounds are the caller's: the destinations lie in the
    step's own rows. One launch of ``B x 2L`` programs, each copying only its accepted rows.

    Raises:
        ValueError: on arguments that do not fit together, or rows that are not contiguous.
    """
    check_compact_inputs("compact_kv", k_cache, v_cache, cache_len, offset, accept_len, path)
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.stride(4) != 1 or cache.stride(3) != cache.shape[4]:
            raise ValueError(f"compact_kv: {name}'s last two dimensions (Hkv, D) must be contiguous, got strides "
                             f"{cache.stride()}")
    _compact_kv_op(k_cache, v_cache, cache_len.contiguous(), offset, accept_len.contiguous(), path.contiguous())
