"""Torch references for verification on the draft tree (test oracle, CPU path and bench baseline), and their checks.

The verification branch is a token tree of ``V`` nodes in depth-first pre-order (``tree.py``,
``shared/design/draft-tree.md``): node ``j`` is an ancestor of node ``i``, or ``i`` itself, iff
``j <= i < end[j]``. The children of ``x`` (the roots) are ``0, end[0], end[end[0]], ...``; the first child of
node ``j`` is ``j + 1`` when ``end[j] > j + 1``, and the next sibling of a child ``c`` of ``j`` is ``end[c]`` when
``end[c] < end[j]``. "Children in order" below means in that (node index) order. Only the first ``num_nodes``
nodes of a row are real; the rest are padding (leaves after the real tree) and are never accepted, whatever
their tokens, logits or probabilities hold.

Greedy (``verify_tree_greedy_reference``): ``y = argmax`` at ``x``; while the current node (``x``, then the last
accepted node) has a real child whose token is ``y``, move to the first such child, accept it and let
``y = argmax`` at it. Emit the accepted tokens, then ``y`` (the bonus token).

Sampling (``verify_tree_sample_reference``): speculative sampling with point-mass drafts on the tree. At the
current node, with ``q`` its (warped) distribution, the real children are tried in order: child ``c`` with token
``t`` is accepted with probability ``q(t) / sum(q)`` (decided by ``uniforms[b, c]``); on rejection ``q(t)`` is set
to 0 (so later tries renormalise implicitly) and the next child is tried. On acceptance the walk descends with
``c``'s distribution. When every child is rejected, the node is a leaf, or ``max_accept`` nodes are accepted, the
bonus token is drawn from what is left of ``q`` by inverse CDF with ``uniforms[b, V]``. The emitted sequence
then has exactly the distribution of sampling token by token from the per-node distributions (the target
model's), for any tree: a repeated sibling token (not a trie) just has probability 0 at its second try, and a
child with ``q(t) = 0`` is always rejected. What is left of ``q`` after rejecting every child is never all zero
when the siblings carry distinct tokens: the last positive-mass token, if drafted, is accepted with probability
1 (up to float64 rounding of the running sum, i.e. for a uniform within ~1e-16 of 1); a bonus of ``-1`` flags a
distribution without positive mass (invalid input).

Outputs of both: ``accept_len`` int64 ``[B]``; ``path`` int64 ``[B, max_accept]``, the accepted node indices
from the root down, ``-1`` after ``accept_len``; ``emitted`` int64 ``[B, max_accept + 1]``, the accepted tokens,
then the bonus token, ``-1`` after.

The Triton kernels in ``verify.py`` follow these references exactly (given the same uniforms, up to float64
rounding of sums). The original linear candidates are the tree ``TreeShape.linear(G, K)``.
"""

from __future__ import annotations

import torch

__all__ = ["verify_tree_greedy_reference", "verify_tree_sample_reference", "draw_tree_uniforms",
           "inverse_cdf_sample", "check_tree_verify_inputs", "check_tree_uniforms", "tree_parents"]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# ---- input checks shared by the references and the kernel launchers ------------------------------------------
def _shape(t) -> str:
    return f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__


