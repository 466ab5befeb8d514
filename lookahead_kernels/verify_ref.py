"""Torch references for verification (test oracle, CPU path and bench baseline), and their input checks.

Greedy verification of one step: ``y0 = argmax(logits at x)``; candidate ``c`` is accepted token by token
while ``candidates[c, m] == argmax(logits at the candidate's previous token)`` (``x`` for ``m = 0``). The step
takes the longest accepted prefix (the first candidate among equals), then one bonus token: the argmax at the
last accepted token (at ``x`` when nothing is accepted).

Sampling verification (``verify_sample_reference``) is multi-candidate speculative sampling with point-mass
drafts; its random numbers come from ``draw_verify_uniforms`` in a fixed layout so that the Triton kernel in
``verify.py``, given the same tensor, makes the same choices. Token draws use ``inverse_cdf_sample``.
"""

from __future__ import annotations

import torch


def verify_greedy_reference(x_logits: torch.Tensor, cand_logits: torch.Tensor, candidates: torch.Tensor,
                            num_candidates: torch.Tensor | int | None = None):
    """Greedy verification, plain torch.

    Args:
        x_logits: ``[B, V]`` float logits at ``x``.
        cand_logits: ``[B, G, K, V]`` float logits at each candidate token (``K = ngram - 1``).
        candidates: ``[B, G, K]`` int64 candidate token ids.
        num_candidates: int or int64 ``[B]``: how many of the ``G`` candidates are real (default all); the
            rest are ignored whatever they hold.
    Returns:
        ``accept_len`` int64 ``[B]`` in ``0..K``; ``best`` int64 ``[B]``: the accepted candidate, ``-1`` when
        ``accept_len == 0``; ``tokens`` int64 ``[B, K+1]``: the accepted tokens then the bonus token, padded
        with ``-1`` after position ``accept_len``.
    """
    B, G, K = candidates.shape
    dev = candidates.device
    if num_candidates is None:
        num_candidates = G
    if isinstance(num_candidates, int):
        num_candidates = torch.full((B,), num_candidates, dtype=torch.long, device=dev)
    y0 = x_logits.argmax(-1)  # [B]
    tokens = torch.full((B, K + 1), -1, dtype=torch.long, device=dev)
    if G == 0:
        tokens[:, 0] = y0
        return torch.zeros(B, dtype=torch.long, device=dev), torch.full((B,), -1, dtype=torch.long, device=dev), tokens
    pred = cand_logits.argmax(-1)  # [B, G, K]: argmax after each candidate token
    # target[m] is what the model predicts at the position of candidates[:, :, m].
    target = torch.cat([y0[:, None, None].expand(B, G, 1), pred[:, :, :-1]], dim=2)
    match = (candidates == target).long().cumprod(dim=2)  # [B, G, K], 1 while all earlier matched
    lengths = match.sum(dim=2)
    real = torch.arange(G, device=dev)[None, :] < num_candidates[:, None]
    lengths = torch.where(real, lengths, torch.full_like(lengths, -1))
    accept_len, best = lengths.max(dim=1)  # max returns the first index among equals
    accept_len = accept_len.clamp(min=0)
    best = torch.where(accept_len > 0, best, torch.full_like(best, -1))
    for b in range(B):
        a = int(accept_len[b])
        if a == 0:
            tokens[b, 0] = y0[b]
        else:
            c = int(best[b])
            tokens[b, :a] = candidates[b, c, :a]
            tokens[b, a] = pred[b, c, a - 1]
    return accept_len, best, tokens


