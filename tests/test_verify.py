"""Verification kernels against their torch references, the sampling verifier's statistics, and warping.

Kernel tests run on ``kernel_device`` (CUDA, or CPU under Triton's interpreter), so shapes stay small; outputs
are written into buffers poisoned with ``POISON`` so that an element the kernel forgets fails the comparison.
"""

import numpy as np
import pytest
import torch
from scipy import stats

from lookahead.sampling import SamplingParams, sample_rows, warp_logits
from lookahead_kernels.verify_ref import (draw_verify_uniforms, inverse_cdf_sample, verify_greedy_reference,
                                          verify_sample_reference)

POISON = -777


@pytest.fixture(scope="module")
def vk():
    from lookahead_kernels import verify  # after conftest has set TRITON_INTERPRET on CPU
    return verify


def poisoned(B, K, device):
    return (torch.full((B,), POISON, dtype=torch.long, device=device),
            torch.full((B,), POISON, dtype=torch.long, device=device),
            torch.full((B, K + 1), POISON, dtype=torch.long, device=device))


def assert_same(ref, got):
    names = ("accept_len", "best", "tokens")
    for name, r, g in zip(names, ref, got):
        assert not (g == POISON).any(), f"{name}: unwritten elements"
        assert torch.equal(r.cpu(), g.cpu()), f"{name} differs:\nreference {r}\nkernel    {g}"


def greedy_case(B, G, K, V, gen, device, dtype=torch.float32, ties=False, plant=True):
    """Random logits and candidates; some candidates follow the argmax chain so that prefixes get accepted."""
    if ties:  # few distinct values: many equal maxima
        x = torch.randint(0, 3, (B, V), generator=gen).to(dtype)
        c = torch.randint(0, 3, (B, G, K, V), generator=gen).to(dtype)
    else:
        x = torch.randn(B, V, generator=gen).to(dtype)
        c = torch.randn(B, G, K, V, generator=gen).to(dtype)
    cand = torch.randint(0, V, (B, G, K), generator=gen)
    if plant and G > 0:
        y0, pred = x.argmax(-1), c.argmax(-1)
        for b in range(B):
            for g in range(G):
                depth = int(torch.randint(0, K + 1, (1,), generator=gen))  # follow the chain this deep
                for m in range(depth):
                    cand[b, g, m] = y0[b] if m == 0 else pred[b, g, m - 1]
    return x.to(device), c.to(device), cand.to(device)


# ---- greedy -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("B,G,K,V,ties,splits", [
    (3, 4, 3, 50, False, None), (3, 4, 3, 50, True, None), (2, 5, 2, 37, True, 3), (4, 3, 1, 20, True, None),
    (2, 2, 4, 1000, False, 4),
])
def test_greedy_matches_reference(vk, kernel_device, B, G, K, V, ties, splits):
    gen = torch.Generator().manual_seed(B * 1000 + G * 100 + K * 10 + V + ties)
    for _ in range(3):
        x, c, cand = greedy_case(B, G, K, V, gen, kernel_device, ties=ties)
        ref = verify_greedy_reference(x, c, cand)
        got = vk.verify_greedy(x, c, cand, vocab_splits=splits, out=poisoned(B, K, kernel_device))
        assert_same(ref, got)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_greedy_dtypes(vk, kernel_device, dtype):
    gen = torch.Generator().manual_seed(7)
    x, c, cand = greedy_case(3, 3, 2, 64, gen, kernel_device, dtype=dtype, ties=True)
    assert_same(verify_greedy_reference(x, c, cand),
                vk.verify_greedy(x, c, cand, vocab_splits=2, out=poisoned(3, 2, kernel_device)))


