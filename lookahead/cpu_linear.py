"""Linear layers for the CPU forward: float32 weights prepacked once, read once per step for all rows.

A decoding step on a CPU reads every weight once whatever the number of rows (a few dozen at most), so what
matters is how fast each weight streams through the cores and whether the step's few FLOPs per weight hide
behind that stream. Two packed paths, both on a copy made at first use (the parameters are left as they are, so
``state_dict()`` and loading are unchanged):

* ``"packed"`` (default): our small-M GEMM (``csrc/small_gemm.cpp``, AVX-512 or AVX2, on all of torch's threads;
  built just in time with ninja by :mod:`lookahead_kernels.cpu_ops`). Weights in groups of 32 columns, K cut
  into 8 KB blocks that all rows go over before the next is read, the next block prefetched meanwhile: a step of
  16 rows costs little more than one (measured in ``bench/results/forward-cpu.md``). A weight that a quantised
  checkpoint dequantised (exactly ``d * q + m`` with 4- or 5-bit ``q``, or ``d * q`` with 8-bit ``q``, per block
  of 32, as GGUF's Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K and Q8_0 give it, or per 16, as Q3_K and Q6_K do) is also
  packed as those integers, 0.19x to 0.31x the float32 bytes: steps of up to 8 rows (AVX2; 12 with AVX-512, 4
  without AVX2) read them, expanded in the GEMM to the very same floats, so the results are the float32 layout's,
  bit for bit, for fewer bytes read; larger steps read the float32 layout. The packed copy takes as much memory
  as the weights (1.2x to 1.3x for quantised ones). Where it cannot be built (no compiler,
  ``LOOKAHEAD_CPU_GEMM=0``) this falls back to ``"onednn"``.
* ``"onednn"``: torch's oneDNN (mkldnn) linear on a weight reordered once into its blocked layout.

Everything else (another dtype or device, autograd through the weight, a torch built without oneDNN) takes
plain ``F.linear``; so does mode ``"torch"``, the reference.

On CUDA a float32 step of 2 to 256 rows (:data:`GPU_KERNEL_ROWS`) runs our Triton kernel
(:func:`lookahead_kernels.step_linear.step_linear`), any other ``F.linear`` (cuBLAS), whatever the mode.
"""

from __future__ import annotations

import os
import warnings
import weakref

import torch
import torch.nn.functional as F
from torch import nn

CPU_LINEAR_MODES = ("packed", "onednn", "torch")
GEMM_ENV = "LOOKAHEAD_CPU_GEMM"  # "0" disables our GEMM (mode "packed" then runs on oneDNN)

_answer: dict = {}  # "ok": whether our GEMM serves this process, once known
# On CUDA, float32 steps of this many rows take our Triton kernel, the others cuBLAS. SmolLM2's linear layers on an
# H200, one step's 121 products in one graph (bench/results/gpu-h200-s57.md, `stack`): cuBLAS 0.60 ms at 1 row (its
# GEMV; the kernel 0.70), 1.51 at 16, 1.68 at 64, 1.93 at 128 and 2.72 at 256 (its float32 GEMM); the kernel with
# step_linear.rows_config's tiles 0.73 at 16, 1.29 at 64, 1.56 at 128 and 2.01 at 256. Past 256 rows unmeasured.
GPU_KERNEL_ROWS = range(2, 257)