# ---- input checks shared by the references' callers and the kernel launchers ----------------------------------
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_verify_inputs(name: str, x_rows: torch.Tensor, cand_rows: torch.Tensor, candidates: torch.Tensor,
                        num_candidates) -> None:
    """Raise ``ValueError`` unless the verification inputs have the documented shapes, dtypes and devices.

    ``name`` prefixes the message (the public function that was called). Values inside tensors are not read
    (that would synchronise with a GPU): candidate ids outside ``[0, V)`` are simply never accepted, and a
    ``num_candidates`` tensor is clamped to ``[0, G]``; an int ``num_candidates`` or one in a CPU tensor is checked.
    """
    for arg, t in (("x", x_rows), ("cand", cand_rows), ("candidates", candidates)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: {arg} must be a torch.Tensor, got {type(t).__name__}")
    if candidates.dim() != 3 or candidates.dtype != torch.int64:
        raise ValueError(f"{name}: candidates must be an int64 tensor [B, G, K], got {candidates.dtype} "
                         f"{list(candidates.shape)}")
    B, G, K = candidates.shape
    if K < 1:
        raise ValueError(f"{name}: candidates must have K >= 1 tokens each (K = ngram - 1), got K = {K}")
    if x_rows.dim() != 2 or x_rows.shape[0] != B or x_rows.shape[1] < 1:
        raise ValueError(f"{name}: the rows at x must be [B, V] with B = {B} (from candidates) and V >= 1, "
                         f"got {list(x_rows.shape)}")
    V = x_rows.shape[1]
    if tuple(cand_rows.shape) != (B, G, K, V):
        raise ValueError(f"{name}: the candidate rows must be [B, G, K, V] = {[B, G, K, V]}, got {list(cand_rows.shape)}")
    if x_rows.dtype not in _FLOAT_DTYPES or cand_rows.dtype != x_rows.dtype:
        raise ValueError(f"{name}: the rows at x and at the candidates must share one floating dtype "
                         f"(float16, bfloat16, float32 or float64), got {x_rows.dtype} and {cand_rows.dtype}")
    if not (x_rows.device == cand_rows.device == candidates.device):
        raise ValueError(f"{name}: all tensors must be on one device, got x on {x_rows.device}, candidate rows on "
                         f"{cand_rows.device}, candidates on {candidates.device}")
    if num_candidates is None:
        return
    if isinstance(num_candidates, bool) or not isinstance(num_candidates, (int, torch.Tensor)):
        raise ValueError(f"{name}: num_candidates must be None, an int or an int64 tensor [B], got {num_candidates!r}")
    if isinstance(num_candidates, int):
        if not 0 <= num_candidates <= G:
            raise ValueError(f"{name}: num_candidates must be in 0..G = 0..{G}, got {num_candidates}")
        return
    if num_candidates.dtype != torch.int64 or tuple(num_candidates.shape) != (B,):
        raise ValueError(f"{name}: num_candidates tensor must be int64 [B] = [{B}], got {num_candidates.dtype} "
                         f"{list(num_candidates.shape)}")
    if num_candidates.device != candidates.device:
        raise ValueError(f"{name}: num_candidates must be on {candidates.device}, got {num_candidates.device}")
    if num_candidates.device.type == "cpu" and B > 0:
        lo, hi = int(num_candidates.min()), int(num_candidates.max())
        if lo < 0 or hi > G:
            raise ValueError(f"{name}: num_candidates values must be in 0..G = 0..{G}, got min {lo}, max {hi}")


def check_verify_uniforms(name: str, uniforms, B: int, G: int, K: int, device) -> None:
    """Raise ``ValueError`` unless ``uniforms`` is a float32/float64 ``[B, K, G+1]`` tensor on ``device``."""
    if not isinstance(uniforms, torch.Tensor):
        raise ValueError(f"{name}: uniforms must be a tensor [B, K, G+1] (see draw_verify_uniforms), got "
                         f"{type(uniforms).__name__}")
    if tuple(uniforms.shape) != (B, K, G + 1) or uniforms.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"{name}: uniforms must be float64 (or float32) [B, K, G+1] = {[B, K, G + 1]}, got "
                         f"{uniforms.dtype} {list(uniforms.shape)}")
    if uniforms.device != torch.device(device):
        raise ValueError(f"{name}: uniforms must be on {device}, got {uniforms.device}")


# ---- sampling ----------------------------------------------------------------------------------------------------
def draw_verify_uniforms(B: int, G: int, K: int, device=None, generator: torch.Generator | None = None):
    """The random numbers one sampling verification consumes: float64 ``[B, K, G+1]`` in ``[0, 1)``.

    ``uniforms[b, d, c]`` (``c < G``) decides the try of candidate ``c`` at depth ``d`` (0-based) and
    ``uniforms[b, d, G]`` draws the bonus token when the walk ends at depth ``d`` (``d = K-1`` when all ``K``
    tokens are accepted). Unused entries are simply ignored, so the layout never depends on the data. Drawn
    with one ``torch.rand`` on ``device`` (no host synchronisation; capturable in a CUDA graph whose generator
    state is registered). Float64 so tokens with probability far below ``2**-24`` keep their exact chance.
    """
    return torch.rand((B, K, G + 1), dtype=torch.float64, device=device, generator=generator)