def test_greedy_duplicates_all_rejected_all_accepted(vk, kernel_device):
    gen = torch.Generator().manual_seed(1)
    B, G, K, V = 3, 4, 3, 40
    x, c, cand = greedy_case(B, G, K, V, gen, kernel_device, plant=False)
    y0, pred = x.argmax(-1), c.argmax(-1)
    # row 0: every candidate rejected at depth 1
    cand[0] = (y0[0] + 1) % V
    # row 1: candidate 2 fully accepted, candidates 1 and 3 duplicate it (best must be the first, 1)
    chain = torch.stack([y0[1], pred[1, 1, 0], pred[1, 1, 1]])
    cand[1, 1] = chain
    cand[1, 2] = chain
    cand[1, 3] = chain
    c[1, 2] = c[1, 1]
    c[1, 3] = c[1, 1]
    # row 2: all candidates identical, accepted one token deep
    cand[2] = torch.stack([y0[2], (pred[2, 0, 0] + 1) % V, y0[2]])
    c[2] = c[2, 0]
    ref = verify_greedy_reference(x, c, cand)
    assert ref[0].tolist() == [0, 3, 1] and ref[1].tolist() == [-1, 1, 0]
    assert_same(ref, vk.verify_greedy(x, c, cand, out=poisoned(B, K, kernel_device)))


def test_greedy_no_candidates(vk, kernel_device):
    gen = torch.Generator().manual_seed(2)
    x, c, cand = greedy_case(2, 0, 3, 30, gen, kernel_device)
    ref = verify_greedy_reference(x, c, cand)
    assert ref[2][:, 1:].eq(-1).all()
    assert_same(ref, vk.verify_greedy(x, c, cand, out=poisoned(2, 3, kernel_device)))


@pytest.mark.parametrize("as_tensor", [False, True])
def test_greedy_fewer_candidates_with_garbage(vk, kernel_device, as_tensor):
    gen = torch.Generator().manual_seed(3)
    B, G, K, V = 3, 5, 3, 50
    x, c, cand = greedy_case(B, G, K, V, gen, kernel_device)
    n = torch.tensor([2, 0, 5], device=kernel_device) if as_tensor else 3
    nl = n.tolist() if as_tensor else [n] * B
    for b in range(B):  # unused rows: the best possible candidate, NaN logits, ids out of range
        cand[b, nl[b]:] = cand[b, 0]
        if nl[b] < G:
            cand[b, nl[b]:, 0] = x[b].argmax()
            cand[b, -1] = torch.tensor([-1, V + 3, 2**40])
            c[b, nl[b]:] = float("nan")
    ref = verify_greedy_reference(x, c, cand, n)
    assert_same(ref, vk.verify_greedy(x, c, cand, n, vocab_splits=2, out=poisoned(B, K, kernel_device)))


@pytest.mark.parametrize("V", [1000, 32000, 49152, 128256])
def test_greedy_vocab_sizes(vk, kernel_device, V):
    gen = torch.Generator().manual_seed(V)
    B, G, K = 1, 2, 2
    x, c, cand = greedy_case(B, G, K, V, gen, kernel_device)
    x[0, V - 1] = x[0].max() + 1  # the maximum in the last slice of the vocabulary
    cand[0, 1, 0] = V - 1
    ref = verify_greedy_reference(x, c, cand)
    assert_same(ref, vk.verify_greedy(x, c, cand, out=poisoned(B, K, kernel_device)))


def test_greedy_strided_views(vk, kernel_device):
    """x and candidate rows as views into the model's [B, T, V] logits, as the decoding loop passes them."""
    gen = torch.Generator().manual_seed(4)
    B, la, G, K, V = 2, 5, 3, 2, 40
    logits = torch.randn(B, la + G * K, V, generator=gen).to(kernel_device)
    x, c = logits[:, 0], logits[:, la:].view(B, G, K, V)
    cand = torch.randint(0, V, (B, G, K), generator=gen).to(kernel_device)
    cand[:, 0, 0] = x.argmax(-1)
    cand[:, 0, 1] = c[:, 0, 0].argmax(-1)
    ref = verify_greedy_reference(x, c, cand)
    assert ref[0].tolist() == [2, 2]
    assert_same(ref, vk.verify_greedy(x, c, cand, out=poisoned(B, K, kernel_device)))


def test_greedy_nan_like_torch(vk, kernel_device):
    x = torch.tensor([[0.0, 5.0, float("nan"), 5.0, float("nan")], [1.0, 1.0, 1.0, 0.0, 1.0]], device=kernel_device)
    c = torch.zeros(2, 1, 1, 5, device=kernel_device)
    cand = torch.tensor([[[2]], [[0]]], device=kernel_device)
    ref = verify_greedy_reference(x, c, cand)
    assert ref[0].tolist() == [1, 1]
    assert_same(ref, vk.verify_greedy(x, c, cand, vocab_splits=2, out=poisoned(2, 1, kernel_device)))


