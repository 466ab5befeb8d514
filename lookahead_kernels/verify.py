"""Fused verification of one lookahead step on the draft tree in Triton: greedy (argmax matching) and sampling.

Semantics are those of the torch references in ``verify_ref.py`` (``verify_tree_greedy_reference``,
``verify_tree_sample_reference``), which are the oracle and the CPU path; read their module docstring for the
tree encoding and the rules. Every launch covers all batch rows; nothing synchronises with the host and the
outputs stay on the device.

Greedy is two launches: ``_argmax_partial_kernel`` (grid ``[B, 1 + V, splits]``: each program reduces one slice of
one row's vocabulary, at ``x`` or at a real node, to a (max, first index) pair) and ``_tree_greedy_walk_kernel``
(grid ``[B]``: merges the slices, finds every node's parent from ``end`` and whether its token is the argmax at
its parent, then walks down from ``x`` taking the first matching child). ``row_argmax`` reuses the partial kernel
for other rows (the window's last level) plus a small merge kernel.

Sampling is one launch, ``_tree_sample_walk_kernel`` (grid ``[B]``): the walk is sequential by nature. It reads
one vocabulary row per visited node (for its sum), one token weight per tried child, and for the bonus one more
pass over the row (chunk sums, corrected for the rejected tokens) plus one chunk at token granularity. The
probabilities come from ``lookahead.sampling.warp_logits`` (top-k / top-p warping is not fused). Random numbers
are drawn by the launcher with ``torch.rand`` in the layout of ``draw_tree_uniforms`` and consumed identically by
the reference.

Kernels are torch custom ops that write into given outputs (``lookahead::verify_tree_greedy_out``,
``lookahead::verify_tree_sample_out``, ``lookahead::row_argmax_out``) with fake implementations; the launchers
allocate the outputs unless ``out=`` is passed. On CPU tensors they run only under Triton's interpreter
(``TRITON_INTERPRET=1`` set before this module is imported); otherwise use the references.

``verify_greedy`` / ``verify_sample`` verify the old linear candidates ``[B, G, K]`` on these kernels (linear
candidates as a tree; removed when the decode loop moves to trees).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import interpreted
from .verify_ref import (check_tree_verify_inputs, draw_tree_uniforms,
                         resolve_uniforms)

__all__ = ["verify_tree_greedy", "verify_tree_sample", "row_argmax", "draw_tree_uniforms"]


# ---- kernels -------------------------------------------------------------------------------------------------------
def _device_fn(fn):
    """``triton.jit`` for a device function called by the kernels; under Triton's interpreter the plain function.

    The interpreter re-patches ``triton.language`` on every device-function call (about 2 ms each), which made the
    interpreted kernels several times slower; called as plain Python inside a running kernel, the function sees
    the language already patched and computes the same thing.
    """
    jitted = triton.jit(fn)
    return fn if interpreted(jitted) else jitted


@_device_fn
def _slice_argmax(row_ptr, stride_v, lo, hi, BLOCK_V: tl.constexpr, F64: tl.constexpr):
    """(max, first index of the max) of ``row[lo:hi]``; NaN counts as the largest, as in torch.argmax.

    Each lane keeps its own best (value, first index) over the blocks it loads and the lanes are reduced once at
    the end: three block-wide reductions per block (each a pass through shared memory) kept the programs from
    streaming the logits (35 us for 120 rows of 128256 float32 logits on an H100, 1.8 TB/s).
    """
    lanes = tl.arange(0, BLOCK_V)
    best_val = tl.full([BLOCK_V], float("-inf"), tl.float64 if F64 else tl.float32)
    best_idx = lo + lanes  # a lane that never sees more than -inf keeps its first offset: an all -inf slice gives lo
    best_nan = tl.zeros([BLOCK_V], tl.int32)
    for start in range(lo, hi, BLOCK_V):
        offs = start + lanes
        x = tl.load(row_ptr + offs * stride_v, mask=offs < hi, other=float("-inf"))
        x = x.to(tl.float64) if F64 else x.to(tl.float32)
        is_nan = x != x
        # strict comparison: a lane keeps its earlier index on ties; its first NaN stays
        take = (best_nan == 0) & (is_nan | (x > best_val))
        best_val = tl.where(take, x, best_val)
        best_idx = tl.where(take, offs, best_idx)
        best_nan = tl.where(take & is_nan, 1, best_nan)
    nan_idx = tl.min(tl.where(best_nan != 0, best_idx, hi), axis=0)
    clean = tl.where(best_nan != 0, float("-inf"), best_val)
    m = tl.max(clean, axis=0)
    m_idx = tl.min(tl.where(clean == m, best_idx, hi + BLOCK_V), axis=0)
    any_nan = nan_idx < hi
    return tl.where(any_nan, float("nan"), m), tl.where(any_nan, nan_idx, m_idx)


@triton.jit
def _argmax_partial_kernel(
    # pointers
    x_ptr, c_ptr, n_ptr, val_ptr, idx_ptr,
    # sizes
    G, K, V, n_const, slice_len,
    # strides (elements)
    sxb, sxv, scb, scg, sck, scv,
    # meta-parameters
    HAS_X: tl.constexpr, HAS_N_TENSOR: tl.constexpr, F64: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Program (b, r, s): argmax of vocabulary slice s of row r of batch b into val/idx ``[B, R, S]``.

    With HAS_X row 0 is ``x[b]`` and row ``1 + g*K + k`` is ``c[b, g, k]``; without it row ``g*K + k`` is.
    """
    b = tl.program_id(0)
    r = tl.program_id(1)
    s = tl.program_id(2)
    R = tl.num_programs(1)
    S = tl.num_programs(2)
    out = (b * R + r) * S + s
    lo = s * slice_len
    hi = tl.minimum(lo + slice_len, V)
    if HAS_X:
        rc = r - 1
    else:
        rc = r
    if rc < 0:
        val, idx = _slice_argmax(x_ptr + b.to(tl.int64) * sxb, sxv, lo, hi, BLOCK_V, F64)
        tl.store(val_ptr + out, val.to(tl.float64))
        tl.store(idx_ptr + out, idx.to(tl.int64))
    else:
        g = rc // K
        k = rc % K
        if HAS_N_TENSOR:
            n = tl.load(n_ptr + b)
        else:
            n = n_const
        if g < n:  # rows of unused candidates hold garbage: never read them
            base = c_ptr + b.to(tl.int64) * scb + g.to(tl.int64) * scg + k.to(tl.int64) * sck
            val, idx = _slice_argmax(base, scv, lo, hi, BLOCK_V, F64)
            tl.store(val_ptr + out, val.to(tl.float64))
            tl.store(idx_ptr + out, idx.to(tl.int64))


