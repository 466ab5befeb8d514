"""Torch references for verification (test oracle and CPU path).

Greedy verification of one step: ``y0 = argmax(logits at x)``; candidate ``c`` is accepted token by token
while ``candidates[c, m] == argmax(logits at the candidate's previous token)`` (``x`` for ``m = 0``). The step
takes the longest accepted prefix (the first candidate among equals), then one bonus token: the argmax at the
last accepted token (at ``x`` when nothing is accepted).
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