@pytest.mark.parametrize("R,V,splits,ties", [(7, 1000, None, False), (5, 300, 3, True), (3, 128256, None, False)])
def test_row_argmax(vk, kernel_device, R, V, splits, ties):
    gen = torch.Generator().manual_seed(R + V)
    logits = (torch.randint(0, 4, (R, V), generator=gen).float() if ties else torch.randn(R, V, generator=gen))
    logits = logits.to(kernel_device)
    out = torch.full((R,), POISON, dtype=torch.long, device=kernel_device)
    got = vk.row_argmax(logits, vocab_splits=splits, out=out)
    assert torch.equal(got.cpu(), logits.argmax(-1).cpu())
    view = logits[::2]  # strided rows
    assert torch.equal(vk.row_argmax(view).cpu(), view.argmax(-1).cpu())


# ---- sampling: kernel == reference ---------------------------------------------------------------------------------
def sample_case(B, G, K, V, gen, device, hot=4, dtype=torch.float32):
    """Peaked random distributions over ``hot`` tokens (so that walks go deep), some exact zeros, candidates
    drawn mostly from the hot tokens (duplicates included), and a few ids out of range."""
    def dist(*shape):
        w = torch.rand(*shape, V, generator=gen) * 0.05
        w[..., :hot] += torch.rand(*shape, hot, generator=gen) * 4
        w[torch.rand(*shape, V, generator=gen) < 0.2] = 0
        w[..., 0] += 0.1  # every row keeps some mass
        return (w / w.sum(-1, keepdim=True)).to(dtype)
    x, c = dist(B), dist(B, G, K)
    cand = torch.randint(0, hot + 1, (B, G, K), generator=gen)
    cand[torch.rand(B, G, K, generator=gen) < 0.05] = -1
    return x.to(device), c.to(device), cand.to(device)


@pytest.mark.parametrize("B,G,K,V,dtype", [
    (6, 4, 3, 20, torch.float32), (4, 1, 1, 9, torch.float32), (3, 6, 2, 33, torch.float16),
    (3, 3, 4, 17, torch.bfloat16), (3, 0, 2, 12, torch.float32),
])
def test_sample_matches_reference(vk, kernel_device, B, G, K, V, dtype):
    gen = torch.Generator().manual_seed(B + 10 * G + 100 * K + V)
    x, c, cand = sample_case(B, G, K, V, gen, kernel_device, dtype=dtype)
    u = draw_verify_uniforms(B, G, K, generator=gen).to(kernel_device)
    ref = verify_sample_reference(x, c, cand, uniforms=u)
    assert_same(ref, vk.verify_sample(x, c, cand, uniforms=u, out=poisoned(B, K, kernel_device)))


def test_sample_matches_reference_num_candidates_and_seed(vk, kernel_device):
    gen = torch.Generator().manual_seed(11)
    B, G, K, V = 4, 5, 3, 16
    x, c, cand = sample_case(B, G, K, V, gen, kernel_device)
    n = torch.tensor([5, 0, 2, 3], device=kernel_device)
    c[2, 2:] = float("nan")  # unused rows are never read
    u = draw_verify_uniforms(B, G, K, generator=gen).to(kernel_device)
    assert_same(verify_sample_reference(x, c, cand, n, uniforms=u),
                vk.verify_sample(x, c, cand, n, uniforms=u, out=poisoned(B, K, kernel_device)))
    # the launcher draws with draw_verify_uniforms on the tensors' device: same seed, same result
    g1 = torch.Generator(device=kernel_device).manual_seed(5)
    g2 = torch.Generator(device=kernel_device).manual_seed(5)
    got = vk.verify_sample(x, c, cand, 3, generator=g1)
    ref = verify_sample_reference(x, c, cand, 3, uniforms=draw_verify_uniforms(B, G, K, kernel_device, g2))
    assert_same(ref, got)


