"""Torch references for attention under the lookahead step's visibility rule.

* :func:`attention_torch` is the CPU path of the model and the baseline the kernel must match: the step's
  ``[T, T]`` rule, all of the committed prefix, one fused ``scaled_dot_product_attention`` call per group of
  sequences. :class:`StepAttention` is the same with the per-step work (the rule, the masks) done once, which
  the model's forward uses for all its layers.
* :func:`attention_dense_reference` is the test oracle: it builds the full dense mask from the same rule and
  runs plain softmax attention (in float64 when asked), so it shares nothing with the fast paths but the rule.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .layout import StepLayout


def check_attention_args(q, k_cache, v_cache, cache_len, layout: StepLayout) -> torch.Tensor:
    """Validate the arguments shared by every attention implementation; returns ``cache_len`` as ``[B]`` int64.

    Raises ``ValueError`` naming what is wrong and what is allowed.
    """
    if not isinstance(layout, StepLayout):
        raise ValueError(f"layout must be a StepLayout, got {type(layout).__name__}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a 4-D tensor, got {shape}")
    B, T, Hq, D = q.shape
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must have one shape")
    Bk, S, Hkv, Dk = k_cache.shape
    if Bk != B or Dk != D:
        raise ValueError(f"k_cache must be [B={B}, S, Hkv, D={D}], got {tuple(k_cache.shape)}")
    if Hq % Hkv != 0:
        raise ValueError(f"query heads ({Hq}) must be a multiple of key/value heads ({Hkv})")
    if T != layout.T:
        raise ValueError(f"q has {T} tokens but the layout {layout} has T={layout.T}")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"q, k_cache, v_cache must share a dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if not (q.device == k_cache.device == v_cache.device):
        raise ValueError(f"q, k_cache, v_cache must be on one device, got {q.device}, {k_cache.device}, {v_cache.device}")
    if B == 0:
        raise ValueError("q has a batch of 0 sequences; at least one is needed")
    if layout.tree is not None and layout.tree.batched and layout.tree.end.shape[0] != B:
        raise ValueError(f"the layout's per-sequence tree has {layout.tree.end.shape[0]} rows but q has a batch "
                         f"of {B}")
    if isinstance(cache_len, bool):
        raise ValueError("cache_len must be an int or an integer tensor [B]")
    if isinstance(cache_len, int):
        lens = torch.full((B,), cache_len, dtype=torch.int64)
    elif isinstance(cache_len, torch.Tensor) and not cache_len.is_floating_point() and cache_len.dtype != torch.bool:
        if cache_len.dim() == 0:
            lens = cache_len.reshape(1).expand(B)
        elif cache_len.shape == (B,):
            lens = cache_len
        else:
            raise ValueError(f"cache_len tensor must have shape [B={B}], got {tuple(cache_len.shape)}")
    else:
        raise ValueError(f"cache_len must be an int or an integer tensor [B], got {cache_len!r}")
    # Host-side values are checked before they move; reading a device tensor back would cost a sync.
    if lens.device.type == "cpu":
        if int(lens.min()) < 0:
            raise ValueError(f"cache_len must be >= 0, got {lens.tolist()}")
        if int(lens.max()) + T > S:
            raise ValueError(f"cache too short: cache_len {int(lens.max())} + T {T} > S {S} rows")
    return lens.to(device=q.device, dtype=torch.int64)


def step_block(layout: StepLayout, batch_size: int, device) -> torch.Tensor:
    """BoolTensor ``[T, T]`` (``[B, T, T]`` with a tree per sequence): whether step token ``q`` sees step token
    ``k`` under the layout's rule (the committed prefix, visible to all, is not part of it).

    Built by parts: the lookahead branch by the rule's index arithmetic, ``x`` seen by every token, and each tree
    node seeing its own ancestors (the tree's ancestor matrix). The rule evaluated over all ``[T, T]`` pairs took
    220-440 us a forward at a CPU step's few tokens (1% of the step); :func:`step_block_by_rule` is that
    evaluation, kept as the tests' oracle."""
    T, la, V = layout.T, layout.lookahead_len, layout.tree_size
    if T == 1:
        return torch.ones(1, 1, dtype=torch.bool, device=device)
    if V == 0:  # the lookahead branch alone: the rule's index arithmetic is all there is
        return step_block_by_rule(layout, batch_size, device)
    from .tree import ancestor_matrix

    batched = layout.tree.batched
    end = layout.tree.end.to(device)
    block = torch.zeros(end.shape[0] if batched else 1, T, T, dtype=torch.bool, device=device)
    if la > 1:  # the rule's lookahead part alone (a layout without the tree: no tree lookups)
        block[:, :la, :la] = step_block_by_rule(StepLayout(layout.window, layout.levels), batch_size, device)
    block[:, :, 0] = True
    # [B or 1, V, V]: [j, i] says node j is node i or one of its ancestors; a query row i sees those j.
    block[:, la:, la:] = ancestor_matrix(end if batched else end[None]).transpose(-1, -2)
    return block if batched else block[0]


def step_block_by_rule(layout: StepLayout, batch_size: int, device) -> torch.Tensor:
    """:func:`step_block` by :meth:`StepLayout.visible` over every pair of step tokens (per sequence with a tree
    per sequence)."""
    idx = torch.arange(layout.T, device=device)
    if layout.tree is not None and layout.tree.batched and layout.tree_size:
        return torch.stack([layout.visible(idx[:, None], idx[None, :], b) for b in range(batch_size)])
    return layout.visible(idx[:, None], idx[None, :])


class StepAttention:
    """:func:`attention_torch` for one step, with the work every layer shares done once.

    The step's ``[T, T]`` visibility (one ``layout.visible`` call), the grouping of sequences by ``cache_len``
    and the masks depend on the step only, so a model builds this once per forward and calls it per layer::

        attend = StepAttention(layout, cache_len, batch_size, device)
        out = attend(q, k_cache, v_cache)        # == attention_torch(q, ..., cache_len=..., layout=layout)

    Each group of sequences with one ``cache_len`` ``n`` is one ``scaled_dot_product_attention`` call over rows
    ``0 .. n+T-1`` under the mask ``[T, n+T]`` = (prefix all visible | the step's rule); no mask at all when the
    rule lets every step token see every other one (a single decode token).
    """

    def __init__(self, layout: StepLayout, cache_len, batch_size: int, device):
        if not isinstance(layout, StepLayout):
            raise ValueError(f"layout must be a StepLayout, got {type(layout).__name__}")
        self.layout = layout
        T = layout.T
        block = step_block(layout, batch_size, device)
        if isinstance(cache_len, int):
            lens = [cache_len] * batch_size
        else:
            lens = cache_len.reshape(-1).expand(batch_size).tolist() if cache_len.dim() == 0 or \
                cache_len.numel() == 1 else cache_len.tolist()
        # Sequences with different cache_len are handled one by one (this is the CPU path).
        if all(n == lens[0] for n in lens):
            groups = [(slice(0, batch_size), lens[0])]
        else:
            groups = [(slice(b, b + 1), n) for b, n in enumerate(lens)]
        everything = bool(block.all())
        # A row that sees no key at all (only possible with no prefix) gets zeros, not softmax's NaN.
        blind = None if bool(block.any(-1).all()) else ~block.any(-1)
        self.groups = []
        for rows, n in groups:
            if everything:
                mask = None
            elif block.dim() == 3:  # [b, 1, T, n+T]: one mask per sequence, shared by the heads
                part = block[rows]
                mask = torch.cat((torch.ones(part.shape[0], T, n, dtype=torch.bool, device=device), part),
                                 dim=2)[:, None]
            else:
                mask = torch.cat((torch.ones(T, n, dtype=torch.bool, device=device), block), dim=1)
            row_blind = None
            if blind is not None and n == 0:
                row_blind = blind[rows] if blind.dim() == 2 else blind[None]
            self.groups.append((rows, n, mask, row_blind))

    def __call__(self, q, k_cache, v_cache, *, cache_len=None, layout=None, sm_scale=None):
        """Attention of ``q [B, T, Hq, D]`` over ``k_cache, v_cache [B, S, Hkv, D]``; ``[B, T, Hq, D]`` in q's dtype.

        ``cache_len`` and ``layout``, when given (as an :data:`AttentionFn` caller does), must be the ones this
        was built for; only ``layout`` identity is checked, the rest was checked when the step was built.
        """
        if layout is not None and layout is not self.layout:
            raise ValueError("StepAttention called with a different layout than it was built for")
        B, T, Hq, D = q.shape
        Hkv = k_cache.shape[2]
        scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(D)
        cdtype = q.dtype if q.dtype in (torch.float32, torch.float64) else torch.float32
        if len(self.groups) == 1:
            return self._group(q, k_cache, v_cache, self.groups[0], T, Hq, Hkv, scale, cdtype)
        out = torch.empty_like(q)
        for group in self.groups:
            rows = group[0]
            out[rows] = self._group(q[rows], k_cache[rows], v_cache[rows], group, T, Hq, Hkv, scale, cdtype)
        return out

    @staticmethod
    def _group(q, k_cache, v_cache, group, T, Hq, Hkv, scale, cdtype):
        _, n, mask, blind = group
        qb = q.to(cdtype).transpose(1, 2)  # [b, Hq, T, D]
        kb = k_cache[:, :n + T].to(cdtype).transpose(1, 2)  # [b, Hkv, n+T, D]
        vb = v_cache[:, :n + T].to(cdtype).transpose(1, 2)
        o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale, enable_gqa=Hq != Hkv)
        o = o.transpose(1, 2)  # [b, T, Hq, D]
        if blind is not None:
            o = o.masked_fill(blind[:, :, None, None], 0.0)
        return o.to(q.dtype)


