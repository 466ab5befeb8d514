"""Fused verification of one lookahead step in Triton: greedy (argmax matching) and speculative sampling.

Semantics are those of the torch references in ``verify_ref.py`` (``verify_greedy_reference``,
``verify_sample_reference``), which are the oracle and the CPU path. Every launch covers all candidates of all
batch rows; nothing synchronises with the host and the outputs stay on the device.

Greedy is two launches: ``_argmax_partial_kernel`` (grid ``[B, 1 + G*K, splits]``: each program reduces one
slice of one row's vocabulary to a (max, first index) pair) and ``_greedy_walk_kernel`` (grid ``[B]``: merges the
slices, matches candidates against the argmaxes, writes the outputs). ``row_argmax`` reuses the partial kernel
for other rows (the window's last level) plus a small merge kernel.

Sampling is one launch, ``_sample_walk_kernel`` (grid ``[B]``): the walk is sequential by nature; it reads one
vocabulary row per depth (for its sum) and one more for the bonus draw. The probabilities come from
``lookahead.sampling.warp_logits`` (top-k / top-p warping is not fused). Random numbers are drawn by the launcher
with ``torch.rand`` in the layout of ``draw_verify_uniforms`` and consumed identically by the reference.

Kernels are torch custom ops that write into given outputs (``lookahead::verify_greedy_out``,
``lookahead::verify_sample_out``, ``lookahead::row_argmax_out``) with fake implementations; the launchers
allocate the outputs unless ``out=`` is passed. On CPU tensors they run only under Triton's interpreter
(``TRITON_INTERPRET=1`` set before this module is imported); otherwise use the references.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .verify_ref import check_verify_inputs, check_verify_uniforms, draw_verify_uniforms

__all__ = ["verify_greedy", "verify_sample", "row_argmax"]


# ---- kernels -------------------------------------------------------------------------------------------------------
@triton.jit
def _slice_argmax(row_ptr, stride_v, lo, hi, BLOCK_V: tl.constexpr, F64: tl.constexpr):
    """(max, first index of the max) of ``row[lo:hi]``; NaN counts as the largest, as in torch.argmax."""
    best_val = tl.full([], float("-inf"), tl.float64 if F64 else tl.float32)
    best_idx = tl.zeros([], tl.int32) + lo
    best_nan = tl.zeros([], tl.int32)
    for start in range(lo, hi, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        mask = offs < hi
        x = tl.load(row_ptr + offs * stride_v, mask=mask, other=float("-inf"))
        x = x.to(tl.float64) if F64 else x.to(tl.float32)
        is_nan = x != x
        nan_idx = tl.min(tl.where(is_nan & mask, offs, hi), axis=0)
        clean = tl.where(is_nan, float("-inf"), x)
        m = tl.max(clean, axis=0)
        # masked lanes are -inf and sit after every valid lane, so the min picks a valid index
        m_idx = tl.min(tl.where(clean == m, offs, hi), axis=0)
        chunk_nan = nan_idx < hi
        # strict comparison: an earlier chunk keeps its index on ties (first-index rule)
        take = (best_nan == 0) & (chunk_nan | (m > best_val))
        best_idx = tl.where(take, tl.where(chunk_nan, nan_idx, m_idx), best_idx)
        best_val = tl.where(take, tl.where(chunk_nan, float("nan"), m), best_val)
        best_nan = tl.where(take & chunk_nan, 1, best_nan)
    return best_val, best_idx


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


@triton.jit
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
def _greedy_walk_kernel(
    # pointers
    val_ptr, idx_ptr, cand_ptr, n_ptr, acc_ptr, best_ptr, tok_ptr,
    # sizes
    G, K, n_const, S,
    # strides (elements)
    stb, stg, stk, sob,
    # meta-parameters
    HAS_N_TENSOR: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Program b: merge the argmax slices of its rows, find the longest accepted candidate, write the outputs."""
    b = tl.program_id(0)
    R = 1 + G * K
    if HAS_N_TENSOR:
        n = tl.load(n_ptr + b)
    else:
        n = n_const
    n = tl.minimum(tl.maximum(n, 0), G)
    y0 = _merge_slices(val_ptr, idx_ptr, b * R + tl.arange(0, 1), tl.full([1], 1, tl.int1), S)
    y0 = tl.sum(y0, axis=0)
    g = tl.arange(0, BLOCK_G)[:, None]
    k = tl.arange(0, BLOCK_K)[None, :]
    real = (g < n) & (k < K)
    cand = tl.load(cand_ptr + b.to(tl.int64) * stb + g * stg + k * stk, mask=real, other=-1)
    # target[g, k]: the argmax where candidates[g, k] stands, i.e. after candidates[g, k-1] (x for k = 0)
    prev = (g < n) & (k >= 1) & (k < K)
    target = _merge_slices(val_ptr, idx_ptr, b * R + 1 + g * K + (k - 1), prev, S)
    target = tl.where(k == 0, y0, target)
    miss = real & (cand != target)
    length = tl.min(tl.where(miss, k, K), axis=1)  # [BLOCK_G]: first mismatch
    gv = tl.arange(0, BLOCK_G)
    length = tl.where(gv < n, length, -1)
    acc = tl.maximum(tl.max(length, axis=0), 0)
    best = tl.min(tl.where(length == acc, gv, BLOCK_G), axis=0)
    best = tl.where(acc > 0, best, -1)
    # tokens: the best candidate's first acc tokens, then the bonus (argmax after its last accepted token)
    kk = tl.arange(0, BLOCK_K)
    bc = tl.maximum(best, 0)
    toks = tl.load(cand_ptr + b.to(tl.int64) * stb + bc * stg + kk * stk, mask=kk < acc, other=-1)
    bonus_row = b * R + 1 + bc * K + tl.maximum(acc - 1, 0)
    # masked when nothing is accepted: with G = 0 that row does not exist
    bonus = _merge_slices(val_ptr, idx_ptr, bonus_row + tl.arange(0, 1), tl.full([1], 1, tl.int1) & (acc > 0), S)
    bonus = tl.where(acc > 0, tl.sum(bonus, axis=0), y0)
    toks = tl.where(kk == acc, bonus, toks)
    tl.store(tok_ptr + b * sob + kk, toks, mask=kk < K + 1)
    tl.store(acc_ptr + b, acc.to(tl.int64))
    tl.store(best_ptr + b, best.to(tl.int64))


