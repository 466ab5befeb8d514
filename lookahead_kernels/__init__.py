"""Kernels for lookahead decoding: attention under the step's mask, verification, the n-gram pool.

Importing this package is cheap and never queries a device: Triton modules load on first use.
"""

from .attention_ref import attention_dense_reference, attention_torch, dense_mask
from .layout import StepLayout

__all__ = ["StepLayout", "attention_torch", "attention_dense_reference", "dense_mask"]
