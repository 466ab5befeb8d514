"""Torch references for attention under the lookahead step's visibility rule.

* :func:`attention_torch` is the CPU path of the model and the baseline the kernel must match: it attends
  over the committed prefix with no mask at all and over the step's own ``T`` rows with a small ``[T, T]``
  rule, and merges the two by log-sum-exp. No ``[T, cache_len]`` mask is ever built.
* :func:`attention_dense_reference` is the test oracle: it builds the full dense mask from the same rule and
  runs plain softmax attention (in float64 when asked), so it shares nothing with the fast paths but the rule.
"""

from __future__ import annotations

import math

import torch

from .layout import StepLayout


def check_attention_args(q, k_cache, v_cache, cache_len, layout: StepLayout) -> torch.Tensor:
    """Validate the arguments shared by every attention implementation; returns ``cache_len`` as ``[B]`` int64.

    Raises ``ValueError`` naming what is wrong and what is allowed.
    """
    if not isinstance(layout, StepLayout):
        raise ValueError(f"layout must be a StepLayout, got {type(layout).__name__}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a 4-D tensor, got {shape}")
    B, T, Hq, D = q.shape
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must have one shape")
    Bk, S, Hkv, Dk = k_cache.shape
    if Bk != B or Dk != D:
        raise ValueError(f"k_cache must be [B={B}, S, Hkv, D={D}], got {tuple(k_cache.shape)}")
    if Hq % Hkv != 0:
        raise ValueError(f"query heads ({Hq}) must be a multiple of key/value heads ({Hkv})")
    if T != layout.T:
        raise ValueError(f"q has {T} tokens but the layout {layout} has T={layout.T}")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"q, k_cache, v_cache must share a dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if not (q.device == k_cache.device == v_cache.device):
        raise ValueError(f"q, k_cache, v_cache must be on one device, got {q.device}, {k_cache.device}, {v_cache.device}")
    if B == 0:
        raise ValueError("q has a batch of 0 sequences; at least one is needed")
    if isinstance(cache_len, bool):
        raise ValueError("cache_len must be an int or an integer tensor [B]")
    if isinstance(cache_len, int):
        lens = torch.full((B,), cache_len, dtype=torch.int64)
    elif isinstance(cache_len, torch.Tensor) and not cache_len.is_floating_point() and cache_len.dtype != torch.bool:
        if cache_len.dim() == 0:
            lens = cache_len.reshape(1).expand(B)
        elif cache_len.shape == (B,):
            lens = cache_len
        else:
            raise ValueError(f"cache_len tensor must have shape [B={B}], got {tuple(cache_len.shape)}")
    else:
        raise ValueError(f"cache_len must be an int or an integer tensor [B], got {cache_len!r}")
    # Host-side values are checked before they move; reading a device tensor back would cost a sync.
    if lens.device.type == "cpu":
        if int(lens.min()) < 0:
            raise ValueError(f"cache_len must be >= 0, got {lens.tolist()}")
        if int(lens.max()) + T > S:
            raise ValueError(f"cache too short: cache_len {int(lens.max())} + T {T} > S {S} rows")
    return lens.to(device=q.device, dtype=torch.int64)


