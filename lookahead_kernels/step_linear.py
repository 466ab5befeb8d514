"""A linear layer for a decoding step's few rows on the GPU: ``y[M, N] = x[M, K] @ weight[N, K]^T (+ bias)``.

Why a kernel of our own where cuBLAS is at hand: SmolLM2 in float32 on an H200 (session 46,
``bench/results/linear-nvidia-h200.md``, every linear layer of a step replayed from one graph) ran its one-row
step's products in 0.59 ms (cuBLAS's GEMV) but a 16-row step's in 1.49 ms (its float32 GEMM, 2.5x), the growth of
``t(T)`` that bounds what lookahead gains on that model. This kernel, with the tiles that sweep found best (32
columns, 64 of K, 4 warps, 3 stages), ran the 16-row step's in 1.18 ms and a 64-row step's in 1.40 (cuBLAS 1.68);
at one row it took 1.33 ms and at 128 rows 3.63 (cuBLAS 1.90). So the model takes it for float32 steps of 2 to 64
rows only (:data:`lookahead.cpu_linear.GPU_KERNEL_ROWS`), cuBLAS elsewhere.

Each row is computed alone by the same instructions whatever the other rows (tiles of ``BLOCK_M`` rows, K in the
same order; the configuration depends on the weight only), so a row's result does not depend on the step's size.
Tiles are multiplied as ``tf32x3`` on the tensor cores (each operand split into two tf32 parts: about float32's
accuracy; on the H200 greedy decoding through it matched cuBLAS's tokens on every dev prompt), summed in float32.
float32 only: in bfloat16 at Llama-2-7B's shape the same sweep had it 1.10x slower than cuBLAS at 1 and 16 rows and
1.9-3.2x at 64-128, so the half types were dropped.

:func:`step_linear` checks its inputs (``ValueError``), allocates and launches; it is the torch custom op
``lookahead::step_linear``. On CPU tensors it runs only under Triton's interpreter (``TRITON_INTERPRET=1`` set before
this module is imported). The reference is ``torch.nn.functional.linear`` (in float64 for the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import interpreted, on_device

# Rows per tile: tl.dot's least. A step of 1 row computes a tile of 16 (the extra rows masked): the weight
# tile is read once either way, and the few extra multiply-adds ride on tensor cores that are otherwise idle.
BLOCK_M = 16
# How tiles are multiplied on a GPU (see the module docstring); the interpreter computes "ieee" only.
_FP32_DOT = "tf32x3"


@triton.jit
def _linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                   HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   FP32_DOT: tl.constexpr):
    # Program (m, n): rows m * BLOCK_M.. of output columns n * BLOCK_N..; K in order, BLOCK_K at a time. The row
    # tiles of one column tile are neighbours in the launch order, so they run together and read its weights from
    # HBM once (a 7B weight does not fit in L2 to be read again later).
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    row_ok = rm < M
    col_ok = rn < N
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + rn.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        k_ok = k < K
        x = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_cols + k[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        acc = tl.dot(x, w, acc, input_precision=FP32_DOT)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=col_ok, other=0.0)[None, :]
    y = y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :]
    tl.store(y, acc, mask=row_ok[:, None] & col_ok[None, :])


def tile_config(N: int, K: int) -> tuple[int, int, int, int]:
    """``(BLOCK_N, BLOCK_K, num_warps, num_stages)`` for a weight ``[N, K]``: from the weight alone, never from the
    number of rows, which is what keeps a row's result independent of the step's size. 32 columns and 64 of K a tile
    (less for a narrower K), 4 warps, 3 stages: the best of the H200's sweep over SmolLM2's weights at 16 and 64 rows
    (``bench/results/linear-nvidia-h200.md``)."""
    return 32, min(64, max(16, triton.next_power_of_2(K))), 4, 3


def _launch(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, y2: torch.Tensor,
            config: tuple[int, int, int, int] | None = None) -> None:
    """``y2 [M, N] = x2 [M, K] @ weight.T (+ bias)``, inputs already checked; ``config`` overrides
    :func:`tile_config` (benchmarks compare tile sizes with it)."""
    M, K = x2.shape
    N = weight.shape[0]
    if M == 0 or N == 0:
        return
    if K == 0:
        y2.copy_(bias.expand(M, N) if bias is not None else torch.zeros_like(y2))
        return
    block_n, block_k, warps, stages = config or tile_config(N, K)
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, block_n))
    with on_device(x2):
        _linear_kernel[grid](x2, weight, bias if bias is not None else weight, y2, M, N, K,
                             x2.stride(0), weight.stride(0), y2.stride(0),
                             HAS_BIAS=bias is not None, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
                             FP32_DOT="ieee" if interpreted(_linear_kernel) else _FP32_DOT,
                             num_warps=warps, num_stages=stages)


@torch.library.custom_op("lookahead::step_linear", mutates_args=())
def _linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    K = x.shape[-1]
    x2 = x.reshape(x.shape[:-1].numel(), K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty((*x.shape[:-1], weight.shape[0]), dtype=x.dtype, device=x.device)
    _launch(x2, weight, bias, y.view(-1, weight.shape[0]))
    return y


@_linear_op.register_fake
def _linear_fake(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def step_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)``, each row of ``x`` computed alone: its result is the same bit for bit whatever
    the other rows (and however many) of the call.

    Args:
        x: ``[..., K]`` float32 (any leading shape; rows are copied only where the last dimension is not
            contiguous).
        weight: ``[N, K]`` float32 on ``x``'s device, each row contiguous (``nn.Linear``'s layout).
        bias: optional ``[N]`` float32 on ``x``'s device, contiguous.
    Returns:
        ``[..., N]`` float32; each output one sum over K in order (multiplied as tf32x3 on a GPU, exactly under the
        interpreter).
    Raises:
        ValueError: on another dtype, mismatched shapes, dtypes or devices, or a weight whose rows are not
            contiguous.
    """
    for name, t in (("x", x), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"step_linear: {name} must be a tensor, got {type(t).__name__}")
    if x.dtype != torch.float32:
        raise ValueError(f"step_linear: x must be float32 (the half types lost to cuBLAS), got {x.dtype}")
    if x.dim() < 1 or weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(f"step_linear: x [..., K] and weight [N, K] must agree on K, got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if weight.dtype != x.dtype or weight.device != x.device:
        raise ValueError(f"step_linear: weight must be {x.dtype} on {x.device} like x, got {weight.dtype} on "
                         f"{weight.device}")
    if weight.shape[1] > 1 and weight.stride(1) != 1:
        raise ValueError("step_linear: each row of weight must be contiguous (stride(1) == 1)")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.shape != (weight.shape[0],) or bias.dtype != x.dtype \
                or bias.device != x.device or not bias.is_contiguous():
            got = (bias.dtype, tuple(bias.shape), str(bias.device)) if isinstance(bias, torch.Tensor) else bias
            raise ValueError(f"step_linear: bias must be None or a contiguous [{weight.shape[0]}] {x.dtype} tensor "
                             f"on {x.device}, got {got}")
    if x.device.type != "cuda" and not interpreted(_linear_kernel):
        raise ValueError(f"step_linear: the Triton kernel needs CUDA tensors (or CPU tensors with TRITON_INTERPRET=1 "
                         f"set before lookahead_kernels.step_linear is imported), got {x.device}")
    return _linear_op(x, weight, bias)