@triton.jit
def _row_sum(row_ptr, stride_v, V, BLOCK_V: tl.constexpr):
    acc = tl.zeros([BLOCK_V], tl.float64)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        acc += tl.load(row_ptr + offs * stride_v, mask=offs < V, other=0).to(tl.float64)
    return tl.sum(acc, axis=0)


@triton.jit
def _inverse_cdf(row_ptr, stride_v, V, rej, target, BLOCK_V: tl.constexpr):
    """Smallest i with target < CDF(i) of the row with the tokens in ``rej`` zeroed (see inverse_cdf_sample)."""
    running = tl.zeros([], tl.float64)
    found = tl.zeros([], tl.int32) + V
    last_pos = tl.zeros([], tl.int32) - 1
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        mask = offs < V
        p = tl.load(row_ptr + offs * stride_v, mask=mask, other=0).to(tl.float64)
        zeroed = tl.max(tl.where(offs[:, None] == rej[None, :], 1, 0), axis=1) > 0
        p = tl.where(zeroed, 0.0, p)
        cdf = running + tl.cumsum(p, axis=0)
        found = tl.minimum(found, tl.min(tl.where(mask & (target < cdf), offs, V), axis=0))
        last_pos = tl.maximum(last_pos, tl.max(tl.where(p > 0, offs, -1), axis=0))
        running = tl.max(cdf, axis=0)
    return tl.where(found < V, found, last_pos).to(tl.int64)