def _attend(q, k, v, scale, mask=None):
    """Softmax attention of q ``[B, Hkv, G*T, D]`` over k/v ``[B, Hkv, L, D]``; returns (out, lse)."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    # Both parts are normalised here and re-weighted by exp(lse_part - lse_total) when merged.
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    p = torch.exp(s - safe)
    return torch.matmul(p, v), lse


def attention_torch(q, k_cache, v_cache, *, cache_len, layout: StepLayout, sm_scale=None):
    """Attention for one step, plain torch, without a mask over the prefix.

    Args:
        q: ``[B, T, Hq, D]`` queries (rotary applied), ``T == layout.T``.
        k_cache, v_cache: ``[B, S, Hkv, D]``; the step's keys/values already at rows ``cache_len .. +T-1``.
        cache_len: int or integer tensor ``[B]``: committed rows per sequence.
        layout: the step's :class:`StepLayout`.
        sm_scale: softmax scale, default ``1/sqrt(D)``.
    Returns:
        ``[B, T, Hq, D]`` in ``q``'s dtype. Low-precision inputs are computed in float32.
    """
    lens = check_attention_args(q, k_cache, v_cache, cache_len, layout)
    B, T, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    G = Hq // Hkv
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(D)
    cdtype = q.dtype if q.dtype in (torch.float32, torch.float64) else torch.float32
    idx = torch.arange(T, device=q.device)
    per_row_tree = layout.tree is not None and layout.tree.batched
    shared_mask = None if per_row_tree else layout.visible(idx[:, None], idx[None, :]).repeat(G, 1)  # [G*T, T]
    out = torch.empty_like(q)
    # Sequences with different cache_len (or trees) are handled one by one (this is the CPU path).
    uniform = not per_row_tree and lens.device.type == "cpu" and bool((lens == lens[0]).all())
    groups = [(slice(0, B), int(lens[0]))] if uniform else [(slice(b, b + 1), int(lens[b])) for b in range(B)]
    for rows, n in groups:
        block_mask = shared_mask if shared_mask is not None else \
            layout.visible(idx[:, None], idx[None, :], rows.start).repeat(G, 1)
        qb = q[rows].to(cdtype).permute(0, 2, 1, 3)  # [b, Hq, T, D]
        qb = qb.reshape(qb.shape[0], Hkv, G * T, D)
        ks = k_cache[rows].to(cdtype).permute(0, 2, 1, 3)  # [b, Hkv, S, D]
        vs = v_cache[rows].to(cdtype).permute(0, 2, 1, 3)
        o_blk, lse_blk = _attend(qb, ks[:, :, n:n + T], vs[:, :, n:n + T], scale, block_mask)
        if n > 0:
            o_pre, lse_pre = _attend(qb, ks[:, :, :n], vs[:, :, :n], scale)
            lse = torch.logaddexp(lse_pre, lse_blk)
            o = o_pre * torch.exp(lse_pre - lse) + o_blk * torch.exp(lse_blk - lse)
        else:
            o = o_blk
        o = o.reshape(o.shape[0], Hq, T, D).permute(0, 2, 1, 3)
        out[rows] = o.to(q.dtype)
    return out


def dense_mask(layout: StepLayout, cache_len: int, kv_len: int, device=None, b: int = 0) -> torch.Tensor:
    """BoolTensor ``[T, kv_len]`` of the rule over cache rows for sequence ``b`` (test oracle only)."""
    q_idx = torch.arange(layout.T, device=device)[:, None]
    kv_idx = torch.arange(kv_len, device=device)[None, :]
    mod = layout.mask_mod(torch.full((b + 1,), cache_len, device=device))
    return mod(torch.tensor(b, device=device), None, q_idx, kv_idx)


def attention_dense_reference(q, k_cache, v_cache, *, cache_len, layout: StepLayout, sm_scale=None,
                              dtype=torch.float64):
    """Oracle: dense mask from the rule plus softmax attention in ``dtype`` (float64 by default).

    Same arguments as :func:`attention_torch`; returns ``[B, T, Hq, D]`` in ``dtype``.
    """
    lens = check_attention_args(q, k_cache, v_cache, cache_len, layout)
    B, T, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(D)
    out = torch.empty(B, T, Hq, D, dtype=dtype, device=q.device)
    for b in range(B):
        n = int(lens[b])
        kv = n + T
        mask = dense_mask(layout, n, kv, device=q.device, b=b)  # [T, kv]
        k = k_cache[b, :kv].to(dtype).repeat_interleave(Hq // Hkv, dim=1)  # [kv, Hq, D]
        v = v_cache[b, :kv].to(dtype).repeat_interleave(Hq // Hkv, dim=1)
        s = torch.einsum("thd,khd->htk", q[b].to(dtype), k) * scale
        s = s.masked_fill(~mask[None], float("-inf"))
        out[b] = torch.einsum("htk,khd->thd", torch.softmax(s, dim=-1), v)
    return out
