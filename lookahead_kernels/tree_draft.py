"""A device tree's tokens read off its row's successor tables in one launch (``lookahead/device_tree.py``).

Why a kernel: a tree of a fixed shape is read a level at a time (a node's token is a successor of its parent's),
and in torch each level is a dozen small launches (two gathers of the parents' and grandparents' tokens, the pair's
slot and key, two table reads, a choice, a write): about a hundred for a tree of 32 nodes and 8 levels, each a
microsecond or two of a GPU's graph, beside a one-row SmolLM2 step of about 1.2 ms on an H200. Here one program
a row keeps its tree's tokens in registers and reads each level's nodes at once.

A node's token: the ``rank``-th successor recorded for the pair (its grandparent's token, its parent's token) where
the pair's slot holds that pair, else for its parent's token alone (``DeviceSuccessors.draft`` is the reference).

:func:`tree_draft` checks its inputs (``ValueError``), allocates and launches; it is the torch custom op
``lookahead::tree_draft``. On CPU tensors it runs only under Triton's interpreter (``TRITON_INTERPRET=1`` set before
this module is imported).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import interpreted, on_device
from .tree import BEFORE_X, PAIR_MUL_A, PAIR_MUL_B, X

_MUL_A = tl.constexpr(PAIR_MUL_A)
_MUL_B = tl.constexpr(PAIR_MUL_B)
_BEFORE_X = tl.constexpr(BEFORE_X)
_X = tl.constexpr(X)


@triton.jit
def pair_slot_key(before, token, vocab, SLOTS: tl.constexpr):
    # The pair's slot and key in a row's pair table, as lookahead_kernels.tree's pair_slot and pair_key give them.
    return (before * _MUL_A + token * _MUL_B) & (SLOTS - 1), before * vocab + token + 1


@triton.jit
def _tree_draft_kernel(x_ptr, prev_ptr, table_ptr, pairs_ptr, keys_ptr, parent_ptr, grand_ptr, rank_ptr,
                       depth_ptr, out_ptr, x_stride, vocab, V, K: tl.constexpr, SLOTS: tl.constexpr,
                       DEPTH: tl.constexpr, BLOCK: tl.constexpr):
    # Program b: row b's V tokens, a level at a time; a level's parents are in registers by then.
    b = tl.program_id(0).to(tl.int64)
    n = tl.arange(0, BLOCK)
    live = n < V
    parent = tl.load(parent_ptr + n, mask=live, other=-1)
    grand = tl.load(grand_ptr + n, mask=live, other=-1)
    rank = tl.load(rank_ptr + n, mask=live, other=0)
    depth = tl.load(depth_ptr + n, mask=live, other=0)
    x = tl.load(x_ptr + b * x_stride)
    prev = tl.load(prev_ptr + b)
    tok = tl.zeros((BLOCK,), dtype=tl.int64)
    for level in tl.static_range(1, DEPTH + 1):
        ptok = tl.where(parent < 0, x, tl.gather(tok, tl.maximum(parent, 0), 0))
        gtok = tl.where(grand == _BEFORE_X, prev,
                        tl.where(grand == _X, x, tl.gather(tok, tl.maximum(grand, 0), 0)))
        here = live & (depth == level)
        slot, key = pair_slot_key(gtok, ptok, vocab, SLOTS)
        seen = tl.load(keys_ptr + b * SLOTS + slot, mask=here, other=0) == key
        pair = tl.load(pairs_ptr + (b * SLOTS + slot) * K + rank, mask=here & seen, other=0)
        single = tl.load(table_ptr + (b * vocab + ptok) * K + rank, mask=here & ~seen, other=0)
        tok = tl.where(here, tl.where(seen, pair, single).to(tl.int64), tok)
    tl.store(out_ptr + b * V + n, tok, mask=live)


@torch.library.custom_op("lookahead::tree_draft", mutates_args=())
def _tree_draft_op(x: torch.Tensor, prev: torch.Tensor, table: torch.Tensor, pairs: torch.Tensor,
                   pair_keys: torch.Tensor, parent: torch.Tensor, grand: torch.Tensor, rank: torch.Tensor,
                   depth: torch.Tensor, levels: int) -> torch.Tensor:
    B, vocab, k = table.shape
    V = parent.shape[0]
    out = torch.empty((B, V), dtype=torch.long, device=x.device)
    if B and V:
        with on_device(x):
            _tree_draft_kernel[(B,)](x, prev, table, pairs, pair_keys, parent, grand, rank, depth, out, x.stride(0),
                                     vocab, V,
                                     K=k, SLOTS=pairs.shape[1], DEPTH=levels,
                                     BLOCK=max(16, triton.next_power_of_2(V)), num_warps=1)
    return out


@_tree_draft_op.register_fake
def _tree_draft_fake(x, prev, table, pairs, pair_keys, parent, grand, rank, depth, levels):
    return x.new_empty((table.shape[0], parent.shape[0]), dtype=torch.long)


def tree_draft(x: torch.Tensor, prev: torch.Tensor, table: torch.Tensor, pairs: torch.Tensor,
               pair_keys: torch.Tensor, parent: torch.Tensor, grand: torch.Tensor, rank: torch.Tensor,
               depth: torch.Tensor, levels: int) -> torch.Tensor:
    """Each row's tree tokens, read off its tables.

    Args:
        x, prev: int64 ``[B]``: each row's ``x`` (any stride: a column of a step's tokens serves) and the token
            before it.
        table: int32 ``[B, vocab, k]``, contiguous: a token's recorded successors, most likely first.
        pairs: int32 ``[B, S, k]``, contiguous (``S`` a power of two): a pair slot's successors.
        pair_keys: int64 ``[B, S]``, contiguous: the pair ``(a, b)`` a slot holds as ``a * vocab + b + 1`` (0:
            none); the slot of ``(a, b)`` is ``(a * PAIR_MUL_A + b * PAIR_MUL_B) & (S - 1)``.
        parent: int32 ``[V]``: each node's parent's index (``-1``: ``x``), below the node's own, in depth-first
            pre-order.
        grand: int32 ``[V]``: each node's grandparent's index, ``X`` (-1) for a child of a child of ``x``,
            ``BEFORE_X`` (-2) for a child of ``x``.
        rank: int32 ``[V]``: which recorded successor a node takes, ``< k``.
        depth: int32 ``[V]``: each node's depth, 1 for a child of ``x``.
        levels: the largest depth (given, not read: a CUDA graph's capture cannot wait for the device).
        All on one device; node arrays of at most 1024 nodes.
    Returns:
        int64 ``[B, V]``: the nodes' tokens.
    Raises:
        ValueError: on other dtypes, shapes or devices, non-contiguous tables, or CPU tensors without Triton's
            interpreter.
    """
    B, V = x.shape[0] if x.dim() == 1 else -1, parent.shape[0] if parent.dim() == 1 else -1
    named = dict(x=x, prev=prev, table=table, pairs=pairs, pair_keys=pair_keys, parent=parent, grand=grand,
                 rank=rank, depth=depth)
    dtypes = dict(x=torch.long, prev=torch.long, table=torch.int32, pairs=torch.int32, pair_keys=torch.long,
                  parent=torch.int32, grand=torch.int32, rank=torch.int32, depth=torch.int32)
    for name, t in named.items():
        if not isinstance(t, torch.Tensor) or t.dtype != dtypes[name] or not (name == "x" or t.is_contiguous()):
            got = f"{t.dtype} contiguous={t.is_contiguous()}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"tree_draft: {name} must be a contiguous {dtypes[name]} tensor, got {got}")
        if t.device != x.device:
            raise ValueError(f"tree_draft: every tensor on x's device ({x.device}), got {name} on {t.device}")
    S = pairs.shape[1] if pairs.dim() == 3 else 0
    if B < 0 or not 0 <= V <= 1024 or tuple(prev.shape) != (B,) or table.dim() != 3 or table.shape[0] != B \
            or tuple(pairs.shape) != (B, S, table.shape[2]) or S < 1 or S & (S - 1) \
            or tuple(pair_keys.shape) != (B, S) or any(tuple(t.shape) != (V,) for t in (grand, rank, depth)):
        raise ValueError("tree_draft: needs x, prev [B], table [B, vocab, k], pairs [B, S, k] (S a power of two), "
                         "pair_keys [B, S] and node arrays [V <= 1024]; got "
                         + ", ".join(f"{name} {tuple(t.shape)}" for name, t in named.items()))
    if x.device.type != "cuda" and not interpreted(_tree_draft_kernel):
        raise ValueError(f"tree_draft: the Triton kernel needs CUDA tensors (or CPU tensors with TRITON_INTERPRET=1 "
                         f"set before lookahead_kernels.tree_draft is imported), got {x.device}")
    if isinstance(levels, bool) or not isinstance(levels, int) or not 0 <= levels <= V:
        raise ValueError(f"tree_draft: levels must be an int in [0, V = {V}], got {levels!r}")
    return _tree_draft_op(x, prev, table, pairs, pair_keys, parent, grand, rank, depth, levels)