def check_tree_verify_inputs(name: str, x_rows: torch.Tensor, node_rows: torch.Tensor, tokens: torch.Tensor,
                             end: torch.Tensor, num_nodes, max_accept, tree_values: bool = True) -> None:
    """Raise ``ValueError`` unless the tree verification inputs have the documented shapes, dtypes and devices.

    ``name`` prefixes the message (the public function that was called). On the CPU the tree (``end``) and
    ``num_nodes`` are checked too (``tree_values=False``: the caller's C++ op checks their values itself, in a
    fraction of the 0.1-0.2 ms these torch ops take); tensors on another device are never read (that would
    synchronise): there a ``num_nodes`` outside ``0..V`` is clamped, token ids outside the vocabulary are simply
    never accepted, and an ``end`` that does not encode a pre-ordered tree gives unspecified (but memory-safe)
    results.
    """
    for arg, t in (("x", x_rows), ("node", node_rows), ("tokens", tokens), ("end", end)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: {arg} must be a torch.Tensor, got {type(t).__name__}")
    if tokens.dim() != 2 or tokens.dtype != torch.int64:
        raise ValueError(f"{name}: tokens must be an int64 tensor [B, V] (a token per tree node), got {_shape(tokens)}")
    B, V = tokens.shape
    if x_rows.dim() != 2 or x_rows.shape[0] != B or x_rows.shape[1] < 1:
        raise ValueError(f"{name}: the rows at x must be [B, vocab] with B = {B} (from tokens) and vocab >= 1, "
                         f"got {list(x_rows.shape)}")
    vocab = x_rows.shape[1]
    if tuple(node_rows.shape) != (B, V, vocab):
        raise ValueError(f"{name}: the node rows must be [B, V, vocab] = {[B, V, vocab]}, got {list(node_rows.shape)}")
    if x_rows.dtype not in _FLOAT_DTYPES or node_rows.dtype != x_rows.dtype:
        raise ValueError(f"{name}: the rows at x and at the nodes must share one floating dtype "
                         f"(float16, bfloat16, float32 or float64), got {x_rows.dtype} and {node_rows.dtype}")
    if end.dtype != torch.int64 or end.dim() not in (1, 2) or end.shape[-1] != V or (end.dim() == 2 and end.shape[0] != B):
        raise ValueError(f"{name}: end must be an int64 tensor [V] (one tree for the batch) or [B, V] = "
                         f"{[B, V]}, got {_shape(end)}")
    dev = tokens.device
    if not (x_rows.device == node_rows.device == dev == end.device):
        raise ValueError(f"{name}: all tensors must be on one device, got x on {x_rows.device}, node rows on "
                         f"{node_rows.device}, tokens on {dev}, end on {end.device}")
    if isinstance(max_accept, bool) or not isinstance(max_accept, int) or max_accept < 0:
        raise ValueError(f"{name}: max_accept must be an int >= 0 (at least the tree's depth to accept whole "
                         f"paths), got {max_accept!r}")
    if dev.type == "cpu" and V > 0 and tree_values:
        _check_end_values(name, end)
    if num_nodes is None:
        return
    if isinstance(num_nodes, bool) or not isinstance(num_nodes, (int, torch.Tensor)):
        raise ValueError(f"{name}: num_nodes must be None, an int or an int64 tensor [B], got {num_nodes!r}")
    if isinstance(num_nodes, int):
        if not 0 <= num_nodes <= V:
            raise ValueError(f"{name}: num_nodes must be in 0..V = 0..{V}, got {num_nodes}")
        return
    if num_nodes.dtype != torch.int64 or tuple(num_nodes.shape) != (B,):
        raise ValueError(f"{name}: num_nodes tensor must be int64 [B] = [{B}], got {_shape(num_nodes)}")
    if num_nodes.device != dev:
        raise ValueError(f"{name}: num_nodes must be on {dev}, got {num_nodes.device}")
    if dev.type == "cpu" and B > 0 and tree_values:
        lo, hi = int(num_nodes.min()), int(num_nodes.max())
        if lo < 0 or hi > V:
            raise ValueError(f"{name}: num_nodes values must be in 0..V = 0..{V}, got min {lo}, max {hi}")


def _check_end_values(name: str, end: torch.Tensor) -> None:
    """``end`` ([V] or [B, V]) must encode pre-ordered trees: ``i < end[i] <= V`` and nested subtrees."""
    V = end.shape[-1]
    idx = torch.arange(V)
    if bool((end <= idx).any()) or bool((end > V).any()):
        raise ValueError(f"{name}: tree end[i] must satisfy i < end[i] <= V = {V}, got {end.tolist()}")
    inside = (idx[:, None] <= idx[None, :]) & (idx[None, :] < end[..., :, None])  # [.., j, i]: i in j's subtree
    if bool((inside & (end[..., None, :] > end[..., :, None])).any()):
        raise ValueError(f"{name}: tree end is not a pre-order nesting of subtrees (a subtree runs past its "
                         f"parent's): {end.tolist()}")


def check_tree_uniforms(name: str, uniforms, B: int, V: int, device) -> None:
    """Raise ``ValueError`` unless ``uniforms`` is a float32/float64 ``[B, V+1]`` tensor on ``device``."""
    if not isinstance(uniforms, torch.Tensor):
        raise ValueError(f"{name}: uniforms must be a tensor [B, V+1] (see draw_tree_uniforms), got "
                         f"{type(uniforms).__name__}")
    if tuple(uniforms.shape) != (B, V + 1) or uniforms.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"{name}: uniforms must be float64 (or float32) [B, V+1] = {[B, V + 1]}, got "
                         f"{_shape(uniforms)}")
    if uniforms.device != torch.device(device):
        raise ValueError(f"{name}: uniforms must be on {device}, got {uniforms.device}")


def resolve_uniforms(name: str, uniforms, generator, B: int, V: int, device):
    """``uniforms`` checked, or drawn with ``generator`` by ``draw_tree_uniforms`` when not given."""
    if uniforms is None:
        if generator is not None and not isinstance(generator, torch.Generator):
            raise ValueError(f"{name}: generator must be a torch.Generator or None, got {type(generator).__name__}")
        uniforms = draw_tree_uniforms(B, V, device, generator)
    elif generator is not None:
        raise ValueError(f"{name}: pass either generator or uniforms, not both")
    check_tree_uniforms(name, uniforms, B, V, device)
    return uniforms