def test_sample_big_vocab(vk, kernel_device):
    gen = torch.Generator().manual_seed(12)
    B, G, K, V = 1, 2, 2, 128256
    x, c, cand = sample_case(B, G, K, V, gen, kernel_device, hot=2)
    for u_first in (0.0, 0.999):  # accept the first try / reject everything
        u = draw_verify_uniforms(B, G, K, generator=gen).to(kernel_device)
        u[:, :, 0] = u_first
        assert_same(verify_sample_reference(x, c, cand, uniforms=u),
                    vk.verify_sample(x, c, cand, uniforms=u, out=poisoned(B, K, kernel_device)))


def consistent_case(B, G, K, V, gen, device):
    """Logits that depend only on the prefix (as a real model's do), with ties, and candidates that share
    prefixes and follow the argmax chain to random depths. (Greedy and sampling agree only on such inputs:
    the sampling walk reads the row of the first candidate that carries the accepted prefix.)"""
    table = {}

    def row(key):
        if key not in table:
            table[key] = torch.randint(0, 3, (V,), generator=gen).float()
        return table[key]

    x = torch.stack([row((b,)) for b in range(B)])
    cand = torch.randint(0, 3, (B, G, K), generator=gen)
    c = torch.empty(B, G, K, V)
    for b in range(B):
        for g in range(G):
            depth = int(torch.randint(0, K + 1, (1,), generator=gen))
            for m in range(K):
                if m < depth:
                    cand[b, g, m] = (x[b] if m == 0 else c[b, g, m - 1]).argmax()
                c[b, g, m] = row((b, *cand[b, g, :m + 1].tolist()))
    return x.to(device), c.to(device), cand.to(device)


def test_temperature_zero_is_greedy(vk, kernel_device):
    gen = torch.Generator().manual_seed(13)
    B, G, K, V = 4, 3, 3, 30
    x, c, cand = consistent_case(B, G, K, V, gen, kernel_device)
    greedy = SamplingParams(temperature=0)
    assert greedy.is_greedy and not SamplingParams().is_greedy
    xp, cp = warp_logits(x, greedy), warp_logits(c, greedy)
    ref = verify_greedy_reference(x, c, cand)
    assert ref[0].max() >= 2
    u = draw_verify_uniforms(B, G, K, generator=gen).to(kernel_device)
    assert_same(ref, verify_sample_reference(xp, cp, cand, uniforms=u))
    assert_same(ref, vk.verify_sample(xp, cp, cand, uniforms=u, out=poisoned(B, K, kernel_device)))


# ---- sampling: the verifier keeps the target distribution ----------------------------------------------------------
def chi2_pvalue(counts: np.ndarray, p: np.ndarray) -> float:
    p = np.asarray(p, dtype=np.float64)
    support = p > 0
    assert counts[~support].sum() == 0, f"tokens with probability 0 were emitted: {counts}"
    expected = p[support] / p[support].sum() * counts.sum()
    return stats.chisquare(counts[support], expected).pvalue


V_STAT = 6
P_X = np.array([0.3, 0.0, 0.25, 0.2, 0.15, 0.1])  # at x; token 1 is impossible


def two_depth_model(seed):
    """A known 2-step model: p at x, q[a] after token a, r[a, b] after (a, b); some exact zeros."""
    rng = np.random.default_rng(seed)
    q = rng.random((V_STAT, V_STAT)) + 0.05
    q[rng.random((V_STAT, V_STAT)) < 0.3] = 0
    q[:, 4] += 0.2
    r = rng.random((V_STAT, V_STAT, V_STAT))
    q, r = q / q.sum(-1, keepdims=True), r / r.sum(-1, keepdims=True)
    return q, r


def stat_inputs(B, G, gen, q, r, device="cpu"):
    """Candidates: random tokens (impossible ones included); each row's probabilities follow its prefix."""
    K = 2
    qt, rt = torch.tensor(q), torch.tensor(r)
    cand = torch.randint(0, V_STAT, (B, G, K), generator=gen)
    # half the candidates are good drafts (drawn from the model itself), so that walks often go deep
    good = torch.rand(B, G, generator=gen) < 0.5
    first = torch.multinomial(torch.tensor(P_X), B * G, replacement=True, generator=gen).view(B, G)
    second = torch.multinomial(qt[first].view(-1, V_STAT), 1, generator=gen).view(B, G)
    cand[good] = torch.stack([first, second], -1)[good]
    cand[torch.rand(B, generator=gen) < 0.2, 0, 0] = 1  # some rows first try an impossible token
    x = torch.tensor(P_X, dtype=torch.float64).expand(B, V_STAT)
    c = torch.stack([qt[cand[..., 0]], rt[cand[..., 0], cand[..., 1]]], dim=2)  # [B, G, 2, V]
    return x.float().to(device), c.float().to(device), cand.to(device)


