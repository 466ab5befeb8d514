"""Kernels for lookahead decoding: attention under the step's mask, verification, KV compaction, the n-gram pool.

Importing this package is cheap and never queries a device: the Triton and C++/CUDA modules load on first
use of a name that needs them.
"""

import importlib

from .attention_ref import attention_dense_reference, attention_torch, dense_mask
from .kv_compact_ref import compact_kv_reference
from .layout import StepLayout
from .verify_ref import draw_tree_uniforms, verify_tree_greedy_reference, verify_tree_sample_reference

# name -> submodule that defines it; imported on first access (Triton import and kernel definition are slow).
_LAZY = {
    "lookahead_attention": ".attention",
    "verify_tree_greedy": ".verify",
    "verify_tree_sample": ".verify",
    "row_argmax": ".verify",
    "row_top_k": ".row_topk",
    "compact_kv": ".kv_compact",
    "load_pool_extension": ".pool_ext",
    "attention_cpu": ".cpu_attention",
    "load_cpu_ops": ".cpu_ops",
    "verify_tree_sample_cpu": ".verify_cpu",
    "verify_tree_greedy_cpu": ".verify_cpu",
}

__all__ = ["StepLayout", "attention_torch", "attention_dense_reference", "dense_mask",
           "verify_tree_greedy_reference", "verify_tree_sample_reference", "draw_tree_uniforms",
           "compact_kv_reference", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'lookahead_kernels' has no attribute {name!r}")