def _num_nodes_tensor(num_nodes, B: int, V: int, device) -> torch.Tensor:
    if num_nodes is None:
        return torch.full((B,), V, dtype=torch.long, device=device)
    if isinstance(num_nodes, int):
        return torch.full((B,), num_nodes, dtype=torch.long, device=device)
    return num_nodes.clamp(0, V)


def _outputs(B: int, max_accept: int, device):
    return (torch.zeros(B, dtype=torch.long, device=device),
            torch.full((B, max_accept), -1, dtype=torch.long, device=device),
            torch.full((B, max_accept + 1), -1, dtype=torch.long, device=device))


def tree_parents(end: torch.Tensor) -> torch.Tensor:
    """int64 like ``end`` ([V] or [B, V]): each node's parent, the largest ``j < i`` with ``end[j] > i`` (``-1``
    for a child of ``x``)."""
    V = end.shape[-1]
    idx = torch.arange(V, device=end.device)
    strict = (idx[:, None] < idx[None, :]) & (idx[None, :] < end[..., :, None])  # [.., j, i]
    return torch.where(strict, idx[:, None], -1).amax(dim=-2) if V else end.clone()


# ---- greedy -------------------------------------------------------------------------------------------------------
def verify_tree_greedy_reference(x_logits: torch.Tensor, node_logits: torch.Tensor, tokens: torch.Tensor,
                                 end: torch.Tensor, num_nodes: torch.Tensor | int | None, max_accept: int):
    """Greedy verification of a token tree, plain torch (vectorised over the batch; see the module docstring).

    Args:
        x_logits: ``[B, vocab]`` float logits at ``x``.
        node_logits: ``[B, V, vocab]`` same dtype, logits at each tree node.
        tokens: ``[B, V]`` int64 node tokens (ids outside the vocabulary never match).
        end: ``[V]`` (one tree for the batch) or ``[B, V]`` int64 subtree ends (``TreeShape.end``).
        num_nodes: int64 ``[B]`` real nodes per row (an int for all rows), or ``None``: all ``V`` are real.
        max_accept: the most nodes accepted (at least the tree's depth to accept whole paths).
    Returns:
        ``(accept_len [B], path [B, max_accept], emitted [B, max_accept + 1])``, int64. Argmax is
        ``torch.argmax``: the first index among equal maxima, NaN counts as the largest.
    """
    check_tree_verify_inputs("verify_tree_greedy_reference", x_logits, node_logits, tokens, end, num_nodes,
                             max_accept)
    B, V = tokens.shape
    dev = tokens.device
    accept_len, path, emitted = _outputs(B, max_accept, dev)
    y = x_logits.argmax(-1)  # [B]
    steps = min(max_accept, V)
    if steps > 0 and B > 0:
        n = _num_nodes_tensor(num_nodes, B, V, dev)
        rows = torch.arange(B, device=dev)
        idx = torch.arange(V, device=dev)
        parent = tree_parents(end).expand(B, V)
        real = idx[None, :] < n[:, None]
        cur = torch.full((B,), -1, dtype=torch.long, device=dev)
        for s in range(steps):
            cand = real & (parent == cur[:, None]) & (tokens == y[:, None])
            go = cand.any(-1)
            if not bool(go.any()):
                break
            nxt = cand.to(torch.int8).argmax(-1)  # the first matching child
            path[go, s] = nxt[go]
            emitted[go, s] = tokens[rows, nxt][go]
            # only the rows of visited nodes are reduced (a stopped row's y and cur stay, so it stays stopped)
            y = torch.where(go, node_logits[rows, nxt].argmax(-1), y)
            cur = torch.where(go, nxt, cur)
            accept_len += go.long()
    emitted.scatter_(1, accept_len[:, None], y[:, None])
    return accept_len, path, emitted


# ---- sampling -----------------------------------------------------------------------------------------------------
def draw_tree_uniforms(B: int, V: int, device=None, generator: torch.Generator | None = None) -> torch.Tensor:
    """The random numbers one sampling verification of a ``V``-node tree consumes: float64 ``[B, V+1]`` in [0, 1).

    ``uniforms[b, c]`` (``c < V``) decides the try of node ``c`` (each node is tried at most once per walk) and
    ``uniforms[b, V]`` draws the bonus token. Unused entries are ignored, so the layout never depends on the
    data. One ``torch.rand`` on ``device`` (no host synchronisation; capturable in a CUDA graph whose generator
    state is registered). Float64 so that tokens with probability far below ``2**-24`` keep their exact chance.
    """
    return torch.rand((B, V + 1), dtype=torch.float64, device=device, generator=generator)


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
    # The first i with target < cdf[i] (the CDF does not decrease): a binary search, not passes over the vocabulary
    # (those took 0.5 ms a row of 49k on a 2-core CPU, 4% of a sampled step).
    first = torch.searchsorted(cdf, target.reshape(-1, 1).to(cdf.dtype).contiguous(), right=True).reshape(-1)
    found = first < V
    if w.device.type == "cpu" and bool(found.all()):  # on the CPU (no graph to keep free of syncs) skip the rest
        return first
    idx = torch.arange(V, device=w.device)
    last_pos = torch.where(w > 0, idx, torch.full_like(idx, -1)).amax(-1)
    return torch.where(found, first, last_pos)