def check_two_depth(tokens, accept, q, r, min_count=40):
    tokens, accept = tokens.cpu().numpy(), accept.cpu().numpy()
    pvals = [chi2_pvalue(np.bincount(tokens[:, 0], minlength=V_STAT), P_X)]
    for a in range(V_STAT):  # second token given the first (emitted when the first was accepted)
        sel = (accept >= 1) & (tokens[:, 0] == a)
        if sel.sum() >= min_count:
            pvals.append(chi2_pvalue(np.bincount(tokens[sel, 1], minlength=V_STAT), q[a]))
    for a in range(V_STAT):  # third token given the first two (the bonus after a full acceptance)
        for b in range(V_STAT):
            sel = (accept == 2) & (tokens[:, 0] == a) & (tokens[:, 1] == b)
            if sel.sum() >= min_count:
                pvals.append(chi2_pvalue(np.bincount(tokens[sel, 2], minlength=V_STAT), r[a, b]))
    return pvals


@pytest.mark.parametrize("G", [1, 4])
def test_sample_reference_keeps_distribution(G):
    q, r = two_depth_model(G)
    gen = torch.Generator().manual_seed(100 + G)
    B = 40000
    x, c, cand = stat_inputs(B, G, gen, q, r)
    accept, best, tokens = verify_sample_reference(x, c, cand, uniforms=draw_verify_uniforms(B, G, 2, generator=gen))
    pvals = check_two_depth(tokens, accept, q, r)
    assert len(pvals) >= 1 + V_STAT - 1
    assert min(pvals) > 1e-3, pvals
    # the walk really went deep, and the best candidate carries the accepted tokens
    assert (accept == 2).float().mean() > 0.02
    rows = torch.nonzero(accept > 0).squeeze(1)
    picked = cand[rows, best[rows]]
    depth = torch.arange(2)[None, :] < accept[rows, None]
    assert torch.equal(picked[depth], tokens[rows, :2][depth])


def test_sample_kernel_keeps_distribution(vk, kernel_device):
    q, r = two_depth_model(7)
    gen = torch.Generator().manual_seed(7)
    B, G = 300 if kernel_device == "cpu" else 40000, 2
    x, c, cand = stat_inputs(B, G, gen, q, r, kernel_device)
    accept, best, tokens = vk.verify_sample(x, c, cand, generator=torch.Generator(kernel_device).manual_seed(3))
    pvals = check_two_depth(tokens, accept, q, r, min_count=60)
    assert min(pvals) > 1e-3, pvals


def test_inverse_cdf_boundaries():
    w = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]] * 4, dtype=torch.float64)
    target = torch.tensor([0.0, 0.5, 0.9999, 1.0], dtype=torch.float64)  # 1.0: past the end by "rounding"
    assert inverse_cdf_sample(w, target).tolist() == [1, 3, 3, 3]
    assert inverse_cdf_sample(torch.zeros(1, 3, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)).item() == -1


# ---- warping and row sampling ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 5, 1.0), (0.9, 0, 0.8),
                                                     (0.6, 10, 0.5), (1.0, 3, 0.01), (2.0, 1000, 0.95)])
def test_warp_matches_hf(temperature, top_k, top_p):
    from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)
    gen = torch.Generator().manual_seed(int(temperature * 10) + top_k)
    logits = torch.randn(6, 200, generator=gen) * 3
    params = SamplingParams(temperature, top_k, top_p)
    probs = warp_logits(logits, params)
    assert probs.dtype == torch.float32 and not probs.isnan().any()
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    expected = torch.softmax(scores, -1)
    assert torch.equal(probs > 0, expected > 0)
    err = ((probs.double() - expected.double()).abs() / expected.double().clamp_min(1e-30)).max()
    assert err < 1e-5
    torch.testing.assert_close(probs.sum(-1), torch.ones(6))


