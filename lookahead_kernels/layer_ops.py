"""Triton kernels for a decoder layer's element-wise parts on the GPU, each one launch where torch takes several:

* :func:`rms_norm` and :func:`add_rms_norm` (the residual add and the next RMSNorm): torch's bfloat16 path is seven
  kernels (cast, square, mean, add, rsqrt, multiply, cast and weight);
* :func:`rotary_cache_write`: the q and k heads rotated (not in SmolLM3's layers without RoPE) and k, v written to
  the KV cache at each sequence's ``cache_len`` (torch: negate, concatenate, two products, a sum, two indexed writes
  and their index tensors), each q and k head RMS-normalised first where the model has such norms (Qwen3: two
  copies, two norms and a concatenation more in torch);
* :func:`silu_mul`: SwiGLU's ``silu(gate) * up`` (torch: two).

Why: a decoding step reads each weight once and does little else, so on a GPU its time beyond reading the weights
is mostly kernels that each cost a few microseconds however little they do; a Llama-2-7B step replayed from a CUDA
graph ran ~800 of them (an H100 reached 60-63% of its copy bandwidth, `bench/results/gpu-h100.md`). These cut a
layer's ~25 element-wise kernels to 4.

Each kernel works on one row (a token) at a time and in a fixed order, so a row's result does not depend on the
rows beside it; rounding follows :mod:`lookahead_kernels.layer_ops_ref` (the references and the CPU path). Each
launcher checks its inputs (``ValueError``), allocates and launches; each is a torch custom op
(``lookahead::rms_norm``, ``add_rms_norm``, ``rotary_cache_write``, ``silu_mul``) so graphs and compilers see one op.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import on_device

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ---------------------------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------------------------
@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, s_ptr, y_ptr, N, stride_x, stride_r, stride_s, stride_y, eps,
                     HAS_RESIDUAL: tl.constexpr, ROUND: tl.constexpr, BLOCK: tl.constexpr):
    # One row: s = x + r (rounded to the dtype, as torch's add), y = w * round(s / rms(s)) or, float32, w * s / rms.
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(s_ptr + row * stride_s + offs, x, mask=mask)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / N + eps)
    h = xf * inv
    if ROUND:
        h = h.to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + offs, (w * h).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _head_norm(v, inv, w, ROUND: tl.constexpr, dtype: tl.constexpr):
    # weight * (v * inv), each product rounded to the dtype where the reference rounds it (rms_norm_reference)
    n = v * inv
    if ROUND:
        n = n.to(dtype).to(tl.float32)
    n = w * n
    if ROUND:
        n = n.to(dtype).to(tl.float32)
    return n


@triton.jit(do_not_specialize=["start"])
def _rotary_cache_kernel(x_ptr, cos_ptr, sin_ptr, len_ptr, q_ptr, k_ptr, v_ptr, qn_ptr, kn_ptr,
                         T, Hq, Hkv, start, stride_xm, stride_xh, stride_cm, stride_qm, stride_qh,
                         stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, eps,
                         HALF: tl.constexpr, BLOCK_D: tl.constexpr, ROUND: tl.constexpr, PER_ROW: tl.constexpr,
                         QK_NORM: tl.constexpr, ROTATE: tl.constexpr):
    # Program (m, h): head h of row m = b * T + t; q heads to q, k heads rotated and v heads as they are to the
    # caches at row cache_len[b] + t (PER_ROW: read from len_ptr on the device) or start + t. QK_NORM: each q and
    # k head RMS-normalised (weights qn_ptr, kn_ptr [D]) before its rotation; ROTATE False: q and k not rotated.
    m = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    b = m // T
    t = m % T
    offs = tl.arange(0, BLOCK_D)
    mask = offs < 2 * HALF
    src = x_ptr + m * stride_xm + h * stride_xh
    x = tl.load(src + offs, mask=mask, other=0.0)
    if h < Hq + Hkv:
        first = offs < HALF
        twin = tl.where(first, offs + HALF, offs - HALF)
        partner = tl.load(src + twin, mask=mask, other=0.0).to(tl.float32)
        if QK_NORM:
            xf = x.to(tl.float32)
            inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / (2 * HALF) + eps)
            if h < Hq:
                w = tl.load(qn_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                w_twin = tl.load(qn_ptr + twin, mask=mask, other=0.0).to(tl.float32)
            else:
                w = tl.load(kn_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                w_twin = tl.load(kn_ptr + twin, mask=mask, other=0.0).to(tl.float32)
            x = _head_norm(xf, inv, w, ROUND, x_ptr.dtype.element_ty).to(x_ptr.dtype.element_ty)
            partner = _head_norm(partner, inv, w_twin, ROUND, x_ptr.dtype.element_ty)
        if ROTATE:
            partner = tl.where(first, -partner, partner)
            c = tl.load(cos_ptr + m * stride_cm + offs, mask=mask, other=0.0).to(tl.float32)
            s = tl.load(sin_ptr + m * stride_cm + offs, mask=mask, other=0.0).to(tl.float32)
            a = x.to(tl.float32) * c
            p = partner * s
            if ROUND:  # x * cos and rotate_half(x) * sin are separate ops of the dtype in the reference
                a = a.to(x_ptr.dtype.element_ty).to(tl.float32)
                p = p.to(x_ptr.dtype.element_ty).to(tl.float32)
            y = (a + p).to(x_ptr.dtype.element_ty)
        else:  # a layer without rotary embedding (SmolLM3's every fourth)
            y = x
        if h < Hq:
            tl.store(q_ptr + m * stride_qm + h * stride_qh + offs, y, mask=mask)
        else:
            slot = (tl.load(len_ptr + b) if PER_ROW else start) + t
            tl.store(k_ptr + b * stride_kb + slot * stride_ks + (h - Hq) * stride_kh + offs, y, mask=mask)
    else:
        slot = (tl.load(len_ptr + b) if PER_ROW else start) + t
        tl.store(v_ptr + b * stride_vb + slot * stride_vs + (h - Hq - Hkv) * stride_vh + offs, x, mask=mask)


@triton.jit
def _silu_mul_kernel(x_ptr, y_ptr, I, stride_x, stride_y, ROUND: tl.constexpr, BLOCK: tl.constexpr):
    # Program (m, j): columns [j * BLOCK, (j + 1) * BLOCK) of row m; gate is x[m, :I], up is x[m, I:].
    m = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    g = tl.load(x_ptr + m * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + m * stride_x + I + offs, mask=mask, other=0.0).to(tl.float32)
    s = g / (1.0 + tl.exp(-g))
    if ROUND:  # silu and the product are separate ops of the dtype in the reference
        s = s.to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(y_ptr + m * stride_y + offs, (s * u).to(y_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------------------------
def _rows(x: torch.Tensor, name: str) -> torch.Tensor:
    """``x`` as ``[M, N]`` rows with a contiguous last dimension (a view where possible)."""
    if x.dtype not in _DTYPES:
        raise ValueError(f"{name} must be float32, float16 or bfloat16, got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"{name} must have a non-empty last dimension, got shape {tuple(x.shape)}")
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _norm_warps(block: int) -> int:
    return 4 if block <= 2048 else 8 if block <= 8192 else 16


def _check_norm(x, weight, eps):
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1] or weight.dtype != x.dtype \
            or weight.device != x.device:
        raise ValueError(f"weight must be [{x.shape[-1]}] {x.dtype} on {x.device}, got {tuple(weight.shape)} "
                         f"{weight.dtype} on {weight.device}")
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps!r}")


def _launch_norm(x, residual, weight, eps, s, y):
    x2, w = _rows(x, "x"), weight.contiguous()
    M, N = x2.shape
    r2 = x2 if residual is None else _rows(residual, "residual")
    s2 = y.view(M, N) if s is None else s.view(M, N)
    block = triton.next_power_of_2(N)
    if M:
        with on_device(x):
            _rms_norm_kernel[(M,)](x2, r2, w, s2, y.view(M, N), N, x2.stride(0), r2.stride(0), s2.stride(0),
                                   N, float(eps), HAS_RESIDUAL=residual is not None,
                                   ROUND=x.dtype != torch.float32, BLOCK=block, num_warps=_norm_warps(block))


@torch.library.custom_op("lookahead::rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch_norm(x, None, weight, eps, None, y)
    return y


@_rms_norm_op.register_fake
def _rms_norm_fake(x, weight, eps):
    return torch.empty_like(x)


@torch.library.custom_op("lookahead::add_rms_norm", mutates_args=())
def _add_rms_norm_op(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    s = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch_norm(x, residual, weight, eps, s, y)
    return s, y


@_add_rms_norm_op.register_fake
def _add_rms_norm_fake(x, residual, weight, eps):
    return torch.empty_like(x), torch.empty_like(x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, as :func:`~lookahead_kernels.layer_ops_ref.rms_norm_reference`.

    Args:
        x: ``[..., N]`` float32, float16 or bfloat16.
        weight: ``[N]``, ``x``'s dtype and device.
        eps: > 0.
    Returns:
        ``[..., N]`` in ``x``'s dtype.
    Raises:
        ValueError: on another dtype, a weight of the wrong size, dtype or device, or ``eps <= 0``.
    """
    _rows(x, "x")
    _check_norm(x, weight, eps)
    return _rms_norm_op(x, weight, float(eps))


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, rms_norm(s))`` with ``s = x + residual`` in one pass, as
    :func:`~lookahead_kernels.layer_ops_ref.add_rms_norm_reference`.

    Args:
        x, residual: ``[..., N]``, the same shape, dtype (float32, float16 or bfloat16) and device.
        weight: ``[N]``, their dtype and device.
        eps: > 0.
    Returns:
        ``s`` and the normalised ``s``, both ``[..., N]`` in ``x``'s dtype.
    Raises:
        ValueError: on mismatched shapes, dtypes or devices, or ``eps <= 0``.
    """
    _rows(x, "x")
    if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
        raise ValueError(f"residual must match x ({tuple(x.shape)} {x.dtype} on {x.device}), got "
                         f"{tuple(residual.shape)} {residual.dtype} on {residual.device}")
    _check_norm(x, weight, eps)
    return _add_rms_norm_op(x, residual, weight, float(eps))


@torch.library.custom_op("lookahead::rotary_cache_write", mutates_args=("k_cache", "v_cache"))
def _rotary_cache_op(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, cache_len: torch.Tensor | None, start: int, num_heads: int,
                     num_kv_heads: int, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
                     eps: float, rotate: bool) -> torch.Tensor:
    B, T, H, D = qkv.shape
    q = torch.empty((B, T, num_heads, D), dtype=qkv.dtype, device=qkv.device)
    M = B * T
    if M:
        x = qkv.reshape(M, H, D)
        c, s = cos.reshape(M, D), sin.reshape(M, D)
        with on_device(qkv):
            _rotary_cache_kernel[(M, H)](
                x, c, s, q if cache_len is None else cache_len, q, k_cache, v_cache,
                q if q_norm is None else q_norm, q if k_norm is None else k_norm, T, num_heads, num_kv_heads,
                start,
                x.stride(0), x.stride(1), c.stride(0), q.stride(1), q.stride(2),
                *k_cache.stride()[:3], *v_cache.stride()[:3], eps,
                HALF=D // 2, BLOCK_D=triton.next_power_of_2(D), ROUND=qkv.dtype != torch.float32,
                PER_ROW=cache_len is not None, QK_NORM=q_norm is not None, ROTATE=rotate,
                num_warps=1 if D <= 128 else 2)
    return q


@_rotary_cache_op.register_fake
def _rotary_cache_fake(qkv, cos, sin, k_cache, v_cache, cache_len, start, num_heads, num_kv_heads, q_norm, k_norm,
                       eps, rotate):
    B, T, _, D = qkv.shape
    return qkv.new_empty((B, T, num_heads, D))


def rotary_cache_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, cache_len, num_heads: int, num_kv_heads: int,
                       q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                       eps: float = 1e-6, rotate: bool = True) -> torch.Tensor:
    """Rotary embedding of the q and k heads and the KV cache write of one layer, as
    :func:`~lookahead_kernels.layer_ops_ref.rotary_cache_write_reference`.

    Args:
        qkv: ``[B, T, Hq + 2 Hkv, D]`` (q heads, then k, then v; ``D`` even), last two dimensions contiguous.
        cos, sin: ``[B, T, D]`` in ``qkv``'s dtype.
        k_cache, v_cache: the layer's ``[B, S, Hkv, D]``, last dimension contiguous; rows ``cache_len[b] ..
            cache_len[b] + T - 1`` are written (bounds are the caller's: on a GPU they are not read back).
        cache_len: an int (every sequence's), or an integer tensor ``[B]`` on ``qkv``'s device (read there: a
            CUDA graph replays it).
        num_heads, num_kv_heads: ``Hq`` and ``Hkv``.
        q_norm, k_norm: ``[D]`` in ``qkv``'s dtype, both or neither: each q head and each k head is RMS-normalised
            over ``D`` (epsilon ``eps``) and scaled by these before its rotation (Qwen3); None: no norm.
        rotate: False for a layer without rotary embedding (SmolLM3's every fourth): q and k written as they are
            (``cos`` and ``sin`` still checked, not read).
    Returns:
        the rotated q, ``[B, T, Hq, D]`` contiguous.
    Raises:
        ValueError: on shapes, dtypes or devices that do not fit together.
    """
    if qkv.dim() != 4 or qkv.dtype not in _DTYPES or qkv.shape[-1] % 2 or qkv.shape[-1] == 0 \
            or qkv.shape[2] != num_heads + 2 * num_kv_heads or num_heads < 1 or num_kv_heads < 1:
        raise ValueError(f"qkv must be [B, T, Hq + 2 Hkv = {num_heads + 2 * num_kv_heads}, D] float32/float16/"
                         f"bfloat16 with an even D, got {tuple(qkv.shape)} {qkv.dtype}")
    B, T, _, D = qkv.shape
    if qkv.stride(3) != 1 or qkv.stride(2) != D:
        raise ValueError("qkv's last two dimensions must be contiguous (a view of the q/k/v projection's output)")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape != (B, T, D) or t.dtype != qkv.dtype or t.device != qkv.device:
            raise ValueError(f"{name} must be [{B}, {T}, {D}] {qkv.dtype} on {qkv.device}, got {tuple(t.shape)} "
                             f"{t.dtype} on {t.device}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dim() != 4 or t.shape[0] != B or t.shape[2:] != (num_kv_heads, D) or t.dtype != qkv.dtype \
                or t.device != qkv.device or t.stride(3) != 1:
            raise ValueError(f"{name} must be [{B}, S, {num_kv_heads}, {D}] {qkv.dtype} on {qkv.device} with a "
                             f"contiguous last dimension, got {tuple(t.shape)} {t.dtype} on {t.device}")
    if isinstance(cache_len, int) and not isinstance(cache_len, bool):
        if cache_len < 0:
            raise ValueError(f"cache_len must be >= 0, got {cache_len}")
        lens, start = None, cache_len
    elif isinstance(cache_len, torch.Tensor) and cache_len.shape == (B,) \
            and cache_len.dtype in (torch.int32, torch.int64) and cache_len.device == qkv.device:
        lens, start = cache_len, 0
    else:
        desc = (tuple(cache_len.shape), cache_len.dtype, str(cache_len.device)) if isinstance(cache_len, torch.Tensor) \
            else repr(cache_len)
        raise ValueError(f"cache_len must be an int or an integer tensor [{B}] on {qkv.device}, got {desc}")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm must both be given or both be None")
    if q_norm is not None:
        for name, t in (("q_norm", q_norm), ("k_norm", k_norm)):
            if not isinstance(t, torch.Tensor) or t.shape != (D,) or t.dtype != qkv.dtype or t.device != qkv.device:
                desc = (tuple(t.shape), t.dtype, str(t.device)) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{name} must be [{D}] {qkv.dtype} on {qkv.device}, got {desc}")
        if not eps > 0:
            raise ValueError(f"eps must be > 0, got {eps!r}")
        q_norm, k_norm = q_norm.contiguous(), k_norm.contiguous()
    return _rotary_cache_op(qkv, cos.contiguous(), sin.contiguous(), k_cache, v_cache, lens, start, num_heads,
                            num_kv_heads, q_norm, k_norm, float(eps), bool(rotate))


_SILU_BLOCK = 1024


@torch.library.custom_op("lookahead::silu_mul", mutates_args=())
def _silu_mul_op(gate_up: torch.Tensor) -> torch.Tensor:
    I = gate_up.shape[-1] // 2
    y = torch.empty((*gate_up.shape[:-1], I), dtype=gate_up.dtype, device=gate_up.device)
    x = _rows(gate_up, "gate_up")
    M = x.shape[0]
    if M:
        block = min(_SILU_BLOCK, triton.next_power_of_2(I))
        with on_device(gate_up):
            _silu_mul_kernel[(M, triton.cdiv(I, block))](x, y.view(M, I), I, x.stride(0), I,
                                                        ROUND=gate_up.dtype != torch.float32, BLOCK=block,
                                                        num_warps=4)
    return y


@_silu_mul_op.register_fake
def _silu_mul_fake(gate_up):
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's ``silu(gate) * up``, as :func:`~lookahead_kernels.layer_ops_ref.silu_mul_reference`.

    Args:
        gate_up: ``[..., 2 I]`` float32, float16 or bfloat16, the gate columns first.
    Returns:
        ``[..., I]`` in ``gate_up``'s dtype.
    Raises:
        ValueError: on another dtype or an odd last dimension.
    """
    _rows(gate_up, "gate_up")
    if gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up's last dimension must be even (gate, then up), got {gate_up.shape[-1]}")
    return _silu_mul_op(gate_up)
