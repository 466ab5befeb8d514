"""The decoder layers of the CPU forward in float32 as one C++ op, ``lookahead_cpu::decoder_stack``
(``csrc/cpu_layer.cpp``), each layer: RMSNorm, the fused q/k/v projection, (Qwen3's norms of each q and k head,) rotary
embedding (but in SmolLM3's layers without it), the KV cache write, the
step attention, the o projection, RMSNorm, the fused gate/up projection, SwiGLU, the down projection and both
residual adds. Its reference is the model's own layer in plain torch (``lookahead.model.DecoderLayer`` on
``F.linear`` and :func:`~lookahead_kernels.attention_torch`).

Why one op: at a step's few rows, the parts between the matrix products are microseconds of arithmetic but cost
10-20 us each as torch ops called from Python, ~4 ms of a 19 ms SmolLM2 forward on a 2-core CPU (measured); and
calling even one op a layer cost ~90 us a layer (the module, the dispatcher's 23 arguments, the weights' check):
2.7 ms of a 28 ms forward.
"""

from __future__ import annotations

import math

import torch

from .cpu_attention import CpuStepAttention


def decoder_stack_cpu(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, attend: CpuStepAttention, *, num_heads: int, num_kv_heads: int,
                      intermediate_size: int, eps: float, attn_norm: list, qkv: list, qkv_bias: list, o: list,
                      o_bias: list, mlp_norm: list, gate_up: list, gate_up_bias: list, down: list,
                      down_bias: list, q_norm: list, k_norm: list, nope_layers: list) -> torch.Tensor:
    """Every Llama decoder layer of a model, float32 on the CPU, in one call; writes the step's keys and values
    into each layer's cache.

    Args:
        x: ``[B, T, hidden]``, the first layer's input.
        cos, sin: ``[B, T, D]``, the step's rotary tables (``LlamaForCausalLM.rotary``).
        k_cache, v_cache: ``[L, B, S, Hkv, D]``, the whole KV cache (last dimension contiguous); layer ``i``'s
            rows ``cache_len[b] .. cache_len[b] + T - 1`` are written.
        attend: the step's :class:`CpuStepAttention` (its ``cache_len [B]`` and ``visible [1 or B, T, T]``).
        num_heads, num_kv_heads, intermediate_size, eps: the model's shape and RMSNorm epsilon.
        attn_norm, mlp_norm: per layer (``L`` entries, as every list below), the ``[hidden]`` RMSNorm weights.
        qkv, o, gate_up, down: per layer, weights packed by ``torch.ops.lookahead_gemm.pack`` from ``[(Hq + 2 Hkv)
            D, hidden]``, ``[hidden, Hq D]``, ``[2 intermediate, hidden]`` (gate rows, then up) and ``[hidden,
            intermediate]``; each bias (``qkv_bias``, ...) ``[n]`` float32 or None.
        q_norm, k_norm: per layer, the ``[D]`` float32 RMSNorm weights of each q and of each k head, applied
            before the rotary embedding (Qwen3), or None in both lists (no such norm).
        nope_layers: the indices of the layers whose q and k take no rotary embedding (SmolLM3's every fourth).
    Returns:
        ``[B, T, hidden]`` float32, the last layer's output.
    Raises:
        ValueError: on shapes, dtypes, list lengths or a ``cache_len`` that do not fit (the op's checks).
    """
    return torch.ops.lookahead_cpu.decoder_stack(
        x, cos, sin, k_cache, v_cache, attend.cache_len, attend.visible, 1.0 / math.sqrt(cos.shape[-1]), eps,
        num_heads, num_kv_heads, intermediate_size, attn_norm, qkv, qkv_bias, o, o_bias, mlp_norm, gate_up,
        gate_up_bias, down, down_bias, q_norm, k_norm, nope_layers)


def forward_step_cpu(input_ids: torch.Tensor, positions: torch.Tensor, max_positions: int, inv_freq: torch.Tensor,
                     embed: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, attend: CpuStepAttention,
                     stack: dict, final_norm: torch.Tensor, final_eps: float, head: torch.Tensor,
                     logits_rows: torch.Tensor | None) -> torch.Tensor:
    """A whole step's logits, float32 on the CPU, in one call (``lookahead_cpu::forward_step``): the embedding rows,
    the rotary tables (as ``lookahead_cpu::rotary_tables``), :func:`decoder_stack_cpu`, the final RMSNorm of the
    rows wanted and the vocabulary projection.

    Args:
        input_ids: int64 or int32 ``[B, T]``, each in ``[0, V)``.
        positions: int64 or int32 ``[B, T]``, each in ``[0, max_positions)``.
        inv_freq: float32 ``[D / 2]``, the rotary inverse frequencies.
        embed: float32 ``[V, hidden]``, the embedding matrix.
        k_cache, v_cache, attend: as :func:`decoder_stack_cpu` takes them.
        stack: :func:`decoder_stack_cpu`'s keyword arguments (the model's shape and per-layer weights).
        final_norm: float32 ``[hidden]``; final_eps: its epsilon.
        head: the ``[V, hidden]`` vocabulary projection packed by ``torch.ops.lookahead_gemm.pack``.
        logits_rows: int64 ``[R]`` step indices (negative ones count from the end), or None for all ``T``.
    Returns:
        float32 ``[B, R or T, V]``.
    Raises:
        ValueError: a token id, position or logits row out of range (the messages of the model's own checks), or
            what :func:`decoder_stack_cpu` refuses.
    """
    return torch.ops.lookahead_cpu.forward_step(
        input_ids, positions, max_positions, inv_freq, embed, k_cache, v_cache, attend.cache_len, attend.visible,
        1.0 / math.sqrt(inv_freq.shape[0] * 2), stack["eps"], stack["num_heads"], stack["num_kv_heads"],
        stack["intermediate_size"], stack["attn_norm"], stack["qkv"], stack["qkv_bias"], stack["o"],
        stack["o_bias"], stack["mlp_norm"], stack["gate_up"], stack["gate_up_bias"], stack["down"],
        stack["down_bias"], stack["q_norm"], stack["k_norm"], stack["nope_layers"], final_norm, final_eps, head,
        logits_rows)