def test_warp_keeps_at_least_one_and_greedy_one_hot():
    logits = torch.tensor([[0.0, 10.0, 10.0, -1.0]])
    assert warp_logits(logits, SamplingParams(top_p=1e-9)).gt(0).sum() == 1
    assert warp_logits(logits, SamplingParams(temperature=0)).tolist() == [[0.0, 1.0, 0.0, 0.0]]
    assert warp_logits(logits, SamplingParams(top_k=1)).gt(0).sum() == 2  # ties at the k-th value are kept


def test_sample_rows_distribution():
    p = torch.tensor([0.1, 0.0, 0.4, 0.3, 0.2, 0.0])
    gen = torch.Generator().manual_seed(21)
    draws = sample_rows(p.expand(3, 20000, 6), gen)
    assert draws.shape == (3, 20000) and draws.dtype == torch.long
    counts = np.bincount(draws.flatten().numpy(), minlength=6)
    assert chi2_pvalue(counts, p.numpy()) > 1e-3


@pytest.mark.parametrize("kwargs", [dict(temperature=-0.1), dict(temperature=float("nan")), dict(top_p=0.0),
                                    dict(top_p=1.5), dict(top_k=-1), dict(top_k=2.0), dict(top_k=True),
                                    dict(temperature="1")])
def test_bad_sampling_params(kwargs):
    with pytest.raises(ValueError, match="SamplingParams"):
        SamplingParams(**kwargs)


def test_bad_warp_and_sample_inputs():
    with pytest.raises(ValueError, match="logits"):
        warp_logits(torch.zeros(3, dtype=torch.long), SamplingParams())
    with pytest.raises(ValueError, match="SamplingParams"):
        warp_logits(torch.zeros(3), {"temperature": 1.0})
    with pytest.raises(ValueError, match="probs"):
        sample_rows(torch.zeros(2, 0))


# ---- bad arguments --------------------------------------------------------------------------------------------------
def test_bad_verify_arguments(vk, kernel_device):
    dev = kernel_device
    x, c = torch.rand(2, 10, device=dev), torch.rand(2, 3, 2, 10, device=dev)
    cand = torch.zeros(2, 3, 2, dtype=torch.long, device=dev)
    cases = [
        ((x, c, cand.int()), {}, "int64"),
        ((x, c, cand[..., :0]), {}, "K >= 1"),
        ((x[:1], c, cand), {}, r"\[B, V\]"),
        ((x, c[:, :2], cand), {}, r"\[B, G, K, V\]"),
        ((x.double(), c, cand), {}, "dtype"),
        ((x, c, cand, 4), {}, "0..G"),
        ((x, c, cand, torch.tensor([1, 2, 3], device=dev)), {}, "int64"),
        ((x, c, cand, 1.5), {}, "num_candidates"),
    ]
    for fn in (vk.verify_greedy, vk.verify_sample, verify_greedy_reference_checked, verify_sample_reference_checked):
        for args, kw, msg in cases:
            with pytest.raises(ValueError, match=msg):
                fn(*args, **kw)
    if dev == "cpu":
        with pytest.raises(ValueError, match="0..G"):
            vk.verify_greedy(x, c, cand, torch.tensor([1, 4]))
    with pytest.raises(ValueError, match="uniforms"):
        vk.verify_sample(x, c, cand, uniforms=torch.rand(2, 2, 3, device=dev))
    with pytest.raises(ValueError, match="either generator or uniforms"):
        vk.verify_sample(x, c, cand, generator=torch.Generator(dev), uniforms=draw_verify_uniforms(2, 3, 2, dev))
    with pytest.raises(ValueError, match="out"):
        vk.verify_greedy(x, c, cand, out=poisoned(2, 3, dev))
    with pytest.raises(ValueError, match="vocab_splits"):
        vk.verify_greedy(x, c, cand, vocab_splits=0)
    with pytest.raises(ValueError, match=r"\[R, V\]"):
        vk.row_argmax(x[0])


def verify_greedy_reference_checked(*args, **kw):
    from lookahead_kernels.verify_ref import check_verify_inputs
    check_verify_inputs("verify_greedy_reference", *args[:3], args[3] if len(args) > 3 else None)
    return verify_greedy_reference(*args, **kw)


