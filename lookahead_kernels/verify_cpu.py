"""Tree verification on the CPU from the step's logits, in C++ (``csrc/verify_sample.cpp``), reading only the rows
of x and of the nodes the walk accepts:

- greedy: ``verify_tree_greedy_reference``'s walk (``torch.ops.lookahead_draft.verify_tree_argmax``); the torch
  reference took 0.58 ms of a SmolLM2 tree step on a 2-core CPU, about half the step's host work;
- sampled: ``verify_tree_sample_reference``'s walk over the rows ``warp_logits`` gives
  (``torch.ops.lookahead_draft.verify_tree_warped``), each row warped only when the walk reaches it; warping every
  row with torch first took 0.7-1.1 ms of a sampled tree step.

The C++ ops check the tree (``end``) themselves."""

from __future__ import annotations

import math

import torch

from .verify_ref import _num_nodes_tensor, check_tree_verify_inputs, resolve_uniforms


def verify_tree_sample_cpu(x_logits: torch.Tensor, node_logits: torch.Tensor, tokens: torch.Tensor, end: torch.Tensor,
                           num_nodes: torch.Tensor | int | None, max_accept: int, temperature: float, top_k: int,
                           top_p: float, uniforms: torch.Tensor | None = None,
                           generator: torch.Generator | None = None, min_p: float = 0.0):
    """:func:`~lookahead_kernels.verify_tree_sample_reference` on the rows ``lookahead.sampling.warp_logits``
    makes of CPU logits, with the reference's results.

    Args:
        x_logits: ``[B, vocab]`` logits at x (read as float32).
        node_logits: ``[B, V, vocab]`` logits at the tree's nodes; a padding node's row is never read.
        tokens, end: int64 ``[B, V]`` (``end`` may be ``[V]``), the tree as the reference takes it.
        num_nodes: real nodes per row (``None``: every node).
        max_accept: the most nodes a row accepts.
        temperature: ``> 0``; top_k: ``>= 0`` (``0``: off); top_p: in ``(0, 1]`` (``1``: off); min_p: in
            ``[0, 1]`` (``0``: off); applied in that order, ties with the k-th largest logit kept.
        uniforms: float64 ``[B, V + 1]`` as ``draw_tree_uniforms`` lays them out (drawn with ``generator`` when
            ``None``).
    Returns:
        ``(accept_len [B], path [B, max_accept], emitted [B, max_accept + 1])``, int64, ``-1`` past each row's
        end; a row whose logits have no finite maximum keeps no token (its bonus is ``-1``).

    Needs the CPU ops (``load_cpu_ops``)."""
    name = "verify_tree_sample_cpu"
    check_tree_verify_inputs(name, x_logits, node_logits, tokens, end, num_nodes, max_accept, tree_values=False)
    if tokens.device.type != "cpu":
        raise ValueError(f"{name}: the tensors must be on the CPU, got {tokens.device}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not (
            temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"{name}: temperature must be a finite number > 0, got {temperature!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"{name}: top_k must be an int >= 0 (0 = off), got {top_k!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise ValueError(f"{name}: top_p must be a number in (0, 1] (1 = off), got {top_p!r}")
    if isinstance(min_p, bool) or not isinstance(min_p, (int, float)) or not 0 <= min_p <= 1:
        raise ValueError(f"{name}: min_p must be a number in [0, 1] (0 = off), got {min_p!r}")
    B, V = tokens.shape
    u = resolve_uniforms(name, uniforms, generator, B, V, tokens.device).double().contiguous()
    return torch.ops.lookahead_draft.verify_tree_warped(_rows(x_logits), _rows(node_logits), tokens.contiguous(),
                                                        end.expand(B, V).contiguous(),
                                                        _num_nodes_for_op(num_nodes, B, V, tokens.device),
                                                        int(max_accept),
                                                        float(temperature), top_k, float(top_p), float(min_p), u)


def verify_tree_greedy_cpu(x_logits: torch.Tensor, node_logits: torch.Tensor, tokens: torch.Tensor, end: torch.Tensor,
                           num_nodes: torch.Tensor | int | None, max_accept: int):
    """:func:`~lookahead_kernels.verify_tree_greedy_reference` on CPU logits, with the reference's results.

    Args:
        x_logits: ``[B, vocab]`` logits at x, float32, float16 or bfloat16 (read as float32, which keeps their
            order; float64 rows, which float32 could tie, are the reference's).
        node_logits: ``[B, V, vocab]`` logits at the tree's nodes, the same dtype; a padding node's row is never
            read.
        tokens, end: int64 ``[B, V]`` (``end`` may be ``[V]``), the tree as the reference takes it.
        num_nodes: real nodes per row (``None``: every node).
        max_accept: the most nodes a row accepts.
    Returns:
        ``(accept_len [B], path [B, max_accept], emitted [B, max_accept + 1])``, int64, ``-1`` past each row's
        end. Argmax is ``torch.argmax``'s: the first index among equal maxima, NaN the largest.

    Needs the CPU ops (``load_cpu_ops``)."""
    name = "verify_tree_greedy_cpu"
    check_tree_verify_inputs(name, x_logits, node_logits, tokens, end, num_nodes, max_accept, tree_values=False)
    if tokens.device.type != "cpu":
        raise ValueError(f"{name}: the tensors must be on the CPU, got {tokens.device}")
    if x_logits.dtype == torch.float64:
        raise ValueError(f"{name}: float64 logits are the reference's (float32 could tie two of them), got "
                         f"{x_logits.dtype}")
    B, V = tokens.shape
    return torch.ops.lookahead_draft.verify_tree_argmax(_rows(x_logits), _rows(node_logits), tokens.contiguous(),
                                                        end.expand(B, V).contiguous(),
                                                        _num_nodes_for_op(num_nodes, B, V, tokens.device),
                                                        int(max_accept))


def _num_nodes_for_op(num_nodes, B: int, V: int, device) -> torch.Tensor:
    """int64 ``[B]`` for the ops: a tensor as it is (they check its values; a clamp here cost 30 us of a step), an
    int or ``None`` made into one."""
    return num_nodes.contiguous() if isinstance(num_nodes, torch.Tensor) else _num_nodes_tensor(num_nodes, B, V, device)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """float32, the vocabulary contiguous (any strides before it)."""
    t = t.float()
    return t if t.stride(-1) == 1 else t.contiguous()