def attention_torch(q, k_cache, v_cache, *, cache_len, layout: StepLayout, sm_scale=None):
    """Attention for one step, plain torch, without a mask over the prefix.

    Args:
        q: ``[B, T, Hq, D]`` queries (rotary applied), ``T == layout.T``.
        k_cache, v_cache: ``[B, S, Hkv, D]``; the step's keys/values already at rows ``cache_len .. +T-1``.
        cache_len: int or integer tensor ``[B]``: committed rows per sequence.
        layout: the step's :class:`StepLayout`.
        sm_scale: softmax scale, default ``1/sqrt(D)``.
    Returns:
        ``[B, T, Hq, D]`` in ``q``'s dtype. Low-precision inputs are computed in float32.
    """
    lens = check_attention_args(q, k_cache, v_cache, cache_len, layout)
    step = StepAttention(layout, lens.cpu(), q.shape[0], q.device)
    return step(q, k_cache, v_cache, sm_scale=sm_scale)


def dense_mask(layout: StepLayout, cache_len: int, kv_len: int, device=None, b: int = 0) -> torch.Tensor:
    """BoolTensor ``[T, kv_len]`` of the rule over cache rows for sequence ``b`` (test oracle only)."""
    q_idx = torch.arange(layout.T, device=device)[:, None]
    kv_idx = torch.arange(kv_len, device=device)[None, :]
    mod = layout.mask_mod(torch.full((b + 1,), cache_len, device=device))
    return mod(torch.tensor(b, device=device), None, q_idx, kv_idx)


def attention_dense_reference(q, k_cache, v_cache, *, cache_len, layout: StepLayout, sm_scale=None,
                              dtype=torch.float64):
    """Oracle: dense mask from the rule plus softmax attention in ``dtype`` (float64 by default).

    Same arguments as :func:`attention_torch`; returns ``[B, T, Hq, D]`` in ``dtype``.
    """
    lens = check_attention_args(q, k_cache, v_cache, cache_len, layout)
    B, T, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(D)
    out = torch.empty(B, T, Hq, D, dtype=dtype, device=q.device)
    for b in range(B):
        n = int(lens[b])
        kv = n + T
        mask = dense_mask(layout, n, kv, device=q.device, b=b)  # [T, kv]
        k = k_cache[b, :kv].to(dtype).repeat_interleave(Hq // Hkv, dim=1)  # [kv, Hq, D]
        v = v_cache[b, :kv].to(dtype).repeat_interleave(Hq // Hkv, dim=1)
        s = torch.einsum("thd,khd->htk", q[b].to(dtype), k) * scale
        s = s.masked_fill(~mask[None], float("-inf"))
        out[b] = torch.einsum("htk,khd->thd", torch.softmax(s, dim=-1), v)
    return out
