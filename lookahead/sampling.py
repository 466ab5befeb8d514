"""Sampling parameters, logit warping (temperature, top-h, top-k, top-p, min-p, typical, epsilon and eta cutoffs)
and row sampling: the CPU path.

``warp_logits`` turns logits into the probabilities that verification (``verify_tree_sample_reference`` or the
``verify_tree_sample`` kernel) and ``sample_rows`` consume. It is plain torch on any device, and it is not fused into
the GPU's verification kernel (a top-k/top-p over a 128k vocabulary needs a sort or a selection pass of its own). On a
CPU with the C++ ops built, decoding never calls it: a plain step draws with ``sample_logits`` and a tree step's walk
warps the rows it reaches (``csrc/sample_warped.cpp``, ``csrc/verify_sample.cpp``); ``warp_logits`` is their
tests' oracle. Top-h and the typical, epsilon and eta cutoffs (:attr:`SamplingParams.native` false) are torch only:
with them the CPU path warps with torch too.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import torch

from lookahead_kernels.verify_ref import inverse_cdf_sample


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} tensor of shape {list(value.shape)}"
    return type(value).__name__


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How tokens are drawn, with Hugging Face semantics.

    Attributes:
        temperature: ``>= 0``; logits are divided by it. ``0`` means greedy (argmax).
        top_k: int ``>= 0``; keep the ``top_k`` largest logits (ties with the ``top_k``-th are kept); ``0`` is off.
        top_p: in ``(0, 1]``; keep the smallest set of most likely tokens whose probability sums to ``>= top_p``
            (always at least one token); ``1`` is off.
        min_p: in ``[0, 1]``; then drop the tokens less likely than ``min_p`` times the likeliest (transformers'
            ``MinPLogitsWarper``, after top-p); ``0`` is off.
        typical_p: in ``(0, 1]``; then keep the tokens whose surprise is closest to the row's entropy, the fewest
            that hold ``typical_p`` of the mass (transformers' ``TypicalLogitsWarper``, locally typical sampling);
            ``1`` is off.
        epsilon_cutoff: in ``[0, 1)``; then drop the tokens less likely than it (transformers'
            ``EpsilonLogitsWarper``); ``0`` is off.
        eta_cutoff: in ``[0, 1)``; then drop the tokens less likely than ``min(eta, sqrt(eta) * exp(-entropy))``
            (transformers' ``EtaLogitsWarper``); ``0`` is off.
        The cutoffs never drop the likeliest token.
        top_h: in ``[0, 1]``; after the temperature, keep the likeliest tokens (of the 100 likeliest) while their
            entropy terms sum to at most ``top_h`` times those 100's entropy, the likeliest always (transformers'
            ``TopHLogitsWarper``); ``0`` is off.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    typical_p: float = 1.0
    epsilon_cutoff: float = 0.0
    eta_cutoff: float = 0.0
    top_h: float = 0.0

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, numbers.Real) or not math.isfinite(t) or t < 0:
            raise ValueError(f"SamplingParams.temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        k = self.top_k
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 0:
            raise ValueError(f"SamplingParams.top_k must be an int >= 0 (0 = off), got {k!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, numbers.Real) or not (0 < p <= 1):
            raise ValueError(f"SamplingParams.top_p must be a number in (0, 1] (1 = off), got {p!r}")
        m = self.min_p
        if isinstance(m, bool) or not isinstance(m, numbers.Real) or not (0 <= m <= 1):
            raise ValueError(f"SamplingParams.min_p must be a number in [0, 1] (0 = off), got {m!r}")
        t = self.typical_p
        if isinstance(t, bool) or not isinstance(t, numbers.Real) or not (0 < t <= 1):
            raise ValueError(f"SamplingParams.typical_p must be a number in (0, 1] (1 = off), got {t!r}")
        for name in ("epsilon_cutoff", "eta_cutoff"):
            c = getattr(self, name)
            if isinstance(c, bool) or not isinstance(c, numbers.Real) or not (0 <= c < 1):
                raise ValueError(f"SamplingParams.{name} must be a number in [0, 1) (0 = off), got {c!r}")
        h = self.top_h
        if isinstance(h, bool) or not isinstance(h, numbers.Real) or not (0 <= h <= 1):
            raise ValueError(f"SamplingParams.top_h must be a number in [0, 1] (0 = off), got {h!r}")

    @property
    def native(self) -> bool:
        """Whether the C++ CPU ops implement these parameters (all but top-h and the typical, epsilon and eta
        cutoffs)."""
        return self.typical_p == 1 and self.epsilon_cutoff == 0 and self.eta_cutoff == 0 and self.top_h == 0

    @property
    def is_greedy(self) -> bool:
        """Whether decoding is greedy (``temperature == 0``)."""
        return self.temperature == 0


def warp_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities after temperature, top-h, top-k, top-p, min-p and the typical, epsilon and eta cutoffs (in
    that order, as Hugging Face applies them).

    Args:
        logits: ``[..., V]`` float logits (any float dtype, any device).
        params: the ``SamplingParams``.
    Returns:
        float32 ``[..., V]``: each row sums to 1; removed tokens are exactly ``0``. With ``temperature == 0`` the
        row is one-hot at ``argmax`` (first index among ties), so sampling from it is greedy decoding.
    """
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point() or logits.dim() < 1:
        raise ValueError(f"warp_logits: logits must be a floating tensor [..., V], got {_describe(logits)}")
    if not isinstance(params, SamplingParams):
        raise ValueError(f"warp_logits: params must be a SamplingParams, got {type(params).__name__}")
    V = logits.shape[-1]
    if V < 1:
        raise ValueError("warp_logits: the vocabulary dimension must be >= 1")
    if params.is_greedy:
        x = logits.float()
        out = torch.zeros_like(x)
        return out.scatter_(-1, x.argmax(-1, keepdim=True), 1.0)
    if not params.native:
        return torch.softmax(warp_scores(logits, params), dim=-1)
    probs = torch.softmax(_tempered(logits, params), dim=-1)
    if params.top_p < 1:
        probs = probs * _nucleus(probs, params.top_p)
        probs = probs / probs.sum(-1, keepdim=True)
    if params.min_p > 0:
        probs = probs * ~_below_min_p(probs, params.min_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def _below_min_p(probs: torch.Tensor, min_p: float) -> torch.Tensor:
    """bool ``[..., V]``: the tokens less likely than ``min_p`` times the row's likeliest (never the likeliest)."""
    return probs < min_p * probs.amax(-1, keepdim=True)


def warp_scores(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """float32 ``[..., V]``: the scores transformers' sampling warpers leave (its ``output_scores``): logits over
    the temperature, the tokens top-k and top-p remove at ``-inf``. ``softmax`` of them is :func:`warp_logits`."""
    x = _tempered(logits, params)
    if params.top_p < 1:
        x = x.masked_fill(~_nucleus(torch.softmax(x, dim=-1), params.top_p), float("-inf"))
    if params.min_p > 0:
        x = x.masked_fill(_below_min_p(torch.softmax(x, dim=-1), params.min_p), float("-inf"))
    if params.typical_p < 1:
        x = x.masked_fill(_atypical(x, params.typical_p), float("-inf"))
    for cutoff, entropic in ((params.epsilon_cutoff, False), (params.eta_cutoff, True)):
        if cutoff > 0:
            x = x.masked_fill(_below_cutoff(x, cutoff, entropic), float("-inf"))
    return x


TOP_H_CANDIDATES = 100  # transformers' TopHLogitsWarper looks at this many of the likeliest tokens


def _outside_top_h(x: torch.Tensor, top_h: float) -> torch.Tensor:
    """bool ``[..., V]``: the tokens top-h drops from scores ``x``, computed with transformers' own operations (a
    categorical over the likeliest ``TOP_H_CANDIDATES``, its entropy and the running sum of its entropy terms), so
    that ties and roundings fall the same way."""
    V = x.shape[-1]
    rows = x.reshape(-1, V)
    top, index = torch.topk(rows, min(TOP_H_CANDIDATES, V), dim=-1, largest=True, sorted=True)
    dist = torch.distributions.Categorical(logits=top, validate_args=False)  # no host check: graphs hold it
    probs = dist.probs
    tau = (dist.entropy() * top_h).unsqueeze(-1)
    keep = torch.cumsum(-probs * torch.log(probs), dim=-1) <= tau
    keep[:, 0] = True
    kept = torch.zeros_like(rows, dtype=torch.bool).scatter_(1, index, keep)
    return ~kept.reshape(x.shape)


def _entropy(logp: torch.Tensor) -> torch.Tensor:
    """``[..., 1]``: the entropy of rows of log-probabilities (removed tokens, ``-inf``, count for nothing)."""
    return -(logp * logp.exp()).nansum(-1, keepdim=True)


def _atypical(x: torch.Tensor, mass: float) -> torch.Tensor:
    """bool ``[..., V]``: the tokens locally typical sampling removes from scores ``x``. Tokens are ranked by how far
    their surprise ``-log p`` lies from the row's entropy; the first ones holding ``mass`` of the probability are
    kept, with every token as close as the last of them (never fewer than one)."""
    logp = torch.log_softmax(x, dim=-1)
    distance = (-logp - _entropy(logp)).abs()
    ranked, order = torch.sort(distance, dim=-1)
    mass_before = torch.softmax(x.gather(-1, order), dim=-1).cumsum(-1)
    last = (mass_before < mass).sum(-1, keepdim=True).clamp(max=x.shape[-1] - 1)
    drop = ranked > ranked.gather(-1, last)
    drop[..., 0] = False
    return torch.zeros_like(drop).scatter_(-1, order, drop)


def _below_cutoff(x: torch.Tensor, cutoff: float, entropic: bool) -> torch.Tensor:
    """bool ``[..., V]``: the tokens less likely than ``cutoff`` (epsilon sampling), or with ``entropic`` than
    ``min(cutoff, sqrt(cutoff) * exp(-entropy))`` (eta sampling); never the likeliest."""
    logp = torch.log_softmax(x, dim=-1)
    bound = cutoff  # compared in x's dtype; no tensor made from a host number (a CUDA graph capture refuses the copy)
    if entropic:
        bound = (math.sqrt(cutoff) * torch.exp(-_entropy(logp))).clamp(max=cutoff)
    return (logp.exp() < bound) & (x < x.amax(-1, keepdim=True))


def _tempered(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """float32 logits over the temperature, those top-h drops and those below the top-k's k-th largest at -inf."""
    x = logits.float() / params.temperature
    if params.top_h > 0:
        x = x.masked_fill(_outside_top_h(x, params.top_h), float("-inf"))
    if 0 < params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    return x


# Top-p first looks for the nucleus among this many of the likeliest tokens (on the CPU, where sorting a 49k
# vocabulary took 6 ms a row, and a top-k selection 0.2 ms).
NUCLEUS_CANDIDATES = 128


def _nucleus_of_sorted(sorted_p: torch.Tensor, top_p: float) -> torch.Tensor:
    """Which of the tokens, in the stable descending order of ``sorted_p``, top-p keeps: those with less than
    ``top_p`` mass strictly before them (a prefix, never empty)."""
    before = sorted_p.cumsum(-1) - sorted_p  # mass of the strictly more likely tokens
    keep = before < top_p
    keep[..., 0] = True
    return keep


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """bool ``[..., V]``: the tokens top-p keeps, as a stable descending sort of ``probs`` defines them.

    On the CPU the nucleus is first sought among the ``NUCLEUS_CANDIDATES`` likeliest tokens, put in that same
    order (value descending, ties by index). That gives the full sort's answer where the kept prefix ends before the
    candidates' smallest value: the tokens above it are exactly the full order's first ones, and each keep decision
    reads only the mass before it. Else (a flat distribution, ties at the edge), and on other devices (where a
    graph holds this step: no host sync), the whole vocabulary is sorted."""
    V = probs.shape[-1]
    k = min(NUCLEUS_CANDIDATES, V)
    if probs.device.type == "cpu" and k < V:
        values, index = torch.topk(probs, k, dim=-1)  # any order among ties: put them by index, then by value
        index, by_index = torch.sort(index, dim=-1)
        values = values.gather(-1, by_index)
        sorted_p, order = torch.sort(values, dim=-1, descending=True, stable=True)
        index = index.gather(-1, order)  # the k likeliest, value descending, ties by index
        keep = _nucleus_of_sorted(sorted_p, top_p)
        exact = (sorted_p > sorted_p[..., -1:]).sum(-1)  # leading candidates in the full sort's order
        if bool((keep.sum(-1) <= exact).all()):
            return torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, index, keep)
    sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    return torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, order, _nucleus_of_sorted(sorted_p, top_p))


def sample_logits(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None,
                  uniforms: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of ``logits [R, V]`` (float, any device), drawn from ``warp_logits(logits, params)`` by
    :func:`sample_rows`' rule (one float64 uniform a row, ``uniforms`` ``[R]`` or drawn from ``generator`` the same
    way; inverse CDF in token order): int64 ``[R]``.

    On the CPU with the C++ ops built, one op draws without building the warped rows
    (``lookahead_draft.sample_warped``, 0.07 ms a row of 49k tokens on a 2-core CPU, where warping it and reading
    its CDF with torch took 0.9-1.4 ms of a 13-15 ms sampled step); it does not renormalise the nucleus first (the
    target is the uniform times its mass): the same rule up to rounding. Elsewhere (a GPU, whose graph holds this
    step; a CPU without the ops) it is ``sample_rows(warp_logits(...))``."""
    R = logits.shape[0]
    if logits.device.type == "cpu" and not params.is_greedy and params.native and R:
        from lookahead_kernels.cpu_ops import cpu_ops_available

        if cpu_ops_available(build=False):
            u = _row_uniforms("sample_logits", uniforms, R, generator, logits.device)
            x = logits if logits.dtype == torch.float32 and logits.stride(-1) == 1 else logits.float().contiguous()
            return torch.ops.lookahead_draft.sample_warped(x, params.temperature, params.top_k, params.top_p,
                                                           params.min_p,
                                                           u.contiguous())
    return sample_rows(warp_logits(logits, params), generator, uniforms=uniforms)


def _row_uniforms(name: str, uniforms: torch.Tensor | None, R: int, generator: torch.Generator | None,
                  device) -> torch.Tensor:
    """float64 ``[R]`` on ``device``: ``uniforms`` checked, or drawn from ``generator`` (one ``torch.rand``)."""
    if uniforms is None:
        return torch.rand(R, dtype=torch.float64, device=device, generator=generator)
    if uniforms.numel() != R or uniforms.device != torch.device(device):
        raise ValueError(f"{name}: uniforms must hold one value per row ({R}) on {device}, "
                         f"got {_describe(uniforms)} on {uniforms.device}")
    return uniforms.reshape(-1).double()


def sample_rows(probs: torch.Tensor, generator: torch.Generator | None = None,
                uniforms: torch.Tensor | None = None) -> torch.Tensor:
    """Draw one token per row of ``probs`` ``[..., V]`` (nonnegative, need not be normalised).

    One float64 uniform per row (``uniforms``, ``R`` values in ``[0, 1)`` for the ``R`` rows in order, on
    ``probs.device``; drawn with ``torch.rand(generator=generator)`` when ``None``), then inverse CDF
    (``lookahead_kernels.verify_ref.inverse_cdf_sample``: a zero-probability token is never drawn). Returns
    int64 ``[...]``; ``-1`` only for a row without positive mass (invalid input).
    """
    if not isinstance(probs, torch.Tensor) or not probs.is_floating_point() or probs.dim() < 1 or probs.shape[-1] < 1:
        raise ValueError(f"sample_rows: probs must be a floating tensor [..., V] with V >= 1, got {_describe(probs)}")
    lead = probs.shape[:-1]
    rows = probs.reshape(-1, probs.shape[-1]).double()
    u = _row_uniforms("sample_rows", uniforms, rows.shape[0], generator, probs.device)
    return inverse_cdf_sample(rows, u * rows.sum(-1)).reshape(lead)
