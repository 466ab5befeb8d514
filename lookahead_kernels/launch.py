"""What every Triton launcher shares: launching on the tensors' own CUDA device."""

from __future__ import annotations

import contextlib

import torch


def on_device(x: torch.Tensor):
    """A context in which Triton launches on ``x``'s CUDA device (it launches on the current one); a no-op for a CPU
    tensor (the interpreter)."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()
