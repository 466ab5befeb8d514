"""A candidate float32 product for steps of 1-16 rows on a GPU, K in one run: timed against the model's kernel
(``lookahead_kernels.step_linear``) and cuBLAS by ``bench/gpu_profile.py smolgemv`` (and ``smolstack``), not used by
the model.

Why: in float32 on the H200 (session 57, ``bench/results/gpu-logs-4a84d54/stack.log``) SmolLM2's 121 products a step
took 0.604 ms at one row through cuBLAS's GEMV and 0.70-0.73 ms at 2-16 rows through our split kernel, whatever the
row count: the step of 17 tokens pays about 0.12 ms more for its products than the step of one, which is most of
what keeps ``t(17) / t(1)`` at 1.14 and MT-Bench's predicted 1.74x short of issue 11's 1.8x. With its weights in L2
(``smollinear``) the split kernel still took 1.1-2.6 us a product more than the GEMV: its second phase (each split's
sum stored, an atomic count, the last split reading them all back) costs round trips the GEMV does not make. At 1-16
rows the multiply-adds are nothing (16 x 576 x 576 for ``o``), so this kernel does what a GEMV does for 16 vectors
at once: each program takes ``BLOCK_N`` output columns over the whole of K, ``BLOCK_K`` at a time, every row's
products summed in registers (no tensor cores, no workspace, no second phase; float32 multiply-adds, as exact as
cuBLAS's). What it may lose: each program reads the rows of ``x`` again (from L2: ``16 / BLOCK_N`` bytes of ``x``
for each byte of weight), and narrow column tiles make many programs. Unmeasured on a GPU when written (session
74): the next lease's ``profile`` part times it.

Each row is computed alone by the same instructions whatever the other rows (a tile of 16 rows, the rows past ``M``
masked), so a row's result does not depend on the other rows of a 1-16 row call, as the model's kernel promises.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lookahead_kernels.launch import interpreted, on_device

ROWS = 16  # a call's rows at most: one tile
# (BLOCK_N, BLOCK_K, num_warps, num_stages) to time: column tiles of 4-16 and K tiles of 64-128, so that the product
# tile [16, BLOCK_N, BLOCK_K] stays at 64 registers a thread.
CONFIGS = {"gemv bn4 bk128": (4, 128, 4, 4), "gemv bn8 bk64": (8, 64, 4, 4), "gemv bn8 bk128 w8": (8, 128, 8, 3),
           "gemv bn16 bk64 w8": (16, 64, 8, 3)}
DEFAULT = "gemv bn8 bk64"  # where nothing was timed


@triton.jit
def _rows_gemv_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # Program n: output columns n * BLOCK_N.. of every row, over K in order, BLOCK_K at a time.
    pid_n = tl.program_id(0)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    row_ok = rm < M
    col_ok = rn < N
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        k_ok = k < K
        x = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        w = tl.load(w_rows + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    y = y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :]
    tl.store(y, acc, mask=row_ok[:, None] & col_ok[None, :])


def rows_gemv(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None,
              config: tuple[int, int, int, int] = CONFIGS[DEFAULT]) -> torch.Tensor:
    """``x @ weight.T`` for ``x`` float32 ``[M, K]`` (``1 <= M <= 16``, rows contiguous) and ``weight`` float32
    ``[N, K]`` (rows contiguous) on one device (CUDA, or the CPU under ``TRITON_INTERPRET=1``), into ``out``
    (float32 ``[M, N]``, rows contiguous; made where None). ``config``: ``(BLOCK_N, BLOCK_K, num_warps,
    num_stages)``. Raises ``ValueError`` on anything else."""
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or x.dim() != 2 or weight.dim() != 2 \
            or x.shape[1] != weight.shape[1] or not 1 <= x.shape[0] <= ROWS or x.device != weight.device:
        raise ValueError(f"rows_gemv: x float32 [1-{ROWS}, K] and weight float32 [N, K] on one device, got "
                         f"{x.dtype} {tuple(x.shape)} on {x.device} and {weight.dtype} {tuple(weight.shape)} on "
                         f"{weight.device}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("rows_gemv: the rows of x and weight must be contiguous")
    if x.device.type != "cuda" and not interpreted(_rows_gemv_kernel):
        raise ValueError("rows_gemv: needs CUDA tensors (or TRITON_INTERPRET=1 set before this module is imported)")
    M, K = x.shape
    N = weight.shape[0]
    if out is None:
        out = torch.empty(M, N, dtype=torch.float32, device=x.device)
    elif out.shape != (M, N) or out.dtype != torch.float32 or out.device != x.device or out.stride(1) != 1:
        raise ValueError(f"rows_gemv: out must be float32 [{M}, {N}] on {x.device}, rows contiguous")
    block_n, block_k, warps, stages = config
    with on_device(x):
        _rows_gemv_kernel[(triton.cdiv(N, block_n),)](x, weight, out, M, N, K, x.stride(0), weight.stride(0),
                                                      out.stride(0), BLOCK_M=ROWS, BLOCK_N=block_n, BLOCK_K=block_k,
                                                      num_warps=warps, num_stages=stages)
    return out


def candidate_runs(xs: dict, weights: list[torch.Tensor], outs: list[torch.Tensor]) -> dict:
    """One callable per configuration of :data:`CONFIGS`, each running ``rows_gemv`` over every weight (``xs``:
    ``x`` by K; ``outs``: one output a weight): what ``gpu_e2e.fastest_gemv`` and ``gpu_profile.py smolgemv``
    time."""
    return {name: (lambda config=config: [rows_gemv(xs[w.shape[1]], w, y, config) for w, y in zip(weights, outs)])
            for name, config in CONFIGS.items()}
