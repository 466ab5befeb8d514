"""What every Triton launcher shares: launching on the tensors' own CUDA device."""

from __future__ import annotations

import contextlib

import torch
import triton


def on_device(x: torch.Tensor):
    """A context in which Triton launches on ``x``'s CUDA device (it launches on the current one); a no-op for a CPU
    tensor (the interpreter)."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


def interpreted(kernel) -> bool:
    """Whether ``kernel`` (a ``@triton.jit`` function) runs under Triton's CPU interpreter: Triton decides at
    decoration time, from ``TRITON_INTERPRET``, so a module's kernels all answer alike."""
    return not isinstance(kernel, triton.runtime.JITFunction)
