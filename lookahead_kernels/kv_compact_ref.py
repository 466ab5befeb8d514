"""Torch reference of KV compaction after verification: the rows of each sequence's accepted tree nodes move to the
slots right after its ``x``, in every layer, so the committed prefix stays contiguous. It is what the CPU runs and
the oracle of :mod:`lookahead_kernels.kv_compact`.

Why the copy is safe in place: node ``path[b, j]`` sits at row ``n + offset + path[b, j]`` and goes to ``n + 1 + j``.
Pre-order puts the ``j``-th accepted node at index ``path[b, j] >= j``, and ``offset >= 1``, so a source is never
below its destination and never below any earlier destination: copying in ascending ``j`` (the kernel) and
gathering every source before writing (this reference) give the same cache.
"""

from __future__ import annotations

import torch


def check_compact_inputs(name: str, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_len: torch.Tensor,
                         offset: int, accept_len: torch.Tensor, path: torch.Tensor) -> None:
    """ValueError unless the arguments fit together (shapes, dtypes, devices; values are not read)."""
    if k_cache.dim() != 5 or k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype \
            or k_cache.device != v_cache.device:
        raise ValueError(f"{name}: k_cache and v_cache must both be [L, B, S, Hkv, D] of one dtype and device, got "
                         f"{tuple(k_cache.shape)} {k_cache.dtype} and {tuple(v_cache.shape)} {v_cache.dtype}")
    B = k_cache.shape[1]
    for arg, t, shape in (("cache_len", cache_len, (B,)), ("accept_len", accept_len, (B,))):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or tuple(t.shape) != shape \
                or t.device != k_cache.device:
            desc = (tuple(t.shape), t.dtype, str(t.device)) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name}: {arg} must be int64 {list(shape)} on {k_cache.device}, got {desc}")
    if not isinstance(path, torch.Tensor) or path.dtype != torch.int64 or path.dim() != 2 or path.shape[0] != B \
            or path.device != k_cache.device:
        desc = (tuple(path.shape), path.dtype, str(path.device)) if isinstance(path, torch.Tensor) else type(path).__name__
        raise ValueError(f"{name}: path must be int64 [B={B}, A] on {k_cache.device}, got {desc}")
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 1:
        raise ValueError(f"{name}: offset (the step's rows before its first tree node) must be an int >= 1, got "
                         f"{offset!r}")


def compact_kv_reference(k_cache: torch.Tensor, v_cache: torch.Tensor, cache_len: torch.Tensor, offset: int,
                         accept_len: torch.Tensor, path: torch.Tensor) -> None:
    """In every layer and for each sequence ``b``, copy row ``cache_len[b] + offset + path[b, j]`` to
    ``cache_len[b] + 1 + j`` for ``j < accept_len[b]`` (in place).

    Args:
        k_cache, v_cache: ``[L, B, S, Hkv, D]``, the model's KV cache (any float dtype).
        cache_len: int64 ``[B]``: each sequence's committed length, the slot of its ``x``.
        offset: the step's rows before its first tree node (``StepLayout.lookahead_len``, >= 1).
        accept_len: int64 ``[B]``: accepted nodes per sequence (as verification returns it; clamped to
            ``0 .. A``).
        path: int64 ``[B, A]``: the accepted nodes' indices in the tree, root first (later entries ignored).
    Raises:
        ValueError: on arguments that do not fit together.
    """
    check_compact_inputs("compact_kv_reference", k_cache, v_cache, cache_len, offset, accept_len, path)
    A = path.shape[1]
    if A == 0 or k_cache.shape[1] == 0:
        return
    j = torch.arange(A, device=path.device)
    b, j = (j[None, :] < accept_len[:, None]).nonzero(as_tuple=True)
    if b.numel() == 0:
        return
    src = cache_len[b] + offset + path[b, j]
    dst = cache_len[b] + 1 + j
    for cache in (k_cache, v_cache):
        cache[:, b, dst] = cache[:, b, src]  # advanced indexing gathers a copy before the write
