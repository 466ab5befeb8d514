"""Linear layers for the CPU forward: float32 weights prepacked once for oneDNN (mkldnn).

A decoding step on a CPU reads every weight once whatever the number of rows, so what matters is how fast
each weight streams through the cores. torch's default ``F.linear`` (MKL sgemm) reads at ~15 GB/s on one core
of the reference machine and does not use AVX-512; oneDNN with a weight reordered once into its blocked
layout reads at ~35 GB/s and computes with AVX-512 where the CPU has it, about 2x faster at every M from 1 to
128 (measured in ``bench/results/forward-cpu.md``). The packed copy doubles the memory the weights take; the
parameters themselves are left as they are, so ``state_dict()`` and loading are unchanged.

Everything else (another dtype or device, autograd through the weight, a torch built without oneDNN) takes
plain ``F.linear``.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn

CPU_LINEAR_MODES = ("packed", "torch")


def onednn_linear_available() -> bool:
    """Whether this torch build has oneDNN and the two ops the packed path uses."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") \
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _weight_key(weight: torch.Tensor) -> tuple:
    # The version counter catches in-place updates (load_state_dict, copy_); inference tensors have none.
    try:
        version = weight._version
    except RuntimeError:
        version = None
    return weight.data_ptr(), version, tuple(weight.shape), weight.dtype, weight.device


class PackedWeight:
    """The oneDNN-packed copy of one weight, made on first use and remade when the weight changes.

    Not a buffer: it never reaches ``state_dict()``; copies and pickles of the owner start without it.
    """

    __slots__ = ("_ref", "_key", "_packed")

    def __init__(self) -> None:
        self._ref = self._key = self._packed = None

    def get(self, weight: torch.Tensor) -> torch.Tensor:
        key = _weight_key(weight)
        # The weak reference tells a new tensor that reuses a freed one's memory from the one packed.
        if self._ref is None or self._ref() is not weight or key != self._key:
            self._packed = None  # free the old copy before making the new one
            with torch.no_grad():
                self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
            self._ref, self._key = weakref.ref(weight), key
        return self._packed

    def clear(self) -> None:
        self._ref = self._key = self._packed = None

    def __reduce__(self):  # copies and pickles start empty (an oneDNN tensor can be neither)
        return PackedWeight, ()


def packed_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``x @ weight.T`` can take the packed path: float32 on the CPU, no gradient needed."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32 \
        and weight.device.type == "cpu" and not (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, pack: PackedWeight | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through ``pack`` (oneDNN) when given and :func:`packed_applies`."""
    if pack is None or not packed_applies(x, weight) or (bias is not None and bias.dtype != torch.float32):
        return F.linear(x, weight, bias)
    K = x.shape[-1]
    if K != weight.shape[1]:  # the op would read out of bounds rather than fail cleanly
        raise ValueError(f"linear: input has {K} features but the weight {tuple(weight.shape)} expects {weight.shape[1]}")
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, K), pack.get(weight), bias, "none", [], "")
    return y.view(*x.shape[:-1], weight.shape[0])


class CpuLinear(nn.Linear):
    """``nn.Linear`` (same parameters and state dict) that runs on prepacked weights on the CPU.

    ``mode`` is ``"packed"`` (default; falls back to ``F.linear`` where the packed path does not apply or oneDNN
    is missing) or ``"torch"`` (always ``F.linear``, the reference and the benchmark's "before").
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.pack = PackedWeight() if onednn_linear_available() else None
        self.mode = "packed"

    def set_mode(self, mode: str) -> None:
        if mode not in CPU_LINEAR_MODES:
            raise ValueError(f"CPU linear mode must be one of {CPU_LINEAR_MODES}, got {mode!r}")
        self.mode = mode
        if mode == "torch" and self.pack is not None:
            self.pack.clear()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.pack if self.mode == "packed" else None)