@triton.jit
def _sample_walk_kernel(
    # pointers
    x_ptr, c_ptr, cand_ptr, n_ptr, u_ptr, acc_ptr, best_ptr, tok_ptr,
    # sizes
    G, K, V, n_const,
    # strides (elements)
    sxb, sxv, scb, scg, sck, scv, stb, stg, stk, sub, suk, sug, sob,
    # meta-parameters
    HAS_N_TENSOR: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_K1: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Program b: the speculative-sampling walk of ``verify_sample_reference`` for batch row b."""
    b = tl.program_id(0)
    b64 = b.to(tl.int64)
    if HAS_N_TENSOR:
        n = tl.load(n_ptr + b)
    else:
        n = n_const
    n = tl.minimum(tl.maximum(n, 0), G)
    gv = tl.arange(0, BLOCK_G)
    kv = tl.arange(0, BLOCK_K1)
    live = gv < n
    out = tl.full([BLOCK_K1], -1, tl.int64)
    # loop-carried scalars are typed tensors (a stride of 1 arrives as a constexpr)
    row = x_ptr + b64 * sxb  # current distribution; becomes a candidate row after each acceptance
    row_sv = tl.zeros([], tl.int64) + sxv
    active = tl.zeros([], tl.int32) + 1
    acc_len = tl.zeros([], tl.int32)
    best = tl.zeros([], tl.int32) - 1
    no_rej = tl.full([BLOCK_G], -1, tl.int64)
    for d in range(0, K):
        if active != 0:
            S = _row_sum(row, row_sv, V, BLOCK_V)
            # gather every live candidate's token, weight and uniform at once: the sequential tries below
            # then run on registers instead of a chain of dependent global loads
            toks_d = tl.load(cand_ptr + b64 * stb + gv * stg + d * stk, mask=live, other=-1)
            in_vocab = live & (toks_d >= 0) & (toks_d < V)
            p_d = tl.load(row + toks_d * row_sv, mask=in_vocab, other=0).to(tl.float64)
            u_d = tl.load(u_ptr + b64 * sub + d * suk + gv * sug, mask=live, other=1.0).to(tl.float64)
            rej = no_rej  # tokens rejected at this depth (their weight is now 0)
            acc_c = tl.zeros([], tl.int32) - 1
            acc_t = tl.zeros([], tl.int64) - 1
            for c in range(0, G):
                here = gv == c
                is_live = tl.max(tl.where(here & live, 1, 0), axis=0)
                if (is_live != 0) & (acc_c < 0):
                    t = tl.sum(tl.where(here, toks_d, 0), axis=0)
                    u = tl.sum(tl.where(here, u_d, 0.0), axis=0)
                    seen = tl.max(tl.where(rej == t, 1, 0), axis=0)
                    p_t = tl.where(seen == 0, tl.sum(tl.where(here, p_d, 0.0), axis=0), 0.0)
                    if u * S < p_t:
                        acc_c = tl.zeros([], tl.int32) + c
                        acc_t = t.to(tl.int64)
                    else:
                        S = S - p_t
                        rej = tl.where(here, t, rej)
            if acc_c >= 0:
                out = tl.where(kv == d, acc_t, out)
                best = acc_c
                acc_len = tl.zeros([], tl.int32) + d + 1
                live = live & (toks_d == acc_t)
                row = c_ptr + b64 * scb + acc_c * scg + d * sck
                row_sv = tl.zeros([], tl.int64) + scv
            else:
                active = tl.zeros([], tl.int32)
                u = tl.load(u_ptr + b64 * sub + d * suk + G * sug).to(tl.float64)
                bonus = _inverse_cdf(row, row_sv, V, rej, u * S, BLOCK_V)
                out = tl.where(kv == d, bonus, out)
    if active != 0:  # all K accepted: the bonus comes from the distribution after the last one
        S = _row_sum(row, row_sv, V, BLOCK_V)
        u = tl.load(u_ptr + b64 * sub + (K - 1) * suk + G * sug).to(tl.float64)
        bonus = _inverse_cdf(row, row_sv, V, no_rej, u * S, BLOCK_V)
        out = tl.where(kv == K, bonus, out)
    tl.store(tok_ptr + b64 * sob + kv, out, mask=kv < K + 1)
    tl.store(acc_ptr + b, acc_len.to(tl.int64))
    tl.store(best_ptr + b, best.to(tl.int64))


# ---- launch helpers ------------------------------------------------------------------------------------------------
def _interpreted() -> bool:
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover - every supported Triton has it
        return False
    return isinstance(_sample_walk_kernel, InterpretedFunction)


def _check_device(name: str, t: torch.Tensor) -> None:
    if t.device.type == "cuda":
        return
    if t.device.type == "cpu" and _interpreted():
        return
    raise ValueError(f"{name}: the Triton kernel needs CUDA tensors (or CPU tensors with TRITON_INTERPRET=1 set "
                     f"before lookahead_kernels.verify is imported), got {t.device}; on CPU use the torch "
                     f"references in lookahead_kernels.verify_ref")


def _block_v(V: int, device: torch.device, gpu_cap: int = 2048) -> int:
    # The interpreter runs each block as one numpy operation: big blocks are fast there.
    cap = 16384 if device.type == "cpu" else gpu_cap
    return min(cap, max(16, triton.next_power_of_2(V)))


def _vocab_splits(rows: int, V: int, block_v: int, device: torch.device) -> int:
    """Slices per row so that the partial-argmax grid fills the GPU (one slice under the interpreter)."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = triton.cdiv(4 * sms, max(rows, 1))
    return max(1, min(want, triton.cdiv(V, block_v)))


def _num_candidates_arg(num_candidates, G: int):
    """(tensor or None, int): a tensor is passed through (clamped in the kernel), an int as a constant."""
    if num_candidates is None:
        return None, G
    if isinstance(num_candidates, int):
        return None, num_candidates
    return num_candidates, G


def _argmax_partials(x, c, n_t, n_const, G, K, V, has_x, splits):
    B = c.shape[0]
    rows = (1 if has_x else 0) + G * K
    block_v = _block_v(V, c.device)
    if splits is None:
        splits = _vocab_splits(B * rows, V, block_v, c.device)
    slice_len = triton.cdiv(V, splits)
    vals = torch.empty((B, rows, splits), dtype=torch.float64, device=c.device)
    idxs = torch.empty((B, rows, splits), dtype=torch.int64, device=c.device)
    if B * rows == 0:
        return vals, idxs, splits
    xs = x if has_x else c
    _argmax_partial_kernel[(B, rows, splits)](
        xs, c, n_t if n_t is not None else idxs, vals, idxs,
        G, K, V, n_const, slice_len,
        xs.stride(0), xs.stride(-1), c.stride(0), c.stride(1), c.stride(2), c.stride(3),
        HAS_X=has_x, HAS_N_TENSOR=n_t is not None, F64=c.dtype == torch.float64, BLOCK_V=block_v,
        num_warps=8,  # one program streams a long slice: keep many loads in flight
    )
    return vals, idxs, splits


# ---- custom ops (write into given outputs: static buffers for CUDA graphs, poisoned buffers in tests) ------------
@torch.library.custom_op("lookahead::verify_greedy_out", mutates_args=("accept_len", "best", "tokens"))
def _verify_greedy_op(x_logits: torch.Tensor, cand_logits: torch.Tensor, candidates: torch.Tensor,
                      num_candidates: torch.Tensor | None, n_const: int, vocab_splits: int,
                      accept_len: torch.Tensor, best: torch.Tensor, tokens: torch.Tensor) -> None:
    B, G, K = candidates.shape
    V = x_logits.shape[1]
    if B == 0:
        return
    vals, idxs, splits = _argmax_partials(x_logits, cand_logits, num_candidates, n_const, G, K, V, True,
                                          vocab_splits if vocab_splits > 0 else None)
    _greedy_walk_kernel[(B,)](
        vals, idxs, candidates, num_candidates if num_candidates is not None else idxs, accept_len, best, tokens,
        G, K, n_const, splits,
        candidates.stride(0), candidates.stride(1), candidates.stride(2), tokens.stride(0),
        HAS_N_TENSOR=num_candidates is not None, BLOCK_G=max(2, triton.next_power_of_2(G)),
        BLOCK_K=max(2, triton.next_power_of_2(K + 1)),
    )


@_verify_greedy_op.register_fake
def _(x_logits, cand_logits, candidates, num_candidates, n_const, vocab_splits, accept_len, best, tokens):
    return None


@torch.library.custom_op("lookahead::verify_sample_out", mutates_args=("accept_len", "best", "tokens"))
def _verify_sample_op(x_probs: torch.Tensor, cand_probs: torch.Tensor, candidates: torch.Tensor,
                      num_candidates: torch.Tensor | None, n_const: int, uniforms: torch.Tensor,
                      accept_len: torch.Tensor, best: torch.Tensor, tokens: torch.Tensor) -> None:
    B, G, K = candidates.shape
    V = x_probs.shape[1]
    if B == 0:
        return
    c = cand_probs
    _sample_walk_kernel[(B,)](
        x_probs, c, candidates, num_candidates if num_candidates is not None else accept_len, uniforms,
        accept_len, best, tokens,
        G, K, V, n_const,
        x_probs.stride(0), x_probs.stride(1), c.stride(0), c.stride(1), c.stride(2), c.stride(3),
        candidates.stride(0), candidates.stride(1), candidates.stride(2),
        uniforms.stride(0), uniforms.stride(1), uniforms.stride(2), tokens.stride(0),
        HAS_N_TENSOR=num_candidates is not None, BLOCK_G=max(2, triton.next_power_of_2(G)),
        # the residual scan compares a [BLOCK_V, BLOCK_G] tile per chunk: smaller chunks on the GPU
        BLOCK_K1=max(2, triton.next_power_of_2(K + 1)), BLOCK_V=_block_v(V, candidates.device, gpu_cap=1024),
        num_warps=8,
    )


@_verify_sample_op.register_fake
def _(x_probs, cand_probs, candidates, num_candidates, n_const, uniforms, accept_len, best, tokens):
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


def _outputs(name: str, out, B: int, K: int, device):
    """The ``(accept_len [B], best [B], tokens [B, K+1])`` int64 outputs: ``out`` checked, or fresh ones."""
    if out is None:
        return (torch.empty((B,), dtype=torch.int64, device=device),
                torch.empty((B,), dtype=torch.int64, device=device),
                torch.empty((B, K + 1), dtype=torch.int64, device=device))
    shapes = ((B,), (B,), (B, K + 1))
    if not isinstance(out, (tuple, list)) or len(out) != 3 or not all(
            isinstance(t, torch.Tensor) and tuple(t.shape) == s and t.dtype == torch.int64 and t.device == device
            for t, s in zip(out, shapes)):
        raise ValueError(f"{name}: out must be a tuple of three int64 tensors on {device} shaped [B], [B], "
                         f"[B, K+1] = {[list(s) for s in shapes]}")
    if out[0].stride(0) != 1 or out[1].stride(0) != 1 or out[2].stride(1) != 1:
        raise ValueError(f"{name}: out tensors must be contiguous along their last dimension")
    return tuple(out)


def verify_greedy(x_logits: torch.Tensor, cand_logits: torch.Tensor, candidates: torch.Tensor,
                  num_candidates: torch.Tensor | int | None = None, *, vocab_splits: int | None = None,
                  out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None):
    """Greedy verification on the GPU, exactly ``verify_greedy_reference`` (see it for the rule).

    Args:
        x_logits: ``[B, V]`` float16/bfloat16/float32/float64 logits at ``x`` (any strides, e.g. a view of the
            model's ``[B, T, V]`` output).
        cand_logits: ``[B, G, K, V]`` same dtype, logits at each candidate token (any strides); ``K >= 1``.
        candidates: ``[B, G, K]`` int64 candidate ids (ids outside ``[0, V)`` never match).
        num_candidates: int in ``0..G`` or int64 ``[B]`` (values clamped to ``0..G`` on the GPU); default ``G``.
            Rows of unused candidates are never read, so they may hold anything (NaN included).
        vocab_splits: how many programs share one row's argmax (default: enough to fill the GPU; 1 on CPU).
        out: optional ``(accept_len, best, tokens)`` to write into (e.g. static buffers for a CUDA graph).
    Returns:
        ``accept_len`` int64 ``[B]`` in ``0..K``; ``best`` int64 ``[B]`` (``-1`` when nothing is accepted);
        ``tokens`` int64 ``[B, K+1]``: accepted tokens, then the bonus, then ``-1``. Argmax picks the first index
        among equal maxima and treats NaN as the largest, like ``torch.argmax``. Two launches, no host sync.
    """
    name = "verify_greedy"
    check_verify_inputs(name, x_logits, cand_logits, candidates, num_candidates)
    _check_device(name, candidates)
    splits = _check_splits(name, vocab_splits)
    B, G, K = candidates.shape
    n_t, n_const = _num_candidates_arg(num_candidates, G)
    outs = _outputs(name, out, B, K, candidates.device)
    _verify_greedy_op(x_logits, cand_logits, candidates, n_t, n_const, splits, *outs)
    return outs


def verify_sample(x_probs: torch.Tensor, cand_probs: torch.Tensor, candidates: torch.Tensor,
                  num_candidates: torch.Tensor | int | None = None, *, generator: torch.Generator | None = None,
                  uniforms: torch.Tensor | None = None,
                  out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None):
    """Speculative-sampling verification on the GPU, exactly ``verify_sample_reference`` given the same uniforms.

    Args:
        x_probs: ``[B, V]`` float16/bfloat16/float32/float64 nonnegative weights at ``x`` (``warp_logits``
            output; rows need not be normalised; any strides).
        cand_probs: ``[B, G, K, V]`` same dtype, weights after each candidate token; ``K >= 1``.
        candidates: ``[B, G, K]`` int64 candidate ids (ids outside ``[0, V)`` have probability 0).
        num_candidates: int in ``0..G`` or int64 ``[B]`` (clamped to ``0..G`` on the GPU); default ``G``.
        generator: used to draw ``uniforms`` when they are not given (``draw_verify_uniforms``).
        uniforms: float64 (or float32) ``[B, K, G+1]`` in ``[0, 1)``, layout of ``draw_verify_uniforms``.
        out: optional ``(accept_len, best, tokens)`` to write into.
    Returns:
        As ``verify_greedy``: ``accept_len`` ``[B]``, ``best`` ``[B]`` (``-1`` if none), ``tokens`` ``[B, K+1]``
        (``-1`` padded; a bonus of ``-1`` flags a row without positive mass, i.e. invalid probabilities).
        One launch (plus the ``torch.rand`` when drawing), no host sync.
    """
    name = "verify_sample"
    check_verify_inputs(name, x_probs, cand_probs, candidates, num_candidates)
    _check_device(name, candidates)
    B, G, K = candidates.shape
    if uniforms is None:
        if generator is not None and not isinstance(generator, torch.Generator):
            raise ValueError(f"{name}: generator must be a torch.Generator or None, got {type(generator).__name__}")
        uniforms = draw_verify_uniforms(B, G, K, candidates.device, generator)
    elif generator is not None:
        raise ValueError(f"{name}: pass either generator or uniforms, not both")
    check_verify_uniforms(name, uniforms, B, G, K, candidates.device)
    n_t, n_const = _num_candidates_arg(num_candidates, G)
    outs = _outputs(name, out, B, K, candidates.device)
    _verify_sample_op(x_probs, cand_probs, candidates, n_t, n_const, uniforms, *outs)
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