def verify_tree_sample_reference(x_probs: torch.Tensor, node_probs: torch.Tensor, tokens: torch.Tensor,
                                 end: torch.Tensor, num_nodes: torch.Tensor | int | None, max_accept: int,
                                 uniforms: torch.Tensor | None = None, generator: torch.Generator | None = None):
    """Speculative sampling on a token tree with point-mass drafts, plain torch (vectorised over the batch).

    The walk, per batch row (see also the module docstring): ``r`` starts as the distribution at ``x`` and
    ``S = sum(r)`` (float64; rows need not be normalised). The real children ``c`` of the current node are tried
    in order: with ``t = tokens[b, c]`` and ``r(t) = 0`` for ``t`` outside the vocabulary, ``c`` is accepted iff
    ``uniforms[b, c] * S < r(t)``; on rejection ``S -= r(t)`` and ``r(t) = 0``. On acceptance ``r`` becomes
    ``node_probs[b, c]`` and ``S = sum(r)``. When no child is left to try (or ``max_accept`` nodes are accepted)
    the bonus is ``inverse_cdf_sample(r, uniforms[b, V] * S)``.

    Args:
        x_probs: ``[B, vocab]`` float, nonnegative weights at ``x`` (``warp_logits`` output).
        node_probs: ``[B, V, vocab]`` same dtype, the weights after each node.
        tokens, end, num_nodes, max_accept: as ``verify_tree_greedy_reference``.
        uniforms: float64 (or float32) ``[B, V+1]`` from ``draw_tree_uniforms``; drawn with ``generator`` if
            ``None``.
    Returns:
        ``(accept_len [B], path [B, max_accept], emitted [B, max_accept + 1])`` as the greedy reference (a bonus of
        ``-1`` only for a distribution without positive mass, which is invalid input).
    """
    name = "verify_tree_sample_reference"
    check_tree_verify_inputs(name, x_probs, node_probs, tokens, end, num_nodes, max_accept)
    B, V = tokens.shape
    vocab = x_probs.shape[1]
    dev = tokens.device
    u_all = resolve_uniforms(name, uniforms, generator, B, V, dev).double()
    accept_len, path, emitted = _outputs(B, max_accept, dev)
    if B == 0:
        return accept_len, path, emitted
    n = _num_nodes_tensor(num_nodes, B, V, dev)
    end2 = end.expand(B, V)
    rows = torch.arange(B, device=dev)
    r = x_probs.double().clone()  # [B, vocab]: the current (residual) weights of each row
    S = r.sum(-1)
    c = torch.zeros(B, dtype=torch.long, device=dev)  # the next child to try (the roots start at node 0)
    lim = n.clone()  # children of the current node lie below lim (for x: every real node)
    active = torch.ones(B, dtype=torch.bool, device=dev)
    while True:
        trying = active & (accept_len < max_accept) & (c < lim)
        stop = active & ~trying
        if bool(stop.any()):  # no child left to try: the bonus comes from what is left of r
            emitted[stop, accept_len[stop]] = inverse_cdf_sample(r[stop], u_all[stop, V] * S[stop])
            active &= ~stop
        if not bool(trying.any()):
            break
        cc = c.clamp(0, max(V - 1, 0))
        t = tokens[rows, cc]
        in_vocab = (t >= 0) & (t < vocab)
        tc = t.clamp(0, vocab - 1)
        p_t = torch.where(in_vocab, r[rows, tc], torch.zeros_like(S))
        acc = trying & (u_all[rows, cc] * S < p_t)
        rej = trying & ~acc
        S = torch.where(rej, S - p_t, S)
        zero = rej & in_vocab
        r[rows[zero], tc[zero]] = 0.0
        # the next sibling; max() keeps a malformed end (never from a valid tree) from looping
        c = torch.where(rej, torch.maximum(end2[rows, cc], cc + 1), c)
        if bool(acc.any()):
            path[acc, accept_len[acc]] = cc[acc]
            emitted[acc, accept_len[acc]] = t[acc]
            accept_len += acc.long()
            r[acc] = node_probs[rows[acc], cc[acc]].double()
            S = torch.where(acc, r.sum(-1), S)
            lim = torch.where(acc, torch.minimum(end2[rows, cc], n), lim)
            c = torch.where(acc, cc + 1, c)
    return accept_len, path, emitted