@_device_fn
def _merge_slices(val_ptr, idx_ptr, offs, mask, S):
    """Merge the S slice results stored at ``offs*S + s`` (slices in vocabulary order, first index wins)."""
    best_val = tl.load(val_ptr + offs * S, mask=mask, other=float("-inf"))
    best_idx = tl.load(idx_ptr + offs * S, mask=mask, other=0)
    for s in range(1, S):
        v = tl.load(val_ptr + offs * S + s, mask=mask, other=float("-inf"))
        i = tl.load(idx_ptr + offs * S + s, mask=mask, other=0)
        take = (best_val == best_val) & ((v != v) | (v > best_val))
        best_val = tl.where(take, v, best_val)
        best_idx = tl.where(take, i, best_idx)
    return best_idx


@triton.jit
def _row_argmax_merge_kernel(val_ptr, idx_ptr, out_ptr, R, S, BLOCK_R: tl.constexpr):
    offs = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask = offs < R
    tl.store(out_ptr + offs, _merge_slices(val_ptr, idx_ptr, offs, mask, S), mask=mask)


@triton.jit
def _tree_greedy_walk_kernel(
    # pointers
    val_ptr, idx_ptr, tok_ptr, end_ptr, n_ptr, acc_ptr, path_ptr, emit_ptr,
    # sizes
    V, n_const, S, A,
    # strides (elements)
    stb, stv, seb, sev, spb, smb,
    # meta-parameters
    HAS_N_TENSOR: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_A: tl.constexpr, CHUNK: tl.constexpr,
):
    """Program b: merge the argmax slices of its rows, walk the tree from x, write the outputs.

    Node i matches when its token is the argmax at its parent (x for a root). Since that argmax depends on the
    parent alone, the walk is: from the current node, move to its first matching child, up to A times.
    """
    b = tl.program_id(0)
    b64 = b.to(tl.int64)
    if HAS_N_TENSOR:
        n = tl.load(n_ptr + b)
    else:
        n = tl.zeros([], tl.int64) + n_const
    n = tl.minimum(tl.maximum(n, 0), V).to(tl.int32)
    base = b * (1 + V)  # row 0 of the partials is x, row 1 + i is node i
    y = tl.sum(_merge_slices(val_ptr, idx_ptr, base + tl.arange(0, 1), tl.full([1], 1, tl.int1), S), axis=0)
    nodes = tl.arange(0, BLOCK_N)
    real = nodes < n
    tok = tl.load(tok_ptr + b64 * stb + nodes * stv, mask=real, other=-1)
    pred = _merge_slices(val_ptr, idx_ptr, base + 1 + nodes, real, S)  # argmax after each real node
    # parent[i]: the largest j < i with end[j] > i (-1 for a root); only real j (a real node's ancestors are real)
    parent = tl.full([BLOCK_N], -1, tl.int32)
    for j0 in range(0, n, CHUNK):
        jj = j0 + tl.arange(0, CHUNK)
        ej = tl.load(end_ptr + b64 * seb + jj * sev, mask=jj < n, other=0)
        inside = (jj[:, None] < nodes[None, :]) & (nodes[None, :] < ej[:, None])
        parent = tl.maximum(parent, tl.max(tl.where(inside, jj[:, None], -1), axis=0))
    has_parent = real & (parent >= 0)
    at_parent = _merge_slices(val_ptr, idx_ptr, base + 1 + parent, has_parent, S)
    match = real & (tok == tl.where(has_parent, at_parent, y))
    av = tl.arange(0, BLOCK_A)
    path = tl.full([BLOCK_A], -1, tl.int64)
    emitted = tl.full([BLOCK_A], -1, tl.int64)
    cur = tl.zeros([], tl.int32) - 1
    acc = tl.zeros([], tl.int32)
    go = acc < A
    # Until a step finds no child: a static graph passes the tree's size as A, and a walk of that many steps
    # would cost every step as much as the deepest tree.
    while go:
        nxt = tl.min(tl.where(match & (parent == cur), nodes, BLOCK_N), axis=0)
        found = nxt < BLOCK_N
        here = (av == acc) & found
        path = tl.where(here, nxt.to(tl.int64), path)
        emitted = tl.where(here, y, emitted)  # the accepted token is the argmax that matched it
        y = tl.where(found, tl.sum(tl.where(nodes == nxt, pred, 0), axis=0), y)
        acc = tl.where(found, acc + 1, acc)
        cur = tl.where(found, nxt, cur)
        go = found & (acc < A)
    emitted = tl.where(av == acc, y, emitted)
    tl.store(path_ptr + b64 * spb + av, path, mask=av < A)
    tl.store(emit_ptr + b64 * smb + av, emitted, mask=av < A + 1)
    tl.store(acc_ptr + b, acc.to(tl.int64))


