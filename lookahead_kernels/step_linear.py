"""A linear layer for a decoding step's few rows on the GPU: ``y[M, N] = x[M, K] @ weight[N, K]^T (+ bias)``.

Why a kernel of our own where cuBLAS is at hand: SmolLM2 in float32 on an H200 (session 46,
``bench/results/linear-nvidia-h200.md``, every linear layer of a step replayed from one graph) ran its one-row
step's products in 0.59 ms (cuBLAS's GEMV) but a 16-row step's in 1.49 ms (its float32 GEMM, 2.5x), the growth of
``t(T)`` that bounds what lookahead gains on that model. This kernel, with the tiles that sweep found best (32
columns, 64 of K, 4 warps, 3 stages), ran the 16-row step's in 1.18 ms and a 64-row step's in 1.40 (cuBLAS 1.68);
at one row it took 1.33 ms and at 128 rows 3.63 (cuBLAS 1.90). So the model took it for float32 steps of 2 to 64
rows only, cuBLAS elsewhere, until the taller tiles below (:data:`lookahead.cpu_linear.GPU_KERNEL_ROWS`).

Those times are a tenth of the H200's bandwidth: SmolLM2's narrow weights (576 to 3072 columns) give 18 to 96
column tiles, each program's K loop one load after another, too few loads in flight. So K is split (session 48,
:func:`tile_config`: about 256 programs a row tile): each split's sum goes to a workspace and the last split of a
tile to finish adds them, in split order, counted by an atomic counter per tile (one launch, no fill, no reduction
kernel). Not yet timed on a GPU when written: ``bench/gpu_profile.py smolstack`` times it against cuBLAS and the
unsplit kernel.

Steps of more rows (a batch's trees) take taller row tiles (session 57, :func:`rows_config`): 64 rows a tile,
multiplied on sm_90's wgmma, reading each weight tile once for 64 rows, K split to about 64 programs a row tile. A
step's products on the H200 (``bench/results/gpu-h200-s57.md``, ``stack``): 1.29 ms at 64 rows (16-row tiles 1.40,
cuBLAS 1.68), 1.56 at 128 (cuBLAS 1.93) and 2.01 at 256 (cuBLAS 2.72); so the model takes the kernel for float32
steps of 2 to 256 rows.

Each row is computed alone by the same instructions whatever the other rows (tiles of ``BLOCK_M`` rows, K in the
same order and split the same way), so a row's result does not depend on the other rows, nor on the step's size
within each of the two ranges of rows (1-32, 33 or more) whose tiles :func:`rows_config` gives.
Tiles are multiplied as ``tf32x3`` on the tensor cores (each operand split into two tf32 parts: about float32's
accuracy; on the H200 greedy decoding through it matched cuBLAS's tokens on every dev prompt), summed in float32.
float32 only: in bfloat16 at Llama-2-7B's shape the same sweep had it 1.10x slower than cuBLAS at 1 and 16 rows and
1.9-3.2x at 64-128, so the half types were dropped.

:func:`step_linear` checks its inputs (``ValueError``), allocates and launches; it is the torch custom op
``lookahead::step_linear``. On CPU tensors it runs only under Triton's interpreter (``TRITON_INTERPRET=1`` set before
this module is imported). The reference is ``torch.nn.functional.linear`` (in float64 for the tests).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .launch import interpreted, on_device

# Rows per tile: tl.dot's least. A step of 1 row computes a tile of 16 (the extra rows masked): the weight
# tile is read once either way, and the few extra multiply-adds ride on tensor cores that are otherwise idle.
BLOCK_M = 16
# How tiles are multiplied on a GPU (see the module docstring); the interpreter computes "ieee" only.
_FP32_DOT = "tf32x3"
# Programs a row tile aims at when K is split (:func:`tile_config`): about two for each of an H100's or H200's 132
# SMs.
TARGET_PROGRAMS = 256
# Steps of this many rows or more take taller row tiles (:func:`rows_config`): rows a tile, K tile, programs a row
# tile; the best of the H200's sweep at 64-256 rows (bench/results/gpu-h200-s57.md, `stack`).
TALL_FROM_ROWS = 33
TALL_BLOCK_M, TALL_BLOCK_K, TALL_TARGET_PROGRAMS = 64, 32, 64


@triton.jit
def _linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, count_ptr, M, N, K, K_PER_SPLIT, stride_xm, stride_wn,
                   stride_ym, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, FP32_DOT: tl.constexpr):
    # Program (m, n, s): rows m * BLOCK_M.. of output columns n * BLOCK_N.., over split s of K (K_PER_SPLIT, a
    # multiple of BLOCK_K) in order, BLOCK_K at a time. The row tiles of one column tile are neighbours in the
    # launch order, so they run together and read its weights from HBM once.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    row_ok = rm < M
    col_ok = rn < N
    out_ok = row_ok[:, None] & col_ok[None, :]
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + rn.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_lo = pid_s * K_PER_SPLIT
    for k0 in range(k_lo, tl.minimum(k_lo + K_PER_SPLIT, K), BLOCK_K):
        k = k0 + rk
        k_ok = k < K
        x = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_cols + k[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        acc = tl.dot(x, w, acc, input_precision=FP32_DOT)
    y = y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :]
    if SPLIT == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=col_ok, other=0.0)[None, :]
        tl.store(y, acc, mask=out_ok)
    else:
        # Split K: each split's sum goes to the workspace; the tile's last split to arrive (a counter, one per
        # output tile) adds them in split order, so the result never depends on which split finished when. The
        # barrier and the release make every thread's stores visible before the count; the counter is left 0.
        plane = (pid_s.to(tl.int64) * 0 + M) * N  # one split's [M, N] in the workspace, in 64 bits
        parts = part_ptr + rm.to(tl.int64)[:, None] * N + rn[None, :]
        tl.store(parts + pid_s * plane, acc, mask=out_ok)
        tl.debug_barrier()
        counter = count_ptr + pid_m * tl.num_programs(1) + pid_n
        if tl.atomic_add(counter, 1, sem="acq_rel") == SPLIT - 1:
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(SPLIT):
                total += tl.load(parts + s * plane, mask=out_ok, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(b_ptr + rn, mask=col_ok, other=0.0)[None, :]
            tl.store(y, total, mask=out_ok)
            tl.atomic_xchg(counter, 0, sem="relaxed")


@functools.cache  # asked twice by an eager call (its counters' check, then the launch); a weight's shape is fixed
def tile_config(N: int, K: int, target: int = TARGET_PROGRAMS, block_n: int = 32, block_k: int = 64,
                warps: int = 4) -> tuple[int, int, int, int, int]:
    """``(BLOCK_N, BLOCK_K, num_warps, num_stages, split)`` for a weight ``[N, K]``: from the weight alone, never
    from the number of rows (:func:`rows_config` picks between this and taller tiles by the rows' range). 32
    columns and 64 of K a tile (less for a narrower K), 4 warps, 3 stages: the best of the H200's sweep over
    SmolLM2's weights at 16 and 64 rows (``bench/results/linear-nvidia-h200.md``). ``split``: K cut into that many
    runs of whole tiles, enough for about ``target`` programs a row tile (:data:`TARGET_PROGRAMS`; 1: K in one
    run). Why: that sweep's best read the weights at 400 GB/s, a tenth of the H200's bandwidth, because SmolLM2's
    narrow weights give 18-96 column tiles for 132 SMs, too few loads in flight; cuBLAS's one-row GEMV reached 917
    GB/s with more programs.
    ``block_n``, ``block_k`` (at most K's next power of two) and ``warps``: other tiles, split by the same rule
    (benchmarks compare them)."""
    block_k = min(block_k, max(16, triton.next_power_of_2(K)))
    split, _ = _k_runs(K, block_k, triton.cdiv(target, triton.cdiv(N, block_n)))
    return block_n, block_k, warps, 3, split


def rows_config(M: int, N: int, K: int) -> tuple[int, ...]:
    """The configuration a call of ``M`` rows takes (:func:`step_linear`; the model's layers): :func:`tile_config`'s
    16-row tiles below :data:`TALL_FROM_ROWS` rows, else its rule with 64-row tiles (a sixth element), 32 of K and K
    split to about 64 programs a row tile. The choice depends on the row count's range only, so a row's result is
    the same for any step size within each range."""
    if M < TALL_FROM_ROWS:
        return tile_config(N, K)
    return tile_config(N, K, TALL_TARGET_PROGRAMS, block_k=TALL_BLOCK_K) + (TALL_BLOCK_M,)


def counters_for_rows(rows: int, N: int, K: int) -> int:
    """Counters enough for every call of 1 to ``rows`` rows under :func:`rows_config` (a layer keeps them)."""
    return max(counters_needed(m, N, rows_config(m, N, K)) for m in (min(rows, TALL_FROM_ROWS - 1), rows))


def _k_runs(K: int, block_k: int, split: int) -> tuple[int, int]:
    """``(splits, K per split)`` for about ``split`` runs of whole ``block_k`` tiles over ``K``: at least 1, at most
    one a tile, none empty."""
    k_tiles = triton.cdiv(K, block_k)
    k_per_split = triton.cdiv(k_tiles, max(1, min(k_tiles, split))) * block_k
    return triton.cdiv(K, k_per_split), k_per_split


def counters_needed(M: int, N: int, config: tuple[int, ...]) -> int:
    """How many int32 counters a call of ``M`` rows with ``config`` needs (0 where it does not split K)."""
    return triton.cdiv(M, _rows_a_tile(config)) * triton.cdiv(N, config[0]) if config[4] > 1 else 0


def _rows_a_tile(config: tuple[int, ...]) -> int:
    """A config's rows a tile: its sixth element where a caller gave one (:func:`rows_config` gives 64 for steps of
    many rows), else :data:`BLOCK_M`."""
    return config[5] if len(config) > 5 else BLOCK_M


def _launch(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, y2: torch.Tensor,
            counters: torch.Tensor | None = None, config: tuple[int, ...] | None = None) -> None:
    """``y2 [M, N] = x2 [M, K] @ weight.T (+ bias)``, inputs already checked; ``counters`` as :func:`step_linear`
    takes them (made here where None and needed); ``config`` overrides :func:`rows_config` (benchmarks and tests
    compare tile sizes and splits with it), optionally with a sixth element, the rows a tile (a power of two >= 16;
    default :data:`BLOCK_M`)."""
    M, K = x2.shape
    N = weight.shape[0]
    if M == 0 or N == 0:
        return
    if K == 0:
        y2.copy_(bias.expand(M, N) if bias is not None else torch.zeros_like(y2))
        return
    config = config or rows_config(M, N, K)
    block_n, block_k, warps, stages, split = config[:5]
    block_m = _rows_a_tile(config)
    split, k_per_split = _k_runs(K, block_k, split)  # a config given by a caller may ask for any split
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n), split)
    parts = y2
    if split > 1:
        parts = torch.empty((split, M, N), dtype=torch.float32, device=x2.device)
        if counters is None:
            counters = torch.zeros(grid[0] * grid[1], dtype=torch.int32, device=x2.device)
    with on_device(x2):
        _linear_kernel[grid](x2, weight, bias if bias is not None else weight, y2, parts,
                             counters if counters is not None else parts, M, N, K, k_per_split,
                             x2.stride(0), weight.stride(0), y2.stride(0),
                             HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                             SPLIT=split, FP32_DOT="ieee" if interpreted(_linear_kernel) else _FP32_DOT,
                             num_warps=warps, num_stages=stages)


@torch.library.custom_op("lookahead::step_linear", mutates_args=("counters",))
def _linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               counters: torch.Tensor | None) -> torch.Tensor:
    K = x.shape[-1]
    x2 = x.reshape(x.shape[:-1].numel(), K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty((*x.shape[:-1], weight.shape[0]), dtype=x.dtype, device=x.device)
    _launch(x2, weight, bias, y.view(-1, weight.shape[0]), counters)
    return y


@_linear_op.register_fake
def _linear_fake(x, weight, bias, counters):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def step_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                counters: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)``, each row of ``x`` computed alone: its result is the same bit for bit whatever
    the other rows of the call, and however many within each range of :func:`rows_config` (1-32 rows, 33 or more).

    Args:
        x: ``[..., K]`` float32 (any leading shape; rows are copied only where the last dimension is not
            contiguous).
        weight: ``[N, K]`` float32 on ``x``'s device, each row contiguous (``nn.Linear``'s layout).
        bias: optional ``[N]`` float32 on ``x``'s device, contiguous.
        counters: where :func:`rows_config` splits K, one int32 counter per output tile (at least
            :func:`counters_needed`), contiguous on ``x``'s device, all 0, and left all 0; a caller that makes many
            calls keeps one (a CUDA graph replays without a fill). None: made for the call. Calls that share
            counters must not run at the same time (one stream).
    Returns:
        ``[..., N]`` float32; each output a sum over K in order within each split, the splits' sums added in order
        (multiplied as tf32x3 on a GPU, exactly under the interpreter).
    Raises:
        ValueError: on another dtype, mismatched shapes, dtypes or devices, a weight whose rows are not
            contiguous, or counters too few or of another dtype or device.
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
    if counters is not None:
        rows = x.shape[:-1].numel()
        needed = counters_needed(rows, weight.shape[0], rows_config(rows, *weight.shape))
        if not isinstance(counters, torch.Tensor) or counters.dtype != torch.int32 or counters.device != x.device \
                or not counters.is_contiguous() or counters.numel() < needed:
            got = (counters.dtype, counters.numel(), str(counters.device)) if isinstance(counters, torch.Tensor) \
                else counters
            raise ValueError(f"step_linear: counters must be None or a contiguous int32 tensor of at least {needed} "
                             f"elements on {x.device}, got {got}")
    return _linear_op(x, weight, bias, counters)
