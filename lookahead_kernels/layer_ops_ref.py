"""Torch references of a decoder layer's element-wise parts: RMSNorm (with and without the residual add before it),
the rotary embedding with the KV cache write, and SwiGLU's gate. They are what the model runs where no kernel
applies, and the oracles of :mod:`lookahead_kernels.layer_ops` (run in float64 for tests).

Rounding follows the Llama reference implementation: RMSNorm normalises in float32 and rounds to the input dtype
before the weight; every other product and sum is one torch op on the input dtype (computed in float32 and
rounded, for half types).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / sqrt(mean(x^2) + eps))`` over the last dimension of ``x [..., N]``; ``weight [N]``."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:  # one fused op, the same formula
        return F.rms_norm(x, weight.shape, weight, eps)
    if x.dtype == torch.float64:
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, rms_norm(s))`` with ``s = x + residual``: a layer's residual add and the next RMSNorm."""
    s = x + residual
    return s, rms_norm_reference(s, weight, eps)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [B, T, H, D]`` by ``cos, sin [B, T, D]`` (rotate-half convention)."""
    return x * cos[:, :, None] + rotate_half(x) * sin[:, :, None]


def write_rows(cache: torch.Tensor, cache_len, rows: torch.Tensor) -> None:
    """``cache[b, cache_len[b] + t] = rows[b, t]`` for a layer's cache ``[B, S, Hkv, D]`` and ``rows [B, T, Hkv,
    D]``; ``cache_len`` an int or an integer tensor ``[B]`` (bounds are the caller's)."""
    B, T = rows.shape[:2]
    if isinstance(cache_len, int):
        cache[:, cache_len:cache_len + T] = rows
        return
    slots = cache_len.to(device=cache.device, dtype=torch.long)[:, None] + torch.arange(T, device=cache.device)
    cache[torch.arange(B, device=cache.device)[:, None], slots] = rows


def head_norms(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, q_norm: torch.Tensor,
               k_norm: torch.Tensor, eps: float) -> torch.Tensor:
    """``qkv [B, T, Hq + 2 Hkv, D]`` with each q head and each k head RMS-normalised over ``D`` and scaled by
    ``q_norm`` / ``k_norm [D]`` (Qwen3's norms, before the rotary embedding); v as it is."""
    q, k, v = qkv.split((num_heads, num_kv_heads, num_kv_heads), dim=2)
    return torch.cat((rms_norm_reference(q, q_norm, eps), rms_norm_reference(k, k_norm, eps), v), dim=2)


def rotary_cache_write_reference(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                                 v_cache: torch.Tensor, cache_len, num_heads: int, num_kv_heads: int,
                                 q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                                 eps: float = 1e-6, rotate: bool = True) -> torch.Tensor:
    """Rotate the q and k heads of ``qkv [B, T, Hq + 2 Hkv, D]`` (q heads, then k, then v; each q and k head first
    normalised by :func:`head_norms` where ``q_norm`` and ``k_norm`` are given; not rotated with ``rotate=False``),
    write k and v to the layer's caches ``[B, S, Hkv, D]`` at rows ``cache_len[b] ..``; returns q ``[B, T, Hq,
    D]``."""
    Hq, Hkv = num_heads, num_kv_heads
    if q_norm is not None:
        qkv = head_norms(qkv, Hq, Hkv, q_norm, k_norm, eps)
    qk = qkv[:, :, :Hq + Hkv]
    if rotate:
        qk = apply_rotary(qk, cos, sin)  # q and k heads rotated together: one op chain
    q, k = qk.split((Hq, Hkv), dim=2)
    write_rows(k_cache, cache_len, k)
    write_rows(v_cache, cache_len, qkv[:, :, Hq + Hkv:])
    return q


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gate: ``silu(gate) * up`` for ``gate_up [..., 2 I]`` (gate first); returns ``[..., I]``."""
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    return F.silu(gate) * up