def inverse_cdf_sample(weights: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Pick one index per row of nonnegative ``weights`` ``[R, V]`` by inverse CDF, in float64.

    ``target`` float64 ``[R]`` is ``u * total`` for a uniform ``u`` in ``[0, 1)``. The pick is the smallest ``i``
    with ``target < cumsum(weights)[i]`` (strict, so a zero-weight index is never picked and a target that lands
    exactly on a CDF boundary goes to the next token with positive weight). If rounding leaves no such ``i`` the
    pick is the last index with positive weight; a row without positive weight (invalid input) gives ``-1``.
    """
    w = weights.double()
    V = w.shape[-1]
    cdf = w.cumsum(-1)
    hit = target[:, None] < cdf
    first = hit.to(torch.int8).argmax(-1)  # first True (argmax returns the first maximal index)
    idx = torch.arange(V, device=w.device)
    last_pos = torch.where(w > 0, idx, torch.full_like(idx, -1)).amax(-1)
    return torch.where(hit.any(-1), first, last_pos)


def verify_sample_reference(x_probs: torch.Tensor, cand_probs: torch.Tensor, candidates: torch.Tensor,
                            num_candidates: torch.Tensor | int | None = None, *, uniforms: torch.Tensor):
    """Multi-candidate speculative sampling with point-mass drafts, plain torch (vectorised over ``B``).

    The walk, per batch row: ``r`` starts as the distribution at ``x`` and ``S = sum(r)`` (float64; rows need not
    be normalised). At depth ``d = 0..K-1`` the live candidates (real, and agreeing with every accepted token so
    far) are tried in candidate order: candidate ``c`` with token ``t = candidates[b, c, d]`` is accepted iff
    ``uniforms[b, d, c] * S < r(t)`` (probability ``r(t)/S``; ``r(t) = 0`` for ``t`` outside ``[0, V)``); on
    rejection ``S -= r(t)`` and ``r(t) = 0``. On acceptance the live set keeps the candidates with ``t`` at depth
    ``d``, ``r`` becomes ``cand_probs[b, c, d]`` (the accepted candidate is the first live one carrying ``t``,
    since an earlier one carrying it would have zeroed ``r(t)``), ``S = sum(r)`` and the walk goes one deeper.
    If every live candidate is rejected at depth ``d`` the bonus token is drawn from the residual ``r`` with
    ``uniforms[b, d, G]``; after ``K`` acceptances it is drawn from ``cand_probs[b, best, K-1]`` with
    ``uniforms[b, K-1, G]``. Drawing follows ``inverse_cdf_sample`` with ``target = u * S``. The emitted
    tokens have exactly the target model's distribution.

    Args:
        x_probs: ``[B, V]`` float, nonnegative weights at ``x`` (``warp_logits`` output).
        cand_probs: ``[B, G, K, V]`` same dtype, weights after each candidate token.
        candidates: ``[B, G, K]`` int64 candidate ids.
        num_candidates: int or int64 ``[B]``: real candidates per row (default ``G``); the rest are ignored.
        uniforms: float64 ``[B, K, G+1]`` from ``draw_verify_uniforms``.
    Returns:
        ``accept_len`` int64 ``[B]`` in ``0..K``; ``best`` int64 ``[B]``, ``-1`` when ``accept_len == 0``;
        ``tokens`` int64 ``[B, K+1]``: accepted tokens then the bonus, ``-1`` after position ``accept_len``
        (and a bonus of ``-1`` only for a row without positive mass, which is invalid input).
    """
    check_verify_inputs("verify_sample_reference", x_probs, cand_probs, candidates, num_candidates)
    B, G, K = candidates.shape
    V = x_probs.shape[1]
    dev = candidates.device
    check_verify_uniforms("verify_sample_reference", uniforms, B, G, K, dev)
    u_all = uniforms.double()
    if num_candidates is None:
        num_candidates = G
    if isinstance(num_candidates, int):
        num_candidates = torch.full((B,), num_candidates, dtype=torch.long, device=dev)
    rows = torch.arange(B, device=dev)
    live = torch.arange(G, device=dev)[None, :] < num_candidates[:, None]  # [B, G]
    active = torch.ones(B, dtype=torch.bool, device=dev)
    accept_len = torch.zeros(B, dtype=torch.long, device=dev)
    best = torch.full((B,), -1, dtype=torch.long, device=dev)
    tokens = torch.full((B, K + 1), -1, dtype=torch.long, device=dev)
    r = x_probs.double().clone()  # [B, V]: the current (residual) weights of each row
    for d in range(K):
        S = r.sum(-1)
        searching = active.clone()
        acc_c = torch.full((B,), -1, dtype=torch.long, device=dev)
        acc_t = torch.full((B,), -1, dtype=torch.long, device=dev)
        for c in range(G):
            t = candidates[:, c, d]
            in_vocab = (t >= 0) & (t < V)
            tc = t.clamp(0, V - 1)
            p_t = torch.where(in_vocab, r[rows, tc], torch.zeros_like(S))
            trying = searching & live[:, c]
            acc = trying & (u_all[:, d, c] * S < p_t)
            rej = trying & ~acc
            S = torch.where(rej, S - p_t, S)
            zero = rej & in_vocab
            r[rows[zero], tc[zero]] = 0.0
            acc_c = torch.where(acc, c, acc_c)
            acc_t = torch.where(acc, t, acc_t)
            searching &= ~acc
        stop = active & (acc_c < 0)
        if stop.any():
            bonus = inverse_cdf_sample(r[stop], u_all[stop, d, G] * S[stop])
            tokens[stop, d] = bonus
        go = active & (acc_c >= 0)
        tokens[go, d] = acc_t[go]
        best = torch.where(go, acc_c, best)
        accept_len = torch.where(go, d + 1, accept_len)
        live &= candidates[:, :, d] == acc_t[:, None]
        active = go
        if go.any():
            r[go] = cand_probs[rows[go], acc_c[go], d].double()
    if active.any():
        S = r[active].sum(-1)
        tokens[active, K] = inverse_cdf_sample(r[active], u_all[active, K - 1, G] * S)
    return accept_len, best, tokens