@_device_fn
def _row_sum(row_ptr, stride_v, V, BLOCK_V: tl.constexpr):
    acc = tl.zeros([BLOCK_V], tl.float64)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        acc += tl.load(row_ptr + offs * stride_v, mask=offs < V, other=0).to(tl.float64)
    return tl.sum(acc, axis=0)


@_device_fn
def _residual_inverse_cdf(row_ptr, stride_v, VOCAB, rej_tok, rej_p, target,
                          BLOCK_V: tl.constexpr, SUB_V: tl.constexpr):
    """``inverse_cdf_sample`` of the row with the rejected tokens zeroed, without a [vocab, rejected] tile.

    ``rej_tok`` ``[BLOCK_N]`` holds the rejected tokens (``-1`` elsewhere) and ``rej_p`` their weights as they were
    subtracted (0 for a repeat, so each distinct token counts once). Pass 1 streams the row in chunks of
    ``BLOCK_V``: a chunk's residual mass is its sum minus the rejected mass inside it, which finds the chunk where
    the residual CDF passes ``target`` (and the last chunk with residual mass, for the rounding fallback). Pass 2
    zeroes the rejected tokens in that one chunk only, ``SUB_V`` tokens at a time, and picks the token.
    """
    rvalid = (rej_tok >= 0) & (rej_tok < VOCAB)
    running = tl.zeros([], tl.float64)
    found_start = tl.zeros([], tl.int32) - 1
    found_base = tl.zeros([], tl.float64)
    last_start = tl.zeros([], tl.int32) - 1
    last_base = tl.zeros([], tl.float64)
    for start in range(0, VOCAB, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        p = tl.load(row_ptr + offs * stride_v, mask=offs < VOCAB, other=0).to(tl.float64)
        in_chunk = rvalid & (rej_tok >= start) & (rej_tok < start + BLOCK_V)
        chunk = tl.sum(p, axis=0) - tl.sum(tl.where(in_chunk, rej_p, 0.0), axis=0)
        npos = tl.sum(tl.where(p > 0, 1, 0), axis=0) - tl.sum(tl.where(in_chunk & (rej_p > 0), 1, 0), axis=0)
        hit = (found_start < 0) & (target < running + chunk)
        found_base = tl.where(hit, running, found_base)
        found_start = tl.where(hit, start, found_start)
        last_base = tl.where(npos > 0, running, last_base)
        last_start = tl.where(npos > 0, start, last_start)
        running += chunk
    use_found = found_start >= 0
    pick = tl.where(use_found, found_start, last_start)
    base = tl.where(use_found, found_base, last_base)
    found = tl.zeros([], tl.int32) + VOCAB
    last_pos = tl.zeros([], tl.int32) - 1
    if pick >= 0:
        for sub in range(0, BLOCK_V, SUB_V):
            offs = pick + sub + tl.arange(0, SUB_V)
            mask = offs < VOCAB
            p = tl.load(row_ptr + offs * stride_v, mask=mask, other=0).to(tl.float64)
            zeroed = tl.max(tl.where(offs[:, None] == rej_tok[None, :], 1, 0), axis=1) > 0
            p = tl.where(zeroed, 0.0, p)
            cdf = base + tl.cumsum(p, axis=0)
            found = tl.minimum(found, tl.min(tl.where(mask & (target < cdf), offs, VOCAB), axis=0))
            last_pos = tl.maximum(last_pos, tl.max(tl.where(p > 0, offs, -1), axis=0))
            base += tl.sum(p, axis=0)
    # the chunk sums and the token CDF round differently: found only counts in the chunk pass 1 chose for it
    return tl.where(use_found & (found < VOCAB), found, last_pos).to(tl.int64)


@triton.jit
def _tree_sample_walk_kernel(
    # pointers
    x_ptr, c_ptr, tok_ptr, end_ptr, n_ptr, u_ptr, acc_ptr, path_ptr, emit_ptr,
    # sizes
    V, VOCAB, n_const, A,
    # strides (elements)
    sxb, sxv, scb, scn, scv, stb, stv, seb, sev, sub, suv, spb, smb,
    # meta-parameters
    HAS_N_TENSOR: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_V: tl.constexpr,
    SUB_V: tl.constexpr,
):
    """Program b: the speculative-sampling walk of ``verify_tree_sample_reference`` for batch row b."""
    b = tl.program_id(0)
    b64 = b.to(tl.int64)
    if HAS_N_TENSOR:
        n = tl.load(n_ptr + b)
    else:
        n = tl.zeros([], tl.int64) + n_const
    n = tl.minimum(tl.maximum(n, 0), V).to(tl.int64)
    nodes = tl.arange(0, BLOCK_N)
    av = tl.arange(0, BLOCK_A)
    path = tl.full([BLOCK_A], -1, tl.int64)
    emitted = tl.full([BLOCK_A], -1, tl.int64)
    # loop-carried scalars are typed tensors (a stride of 1 arrives as a constexpr)
    row = x_ptr + b64 * sxb  # the current distribution; a node's row after each acceptance
    row_sv = tl.zeros([], tl.int64) + sxv
    S = _row_sum(row, row_sv, VOCAB, BLOCK_V)
    c = tl.zeros([], tl.int64)  # the next child to try: the roots start at node 0 ...
    lim = n  # ... and the children of the current node lie below lim
    acc = tl.zeros([], tl.int64)
    rej_tok = tl.full([BLOCK_N], -1, tl.int64)  # by node: the tokens rejected at the current node
    rej_p = tl.zeros([BLOCK_N], tl.float64)  # and the weight each one took away from S
    while (c < lim) & (acc < A):
        t = tl.load(tok_ptr + b64 * stb + c * stv)
        u = tl.load(u_ptr + b64 * sub + c * suv).to(tl.float64)
        e = tl.load(end_ptr + b64 * seb + c * sev)
        seen = tl.max(tl.where(rej_tok == t, 1, 0), axis=0)  # a repeated sibling token: its weight is 0 now
        live = (t >= 0) & (t < VOCAB) & (seen == 0)
        p_t = tl.load(row + t * row_sv, mask=live, other=0).to(tl.float64)
        if u * S < p_t:
            path = tl.where(av == acc, c, path)
            emitted = tl.where(av == acc, t, emitted)
            acc += 1
            row = c_ptr + b64 * scb + c * scn
            row_sv = tl.zeros([], tl.int64) + scv
            S = _row_sum(row, row_sv, VOCAB, BLOCK_V)
            lim = tl.minimum(e, n)
            c = c + 1
            rej_tok = tl.full([BLOCK_N], -1, tl.int64)
            rej_p = tl.zeros([BLOCK_N], tl.float64)
        else:
            S = S - p_t
            rej_tok = tl.where(nodes == c, t, rej_tok)
            rej_p = tl.where(nodes == c, p_t, rej_p)
            c = tl.maximum(e, c + 1)  # the next sibling (max: a malformed end never loops)
    u = tl.load(u_ptr + b64 * sub + V * suv).to(tl.float64)
    bonus = _residual_inverse_cdf(row, row_sv, VOCAB, rej_tok, rej_p, u * S, BLOCK_V, SUB_V)
    emitted = tl.where(av == acc, bonus, emitted)
    tl.store(path_ptr + b64 * spb + av, path, mask=av < A)
    tl.store(emit_ptr + b64 * smb + av, emitted, mask=av < A + 1)
    tl.store(acc_ptr + b, acc)


# ---- launch helpers ------------------------------------------------------------------------------------------------
def _check_device(name: str, t: torch.Tensor) -> None:
    if t.device.type == "cuda":
        return
    if t.device.type == "cpu" and interpreted(_tree_sample_walk_kernel):
        return
    raise ValueError(f"{name}: the Triton kernel needs CUDA tensors (or CPU tensors with TRITON_INTERPRET=1 set "
                     f"before lookahead_kernels.verify is imported), got {t.device}; on CPU use the torch "
                     f"references in lookahead_kernels.verify_ref")


# Logits a vocabulary slice's length is a multiple of.
_SLICE_ALIGN = 16


def _block_v(V: int, device: torch.device, gpu_cap: int = 2048) -> int:
    # The interpreter runs each block as one numpy operation: big blocks are fast there.
    cap = 16384 if device.type == "cpu" else gpu_cap
    return min(cap, max(16, triton.next_power_of_2(V)))


def _block(n: int) -> int:
    return max(2, triton.next_power_of_2(n))


def _vocab_splits(rows: int, V: int, block_v: int, device: torch.device) -> int:
    """Slices per row so that the partial-argmax grid fills the GPU (one slice under the interpreter)."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = triton.cdiv(4 * sms, max(rows, 1))
    return max(1, min(want, triton.cdiv(V, block_v)))


def _vocab_slices(V: int, splits: int) -> tuple[int, int]:
    """``(slice_len, slices)`` for about ``splits`` slices of ``V`` logits: each a multiple of 16 logits long, so
    that the compiler can prove every block's address aligned and load 16 bytes at a time (it loaded 4 at a time
    otherwise, seen in the sm_90 PTX: 128256 logits in 5 slices made slices of 25652); fewer slices than asked
    where rounding up would leave the last ones empty, none empty."""
    slice_len = triton.cdiv(triton.cdiv(V, splits), _SLICE_ALIGN) * _SLICE_ALIGN
    return slice_len, triton.cdiv(V, slice_len)


def _num_nodes_arg(num_nodes, V: int):
    """(tensor or None, int): a tensor is passed through (clamped in the kernel), an int as a constant."""
    if num_nodes is None:
        return None, V
    if isinstance(num_nodes, int):
        return None, num_nodes
    return num_nodes, V


def _argmax_partials(x, c, n_t, n_const, G, K, V, has_x, splits):
    B = c.shape[0]
    rows = (1 if has_x else 0) + G * K
    block_v = _block_v(V, c.device)
    if splits is None:
        splits = _vocab_splits(B * rows, V, block_v, c.device)
    slice_len, splits = _vocab_slices(V, splits)
    vals = torch.empty((B, rows, splits), dtype=torch.float64, device=c.device)
    idxs = torch.empty((B, rows, splits), dtype=torch.int64, device=c.device)
    if B * rows == 0:
        return vals, idxs, splits
    xs = x if has_x else c
    _argmax_partial_kernel[(B, rows, splits)](
        xs, c if c.numel() else xs, n_t if n_t is not None else idxs, vals, idxs,
        G, K, V, n_const, slice_len,
        xs.stride(0), xs.stride(-1), c.stride(0), c.stride(1), c.stride(2), c.stride(3),
        HAS_X=has_x, HAS_N_TENSOR=n_t is not None, F64=c.dtype == torch.float64, BLOCK_V=block_v,
        num_warps=8,  # one program streams a long slice: keep many loads in flight
    )
    return vals, idxs, splits


def _end_strides(end: torch.Tensor):
    """(batch stride, node stride) of ``end`` [V] (one tree for every row: batch stride 0) or [B, V]."""
    return (end.stride(0), end.stride(1)) if end.dim() == 2 else (0, end.stride(0))


# ---- custom ops (write into given outputs: static buffers for CUDA graphs, poisoned buffers in tests) ------------
# An empty tensor is replaced by a dummy of the same element type (never dereferenced): its pointer may be null.
@torch.library.custom_op("lookahead::verify_tree_greedy_out", mutates_args=("accept_len", "path", "emitted"))
def _verify_tree_greedy_op(x_logits: torch.Tensor, node_logits: torch.Tensor, tokens: torch.Tensor,
                           end: torch.Tensor, num_nodes: torch.Tensor | None, n_const: int, max_accept: int,
                           vocab_splits: int, accept_len: torch.Tensor, path: torch.Tensor,
                           emitted: torch.Tensor) -> None:
    B, V = tokens.shape
    vocab = x_logits.shape[1]
    if B == 0:
        return
    # the node rows read as G = V candidates of K = 1 token: the partial kernel skips rows i >= num_nodes
    vals, idxs, splits = _argmax_partials(x_logits, node_logits[:, :, None, :], num_nodes, n_const, V, 1, vocab,
                                          True, vocab_splits if vocab_splits > 0 else None)
    seb, sev = _end_strides(end)
    block_n = _block(V)
    _tree_greedy_walk_kernel[(B,)](
        vals, idxs, tokens if V else accept_len, end if V else accept_len,
        num_nodes if num_nodes is not None else accept_len, accept_len, path if max_accept else accept_len, emitted,
        V, n_const, splits, max_accept,
        tokens.stride(0), tokens.stride(1), seb, sev, path.stride(0), emitted.stride(0),
        HAS_N_TENSOR=num_nodes is not None, BLOCK_N=block_n, BLOCK_A=_block(max_accept + 1),
        CHUNK=min(block_n, 64 if tokens.device.type == "cpu" else 16),
    )


@_verify_tree_greedy_op.register_fake
def _(x_logits, node_logits, tokens, end, num_nodes, n_const, max_accept, vocab_splits, accept_len, path, emitted):
    return None


@torch.library.custom_op("lookahead::verify_tree_sample_out", mutates_args=("accept_len", "path", "emitted"))
def _verify_tree_sample_op(x_probs: torch.Tensor, node_probs: torch.Tensor, tokens: torch.Tensor,
                           end: torch.Tensor, num_nodes: torch.Tensor | None, n_const: int, max_accept: int,
                           uniforms: torch.Tensor, accept_len: torch.Tensor, path: torch.Tensor,
                           emitted: torch.Tensor) -> None:
    B, V = tokens.shape
    vocab = x_probs.shape[1]
    if B == 0:
        return
    seb, sev = _end_strides(end)
    block_n = _block(V)
    block_v = _block_v(vocab, tokens.device)
    # pass 2 of the bonus draw compares a [SUB_V, BLOCK_N] tile of tokens with the rejected ones
    sub_v = min(block_v, max(16, (1 << 20 if tokens.device.type == "cpu" else 4096) // block_n))
    c = node_probs
    _tree_sample_walk_kernel[(B,)](
        x_probs, c if V else x_probs, tokens if V else accept_len, end if V else accept_len,
        num_nodes if num_nodes is not None else accept_len, uniforms, accept_len,
        path if max_accept else accept_len, emitted,
        V, vocab, n_const, max_accept,
        x_probs.stride(0), x_probs.stride(1), c.stride(0), c.stride(1), c.stride(2),
        tokens.stride(0), tokens.stride(1), seb, sev, uniforms.stride(0), uniforms.stride(1),
        path.stride(0), emitted.stride(0),
        HAS_N_TENSOR=num_nodes is not None, BLOCK_N=block_n, BLOCK_A=_block(max_accept + 1), BLOCK_V=block_v,
        SUB_V=sub_v, num_warps=8,
    )


@_verify_tree_sample_op.register_fake
def _(x_probs, node_probs, tokens, end, num_nodes, n_const, max_accept, uniforms, accept_len, path, emitted):
    return None


@torch.library.custom_op("lookahead::row_argmax_out", mutates_args=("out",))
def _row_argmax_op(logits: torch.Tensor, vocab_splits: int, out: torch.Tensor) -> None:
    R, V = logits.shape
    if R == 0:
        return
    c = logits[None, :, None, :]  # [1, R, 1, V]: the rows read as candidates g = 0..R-1 with K = 1
    vals, idxs, splits = _argmax_partials(None, c, None, R, R, 1, V, False,
                                          vocab_splits if vocab_splits > 0 else None)
    block_r = 128
    _row_argmax_merge_kernel[(triton.cdiv(R, block_r),)](vals, idxs, out, R, splits, BLOCK_R=block_r)


@_row_argmax_op.register_fake
def _(logits, vocab_splits, out):
    return None


# ---- public launchers ----------------------------------------------------------------------------------------------
def _check_splits(name: str, vocab_splits) -> int:
    if vocab_splits is None:
        return 0
    if isinstance(vocab_splits, bool) or not isinstance(vocab_splits, int) or vocab_splits < 1:
        raise ValueError(f"{name}: vocab_splits must be None or an int >= 1, got {vocab_splits!r}")
    return vocab_splits


def _outputs(name: str, out, B: int, max_accept: int, device):
    """The ``(accept_len [B], path [B, A], emitted [B, A+1])`` int64 outputs: ``out`` checked, or fresh ones."""
    shapes = ((B,), (B, max_accept), (B, max_accept + 1))
    if out is None:
        return tuple(torch.empty(s, dtype=torch.int64, device=device) for s in shapes)
    if not isinstance(out, (tuple, list)) or len(out) != 3 or not all(
            isinstance(t, torch.Tensor) and tuple(t.shape) == s and t.dtype == torch.int64 and t.device == device
            for t, s in zip(out, shapes)):
        raise ValueError(f"{name}: out must be a tuple of three int64 tensors on {device} shaped [B], "
                         f"[B, max_accept], [B, max_accept + 1] = {[list(s) for s in shapes]}")
    if out[0].stride(0) != 1 or (max_accept and out[1].stride(1) != 1) or out[2].stride(1) != 1:
        raise ValueError(f"{name}: out tensors must be contiguous along their last dimension")
    return tuple(out)


def verify_tree_greedy(x_logits: torch.Tensor, node_logits: torch.Tensor, tokens: torch.Tensor,
                       end: torch.Tensor, num_nodes: torch.Tensor | int | None, max_accept: int, *,
                       vocab_splits: int | None = None,
                       out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None):
    """Greedy verification of a token tree on the GPU, exactly ``verify_tree_greedy_reference`` (see it).

    Args:
        x_logits: ``[B, vocab]`` float16/bfloat16/float32/float64 logits at ``x`` (any strides, e.g. a view of the
            model's ``[B, T, vocab]`` output).
        node_logits: ``[B, V, vocab]`` same dtype, logits at each node (any strides).
        tokens: ``[B, V]`` int64 node tokens (ids outside the vocabulary never match).
        end: ``[V]`` or ``[B, V]`` int64 subtree ends (``TreeShape.end``).
        num_nodes: int64 ``[B]`` real nodes per row (clamped to ``0..V`` on the GPU), an int, or ``None`` (all).
            Rows of padding nodes are never read, so they may hold anything (NaN included).
        max_accept: the most nodes accepted (``>= 0``; at least the tree's depth in normal use).
        vocab_splits: how many programs share one row's argmax (default: enough to fill the GPU; 1 on CPU); fewer
            where slices of whole multiples of 16 logits need fewer.
        out: optional ``(accept_len, path, emitted)`` to write into (e.g. static buffers for a CUDA graph).
    Returns:
        ``accept_len`` int64 ``[B]``; ``path`` int64 ``[B, max_accept]`` (accepted nodes, then ``-1``);
        ``emitted`` int64 ``[B, max_accept + 1]`` (accepted tokens, the bonus, then ``-1``). Argmax picks the
        first index among equal maxima and treats NaN as the largest, like ``torch.argmax``. Two launches, no
        host sync.
    """
    name = "verify_tree_greedy"
    check_tree_verify_inputs(name, x_logits, node_logits, tokens, end, num_nodes, max_accept)
    _check_device(name, tokens)
    splits = _check_splits(name, vocab_splits)
    B, V = tokens.shape
    n_t, n_const = _num_nodes_arg(num_nodes, V)
    outs = _outputs(name, out, B, max_accept, tokens.device)
    _verify_tree_greedy_op(x_logits, node_logits, tokens, end, n_t, n_const, max_accept, splits, *outs)
    return outs


def verify_tree_sample(x_probs: torch.Tensor, node_probs: torch.Tensor, tokens: torch.Tensor, end: torch.Tensor,
                       num_nodes: torch.Tensor | int | None, max_accept: int, uniforms: torch.Tensor | None = None,
                       generator: torch.Generator | None = None, *,
                       out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None):
    """Speculative sampling on a token tree on the GPU, exactly ``verify_tree_sample_reference`` given the same
    uniforms (up to float64 rounding of sums over the vocabulary).

    Args:
        x_probs: ``[B, vocab]`` float16/bfloat16/float32/float64 nonnegative weights at ``x`` (``warp_logits``
            output; rows need not be normalised; any strides).
        node_probs: ``[B, V, vocab]`` same dtype, the weights after each node (any strides).
        tokens, end, num_nodes, max_accept: as ``verify_tree_greedy``.
        uniforms: float64 (or float32) ``[B, V+1]`` in ``[0, 1)``, layout of ``draw_tree_uniforms``; drawn on the
            tensors' device with ``generator`` when ``None``.
        out: optional ``(accept_len, path, emitted)`` to write into.
    Returns:
        As ``verify_tree_greedy`` (a bonus of ``-1`` flags a distribution without positive mass, i.e. invalid
        probabilities). One launch (plus the ``torch.rand`` when drawing), no host sync.
    """
    name = "verify_tree_sample"
    check_tree_verify_inputs(name, x_probs, node_probs, tokens, end, num_nodes, max_accept)
    _check_device(name, tokens)
    B, V = tokens.shape
    uniforms = resolve_uniforms(name, uniforms, generator, B, V, tokens.device)
    n_t, n_const = _num_nodes_arg(num_nodes, V)
    outs = _outputs(name, out, B, max_accept, tokens.device)
    _verify_tree_sample_op(x_probs, node_probs, tokens, end, n_t, n_const, max_accept, uniforms, *outs)
    return outs


def row_argmax(logits: torch.Tensor, *, vocab_splits: int | None = None, out: torch.Tensor | None = None):
    """Argmax of each row of ``logits`` ``[R, V]`` (float16/bfloat16/float32/float64, any strides) on the GPU.

    For the rows of the window's last level in greedy decoding. Returns int64 ``[R]`` (written into ``out`` if
    given); first index among equal maxima, NaN counts as the largest (as ``torch.argmax``, its reference).
    Two launches, no host sync.
    """
    name = "row_argmax"
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.shape[1] < 1:
        raise ValueError(f"{name}: logits must be a tensor [R, V] with V >= 1, got "
                         f"{list(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__}")
    if logits.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise ValueError(f"{name}: logits must be float16, bfloat16, float32 or float64, got {logits.dtype}")
    _check_device(name, logits)
    R = logits.shape[0]
    if out is None:
        out = torch.empty((R,), dtype=torch.int64, device=logits.device)
    elif not (isinstance(out, torch.Tensor) and tuple(out.shape) == (R,) and out.dtype == torch.int64
              and out.device == logits.device and out.stride(0) == 1):
        raise ValueError(f"{name}: out must be a contiguous int64 tensor [{R}] on {logits.device}")
    _row_argmax_op(logits, _check_splits(name, vocab_splits), out)
    return out