def onednn_linear_available() -> bool:
    """Whether this torch build has oneDNN and the two ops the oneDNN path uses."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") \
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def gemm_available(build: bool = True) -> bool:
    """Whether our small-M GEMM is loaded; with ``build``, build (first time, about two minutes on 2 cores) and load
    the CPU ops (:mod:`lookahead_kernels.cpu_ops`) if needed. ``LOOKAHEAD_CPU_GEMM=0`` says no.

    Every linear call asks, so the answer, once known, is one dict lookup (an environment read and an import
    per call cost ~1 ms a forward, measured). A failed build is remembered for the process (the reason in
    :func:`gemm_error`), warned about once, and not retried.
    """
    ok = _answer.get("ok")
    if ok is not None:
        return ok
    if os.environ.get(GEMM_ENV, "1") == "0":
        return False
    from lookahead_kernels.cpu_ops import cpu_ops_available

    ok = cpu_ops_available(build)
    if ok or build:  # a build was tried (or needed none): the answer holds for the process
        _answer["ok"] = ok
        if not ok:
            warnings.warn(f"lookahead: the CPU GEMM extension could not be built ({(gemm_error() or '')[:300]}); "
                          f"the packed linear layers use oneDNN instead", RuntimeWarning, stacklevel=2)
    return ok


def gemm_error() -> str | None:
    """Why :func:`gemm_available` said no (None if it was not tried or worked)."""
    from lookahead_kernels.cpu_ops import cpu_ops_error

    return cpu_ops_error()


def weight_key(weight: torch.Tensor) -> tuple:
    """What changes when ``weight`` does: its storage, in-place version, shape, dtype and device. The version
    counter catches in-place updates (load_state_dict, copy_); inference tensors have none."""
    try:
        version = weight._version
    except RuntimeError:
        version = None
    return weight.data_ptr(), version, tuple(weight.shape), weight.dtype, weight.device


def weights_signature(model) -> tuple:
    """What changes when any of ``model``'s weights does (:func:`weight_key` of each parameter): what a result
    computed from the weights and kept for later calls is checked against."""
    return tuple(weight_key(p) for p in model.parameters())


def _backend(mode: str) -> str | None:
    """The packed layout mode ``mode`` runs on here: "gemm", "onednn" or None (plain F.linear)."""
    if mode == "packed" and gemm_available():
        return "gemm"
    if mode in ("packed", "onednn") and onednn_linear_available():
        return "onednn"
    return None


class PackedWeight:
    """The packed copy of one weight, made on first use and remade when the weight or the mode changes.

    ``mode`` is ``"packed"`` (our GEMM, else oneDNN) or ``"onednn"``. Not a buffer: it never reaches
    ``state_dict()``; copies and pickles of the owner start without it.
    """

    __slots__ = ("_ref", "_key", "_packed", "_backend", "_counters", "mode")

    def __init__(self, mode: str = "packed") -> None:
        self._ref = self._key = self._packed = self._backend = self._counters = None
        self.mode = mode

    def get(self, weight: torch.Tensor) -> tuple[str | None, torch.Tensor | None]:
        """``(backend, packed)``: backend "gemm" or "onednn", or ``(None, None)`` where neither applies."""
        backend = _backend(self.mode)
        if backend is None:
            return None, None
        key = weight_key(weight)
        # The weak reference tells a new tensor that reuses a freed one's memory from the one packed.
        if self._ref is None or self._ref() is not weight or key != self._key or backend != self._backend:
            self._packed = None  # free the old copy before making the new one
            with torch.no_grad():
                w = weight.detach()
                self._packed = torch.ops.lookahead_gemm.pack(w) if backend == "gemm" else \
                    torch.ops.mkldnn._reorder_linear_weight(w, None)
            self._ref, self._key, self._backend = weakref.ref(weight), key, backend
        return backend, self._packed

    def step_counters(self, weight: torch.Tensor) -> torch.Tensor | None:
        """The counters our Triton kernel's K splits take for ``weight`` on CUDA (zeros, left zeros by each call;
        kept here so that a graph replays without filling them), None where the kernel does not split its K."""
        key = (tuple(weight.shape), weight.device)
        if self._counters is None or self._counters[0] != key:  # once per weight shape and device: every call asks
            from lookahead_kernels.step_linear import counters_for_rows

            needed = counters_for_rows(GPU_KERNEL_ROWS[-1], *weight.shape)
            self._counters = key, torch.zeros(needed, dtype=torch.int32, device=weight.device) if needed else None
        return self._counters[1]

    def clear(self) -> None:
        self._ref = self._key = self._packed = self._backend = self._counters = None

    def __reduce__(self):  # copies and pickles start empty (an oneDNN tensor can be neither)
        return PackedWeight, (self.mode,)


def packed_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``x @ weight.T`` can take a packed path: float32 on the CPU, no gradient needed."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32 \
        and weight.device.type == "cpu" and not (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad))


def step_kernel_applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether ``x @ weight.T (+ bias)`` takes our Triton kernel: float32 on CUDA, :data:`GPU_KERNEL_ROWS` rows, a
    weight whose rows are contiguous and a contiguous bias (or none; the kernel's layout: anything else goes to
    cuBLAS), no gradient needed."""
    return x.is_cuda and x.dtype == torch.float32 and weight.dtype == torch.float32 \
        and x.shape[:-1].numel() in GPU_KERNEL_ROWS and weight.dim() == 2 and weight.stride(1) == 1 \
        and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous())) \
        and not (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, pack: PackedWeight | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through ``pack`` (our GEMM or oneDNN) when given and :func:`packed_applies`;
    on CUDA through our Triton kernel where :func:`step_kernel_applies`."""
    if x.is_cuda:
        if step_kernel_applies(x, weight, bias):
            from lookahead_kernels.step_linear import step_linear

            return step_linear(x, weight, bias, None if pack is None else pack.step_counters(weight))
        return F.linear(x, weight, bias)
    if pack is None or not packed_applies(x, weight) or (bias is not None and bias.dtype != torch.float32):
        return F.linear(x, weight, bias)
    K = x.shape[-1]
    if K != weight.shape[1]:  # the ops would read out of bounds rather than fail cleanly
        raise ValueError(f"linear: input has {K} features but the weight {tuple(weight.shape)} expects "
                         f"{weight.shape[1]}")
    backend, packed = pack.get(weight)
    if backend is None:
        return F.linear(x, weight, bias)
    N = weight.shape[0]
    x2 = x.reshape(-1, K)
    if backend == "gemm":
        y = torch.ops.lookahead_gemm.linear(x2, packed, N, None if bias is None else bias.detach())
    else:
        y = torch.ops.mkldnn._linear_pointwise(x2, packed, bias, "none", [], "")
    return y.view(*x.shape[:-1], N)


class CpuLinear(nn.Linear):
    """``nn.Linear`` (same parameters and state dict) that runs on prepacked weights on the CPU.

    ``mode`` is one of :data:`CPU_LINEAR_MODES`: ``"packed"`` (default: our GEMM, else oneDNN, else
    ``F.linear`` where no packed path applies), ``"onednn"``, or ``"torch"`` (always ``F.linear``, the reference).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.pack = PackedWeight()
        self.mode = "packed"

    def set_mode(self, mode: str) -> None:
        if mode not in CPU_LINEAR_MODES:
            raise ValueError(f"CPU linear mode must be one of {CPU_LINEAR_MODES}, got {mode!r}")
        self.mode = mode
        if mode == "torch":
            self.pack.clear()
        else:
            self.pack.mode = mode  # the next call repacks if the layout changes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.pack if self.mode != "torch" else None)
