"""The step's attention on the CPU in float32: the C++ op ``lookahead_cpu::step_attention``
(``csrc/cpu_attention.cpp``) behind one launcher. Its reference is :func:`attention_torch` (and the float64 oracle
:func:`attention_dense_reference`).

Per sequence it reads the committed prefix and the step's own keys straight from the KV cache at that
sequence's ``cache_len`` (a batch of different lengths is one call), and takes the step's visibility as the
small ``[T, T]`` block the layout's rule gives (never a ``[T, cache_len + T]`` mask). Each query's result depends
on its own visible keys only, in a fixed order, not on ``T`` or the batch.
"""

from __future__ import annotations

import math

import torch

from .attention_ref import check_attention_args, step_block
from .layout import StepLayout

HEAD_DIMS = (16, 32, 64, 128, 256)


def cpu_attention_applies(device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether :class:`CpuStepAttention` serves queries of ``dtype`` and ``head_dim`` on ``device``: float32 on the
    CPU with a head size in :data:`HEAD_DIMS` (the kernel's vector layout), and the ops built (first use builds
    them)."""
    if torch.device(device).type != "cpu" or dtype != torch.float32 or head_dim not in HEAD_DIMS:
        return False
    from .cpu_ops import cpu_ops_available

    return cpu_ops_available()


class CpuStepAttention:
    """Attention for one step, built once per forward and called per layer (the same interface as
    :class:`~lookahead_kernels.attention_ref.StepAttention`)::

        attend = CpuStepAttention(layout, cache_len, batch_size)
        out = attend(q, k_cache, v_cache)   # q [B, T, Hq, D]; k_cache, v_cache [B, S, Hkv, D]; float32

    Args:
        layout: the step's :class:`StepLayout`.
        cache_len: int or integer tensor ``[B]`` (or 0-d): committed rows per sequence.
        batch_size: ``B``.
    """

    def __init__(self, layout: StepLayout, cache_len, batch_size: int):
        if not isinstance(layout, StepLayout):
            raise ValueError(f"layout must be a StepLayout, got {type(layout).__name__}")
        self.layout = layout
        lens = torch.as_tensor(cache_len, dtype=torch.int64).reshape(-1)
        self.cache_len = lens.expand(batch_size).contiguous() if lens.numel() == 1 else lens.contiguous()
        block = step_block(layout, batch_size, "cpu")
        self.visible = (block[None] if block.dim() == 2 else block).contiguous()

    def __call__(self, q, k_cache, v_cache, *, cache_len=None, layout=None, sm_scale=None):
        """``[B, T, Hq, D]`` float32: attention of ``q`` over each sequence's ``cache_len`` committed rows and the
        step's own keys (already written at rows ``cache_len .. cache_len+T-1``). ``cache_len`` and ``layout``,
        when given (as an attention function's caller does), must be the ones this was built for; only the
        layout's identity is checked."""
        if layout is not None and layout is not self.layout:
            raise ValueError("CpuStepAttention called with a different layout than it was built for")
        scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
        return torch.ops.lookahead_cpu.step_attention(q, k_cache, v_cache, self.cache_len, self.visible, scale)


def attention_cpu(q, k_cache, v_cache, *, cache_len, layout: StepLayout, sm_scale=None):
    """:func:`~lookahead_kernels.attention_torch`'s signature and result, by the C++ op (float32 CPU tensors,
    head size in :data:`HEAD_DIMS`; anything else is a ValueError)."""
    lens = check_attention_args(q, k_cache, v_cache, cache_len, layout)
    if q.device.type != "cpu" or q.dtype != torch.float32 or k_cache.dtype != torch.float32 \
            or v_cache.dtype != torch.float32 or q.shape[-1] not in HEAD_DIMS:
        raise ValueError(f"attention_cpu takes float32 CPU tensors with head_dim in {HEAD_DIMS}, got q "
                         f"{q.dtype} on {q.device} with head_dim {q.shape[-1]}, k/v {k_cache.dtype}/{v_cache.dtype}")
    from .cpu_ops import load_cpu_ops

    load_cpu_ops()
    return CpuStepAttention(layout, lens.cpu(), q.shape[0])(q, k_cache, v_cache, sm_scale=sm_scale)