def verify_sample_reference_checked(*args, **kw):
    B, G, K = args[2].shape if args[2].dim() == 3 else (2, 3, 2)
    return verify_sample_reference(*args, uniforms=draw_verify_uniforms(B, G, max(K, 1), args[0].device), **kw)


def test_custom_ops_opcheck(vk, kernel_device):
    """Schemas, fake (meta) implementations and mutation declarations of the registered ops."""
    gen = torch.Generator().manual_seed(31)
    B, G, K, V = 2, 2, 2, 16
    x, c, cand = greedy_case(B, G, K, V, gen, kernel_device)
    xp, cp = torch.softmax(x, -1), torch.softmax(c, -1)
    u = draw_verify_uniforms(B, G, K, generator=gen).to(kernel_device)
    n = torch.tensor([2, 1], device=kernel_device)
    tests = ("test_schema", "test_faketensor")
    torch.library.opcheck(torch.ops.lookahead.verify_greedy_out.default,
                          (x, c, cand, n, G, 0, *poisoned(B, K, kernel_device)), test_utils=tests)
    torch.library.opcheck(torch.ops.lookahead.verify_sample_out.default,
                          (xp, cp, cand, None, G, u, *poisoned(B, K, kernel_device)), test_utils=tests)
    torch.library.opcheck(torch.ops.lookahead.row_argmax_out.default,
                          (x, 2, torch.empty(B, dtype=torch.long, device=kernel_device)), test_utils=tests)


_SM90_SCRIPT = r'''
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from lookahead_kernels import verify as vk

assert isinstance(vk._sample_walk_kernel, triton.runtime.JITFunction)
h100 = GPUTarget("cuda", 90, 32)


def build(fn, pointers, consts, ones=()):
    sig = {name: "i32" for name in fn.arg_names}  # sizes and strides
    sig.update(pointers)
    consts = dict(consts, **{name: 1 for name in ones})  # Triton specialises ints equal to 1 as constants
    sig.update({name: "constexpr" for name in consts})
    triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=h100, options=dict(num_warps=8))


for dtype, ones in (("fp32", ("sxv", "scv", "sug", "G")), ("bf16", ())):
    build(vk._sample_walk_kernel,
          dict(x_ptr="*" + dtype, c_ptr="*" + dtype, cand_ptr="*i64", n_ptr="*i64", u_ptr="*fp64", acc_ptr="*i64",
               best_ptr="*i64", tok_ptr="*i64"),
          dict(HAS_N_TENSOR=not ones, BLOCK_G=16, BLOCK_K1=8, BLOCK_V=1024), ones)
for dtype, f64 in (("fp16", False), ("fp64", True)):
    build(vk._argmax_partial_kernel,
          dict(x_ptr="*" + dtype, c_ptr="*" + dtype, n_ptr="*i64", val_ptr="*fp64", idx_ptr="*i64"),
          dict(HAS_X=not f64, HAS_N_TENSOR=f64, F64=f64, BLOCK_V=2048), ("sxv", "scv"))
build(vk._greedy_walk_kernel,
      dict(val_ptr="*fp64", idx_ptr="*i64", cand_ptr="*i64", n_ptr="*i64", acc_ptr="*i64", best_ptr="*i64",
           tok_ptr="*i64"), dict(HAS_N_TENSOR=True, BLOCK_G=16, BLOCK_K=8), ("stk",))
build(vk._row_argmax_merge_kernel, dict(val_ptr="*fp64", idx_ptr="*i64", out_ptr="*i64"), dict(BLOCK_R=128))
print("sm90 ok")
'''


def test_kernels_compile_for_h100(kernel_device):
    """The interpreter never compiles: build every kernel for sm_90 through ptxas so compiled-path type errors
    (loop-carried types, constexpr specialisation of strides equal to 1) show up without a GPU."""
    import os
    import shutil
    import subprocess
    import sys

    if kernel_device == "cuda":
        pytest.skip("on a GPU the other tests compile the kernels")
    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not (os.path.exists(ptxas) or shutil.which("ptxas")):
        pytest.skip("this Triton install has no ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", _SM90_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "sm90 ok" in proc.stdout, proc.stderr[-3000:]
