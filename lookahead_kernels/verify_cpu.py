"""Sampled tree verification on the CPU: ``verify_tree_sample_reference``'s walk in C++ (``csrc/verify_sample.cpp``,
``torch.ops.lookahead_draft.verify_tree_sample``), which reads each row of the vocabulary in place where the
reference copies and sums it with torch ops (1.3 ms of a sampled tree step for SmolLM2 on a 2-core CPU)."""

from __future__ import annotations

import torch

from .verify_ref import _num_nodes_tensor, check_tree_verify_inputs, resolve_uniforms


def verify_tree_sample_cpu(x_probs: torch.Tensor, node_probs: torch.Tensor, tokens: torch.Tensor, end: torch.Tensor,
                           num_nodes: torch.Tensor | int | None, max_accept: int, uniforms: torch.Tensor | None = None,
                           generator: torch.Generator | None = None):
    """:func:`~lookahead_kernels.verify_tree_sample_reference` on CPU tensors, with the same arguments and results:
    ``x_probs [B, vocab]`` and ``node_probs [B, V, vocab]`` nonnegative weights (read as float32), ``tokens``
    and ``end`` int64 ``[B, V]`` (``end`` may be ``[V]``), ``num_nodes`` (``None``: every node), ``uniforms``
    float64 ``[B, V + 1]`` (drawn with ``generator`` when ``None``). Returns ``(accept_len [B], path [B,
    max_accept], emitted [B, max_accept + 1])``, int64, ``-1`` past each row's end. Needs the CPU ops
    (``load_cpu_ops``)."""
    name = "verify_tree_sample_cpu"
    check_tree_verify_inputs(name, x_probs, node_probs, tokens, end, num_nodes, max_accept)
    if tokens.device.type != "cpu":
        raise ValueError(f"{name}: the tensors must be on the CPU, got {tokens.device}")
    B, V = tokens.shape
    u = resolve_uniforms(name, uniforms, generator, B, V, tokens.device).double().contiguous()
    n = _num_nodes_tensor(num_nodes, B, V, tokens.device).long().contiguous()

    def rows(t: torch.Tensor) -> torch.Tensor:  # float32, the vocabulary contiguous (any strides before it)
        t = t.float()
        return t if t.stride(-1) == 1 else t.contiguous()

    return torch.ops.lookahead_draft.verify_tree_sample(rows(x_probs), rows(node_probs), tokens.contiguous(),
                                                        end.expand(B, V).contiguous(), n, int(max_accept), u)
