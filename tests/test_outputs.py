"""output_scores and output_logits: for each new token, the row it was chosen from, as transformers' generate returns
them (greedy: equal to transformers' own; sampled: transformers' own processors and warpers applied to the model's
logits at each prefix of the sampled sequence), whether the token came from a plain step or a verified tree node."""

import pytest
import torch
from transformers import (LogitsProcessorList, MinNewTokensLengthLogitsProcessor, RepetitionPenaltyLogitsProcessor,
                          TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from lookahead import LlamaForCausalLM, LookaheadConfig

from .test_batch import mixed_prompts
from .test_generate import tiny_hf_model

CONFIGS = [None, LookaheadConfig(window=4, ngram=3, guess=4), LookaheadConfig(),
           LookaheadConfig(max_step_tokens=16, sources=("pool",))]


@pytest.fixture(scope="module")
def tiny():
    hf = tiny_hf_model(seed=3)
    return hf, LlamaForCausalLM.from_hf(hf)


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal -inf patterns, and the finite values equal within float32 rounding."""
    same_inf = torch.equal(torch.isneginf(got), torch.isneginf(want))
    finite = torch.isfinite(want)
    return same_inf and torch.allclose(got[finite].double(), want[finite].double(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("processing", [{}, dict(repetition_penalty=1.3, min_new_tokens=16),
                                        dict(renormalize_logits=True, exponential_decay_length_penalty=(3, 1.2))])
def test_greedy_scores_and_logits_are_transformers_own(tiny, processing):
    hf, model = tiny
    for ids in [p[None] for p in mixed_prompts()[:3]]:
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                           pad_token_id=0, return_dict_in_generate=True, output_scores=True, output_logits=True,
                           eos_token_id=7, **processing)
        runs = [dict(lookahead=la) for la in CONFIGS]
        runs.append(dict(lookahead=CONFIGS[1], cuda_graphs=False, _static_steps=True))
        verified = 0  # the most tokens a lookahead step emitted: above 1, some came from tree nodes' rows
        for run in runs:
            got = model.generate(ids, max_new_tokens=24, output_scores=True, output_logits=True, eos_token_id=7,
                                 **run, **processing)
            assert torch.equal(got.sequences, want.sequences), run
            assert len(got.scores) == len(got.logits) == len(want.scores) == got.sequences.shape[1] - ids.shape[1]
            for t, (s, w, lg, wl) in enumerate(zip(got.scores, want.scores, got.logits, want.logits)):
                assert s.shape == w.shape and s.dtype == torch.float32
                assert close(s, w) and close(lg, wl), (run, t)
                assert int(s[0].argmax()) == int(got.sequences[0, ids.shape[1] + t])
            if run["lookahead"] is not None:
                verified = max(verified, *got.stats.accepted)
        assert verified >= 2, "no step accepted a tree node: their rows were not exercised"


@pytest.mark.parametrize("static", [False, True])
def test_a_batch_gives_each_row_its_own_rows_then_nan(tiny, static):
    hf, model = tiny
    prompts = mixed_prompts()
    eos = int(model.generate(prompts[0][None], max_new_tokens=6, lookahead=None).sequences[0, -1])
    kwargs = dict(cuda_graphs=False, _static_steps=True) if static else {}
    for la in (None, CONFIGS[1], CONFIGS[2]):
        out = model.generate(prompts, max_new_tokens=20, lookahead=la, eos_token_id=eos, pad_token_id=0,
                             output_scores=True, **kwargs)
        assert out.logits is None and len(out.scores) == out.sequences.shape[1] - max(len(p) for p in prompts)
        for b, p in enumerate(prompts):
            ids = p[None]
            alone = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False,
                                pad_token_id=0, eos_token_id=eos, return_dict_in_generate=True, output_scores=True)
            n = alone.sequences.shape[1] - len(p)
            assert out.stats.rows[b].new_tokens == n
            for t in range(len(out.scores)):
                if t < n:
                    assert close(out.scores[t][b], alone.scores[t][0]), (la, b, t)
                else:
                    assert torch.isnan(out.scores[t][b]).all(), (la, b, t)


@pytest.mark.parametrize("lookahead", [LookaheadConfig(window=4, ngram=3, guess=4), None])
def test_sampled_scores_are_the_warped_rows_of_each_prefix(lookahead):
    """Each new token's scores are transformers' processors and warpers (in its order) on the model's logits after
    the tokens before it; the sampled token is one they keep."""
    hf = tiny_hf_model(seed=0, vocab=24)
    model = LlamaForCausalLM.from_hf(hf)
    prompt = model.generate(torch.tensor([[1]]), max_new_tokens=15).sequences
    warpers = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.2),
                                   MinNewTokensLengthLogitsProcessor(prompt.shape[1], 4, torch.tensor([3])),
                                   TemperatureLogitsWarper(0.7), TopKLogitsWarper(6), TopPLogitsWarper(0.9)])
    gen = torch.Generator().manual_seed(5)
    accepted = []
    for _ in range(6):
        out = model.generate(prompt, max_new_tokens=12, lookahead=lookahead, do_sample=True, temperature=0.7,
                             top_k=6, top_p=0.9, repetition_penalty=1.2, min_new_tokens=4, eos_token_id=3,
                             output_scores=True, output_logits=True, generator=gen)
        accepted.extend(out.stats.accepted)
        seq = out.sequences
        with torch.no_grad():
            logits = hf(seq, attention_mask=torch.ones_like(seq)).logits
        L = prompt.shape[1]
        for t in range(seq.shape[1] - L):
            raw = logits[:, L + t - 1]
            assert close(out.logits[t], raw), t
            want = warpers(seq[:, : L + t], raw.clone())
            assert close(out.scores[t], want), t
            assert torch.isfinite(out.scores[t][0, seq[0, L + t]])
    if lookahead is not None:
        assert max(accepted) >= 2, "no step accepted a candidate: verification was not exercised"


@pytest.mark.parametrize("normalize", [False, True])
def test_transition_scores_as_transformers_computes_them(tiny, normalize):
    hf, model = tiny
    ids = mixed_prompts()[0][None]
    out = model.generate(ids, max_new_tokens=12, lookahead=CONFIGS[1], do_sample=True, top_k=5, output_scores=True,
                         generator=torch.Generator().manual_seed(0))
    want = hf.compute_transition_scores(out.sequences, out.scores, normalize_logits=normalize)
    got = model.compute_transition_scores(out.sequences, out.scores, normalize_logits=normalize)
    assert got.shape == (1, 12) and torch.isfinite(got).all() and torch.allclose(got, want)
    # a batch: NaN where a row had ended
    eos = int(out.sequences[0, ids.shape[1] + 2])
    batch = model.generate(mixed_prompts(), max_new_tokens=12, lookahead=CONFIGS[1], output_scores=True,
                           eos_token_id=eos, pad_token_id=0)
    got = model.compute_transition_scores(batch.sequences, batch.scores, normalize_logits=normalize)
    for b, row in enumerate(batch.stats.rows):
        assert torch.isfinite(got[b, : row.new_tokens]).all() and torch.isnan(got[b, row.new_tokens:]).all()
    with pytest.raises(ValueError, match="beam search"):
        model.compute_transition_scores(out.sequences, out.scores, beam_indices=torch.zeros(1, 12))
    with pytest.raises(ValueError, match="sequences must be"):
        model.compute_transition_scores(out.sequences[:, :3], out.scores)


def test_bad_flags_are_clear_errors(tiny):
    _, model = tiny
    with pytest.raises(ValueError, match="output_scores must be a bool"):
        model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, output_scores="yes")


@pytest.mark.gpu
def test_cuda_graphs_return_the_eager_rows():
    from .test_static_steps import cuda_tiny

    model = cuda_tiny()
    prompts = mixed_prompts()
    flat = [(1, 1e-3), (64, 1.01e-3), (256, 1.05e-3)]  # the planner takes trees whatever this GPU measures
    for la in (None, LookaheadConfig(window=4, ngram=3, guess=4), LookaheadConfig(step_costs=flat)):
        for ids in (prompts[0], prompts[2]):
            runs = [model.generate(ids[None].cuda(), max_new_tokens=24, lookahead=la, output_scores=True,
                                   output_logits=True, repetition_penalty=1.2, cuda_graphs=graphs)
                    for graphs in (False, True)]
            assert torch.equal(runs[0].sequences, runs[1].sequences), la
            for a, b in zip(runs[0].scores + runs[0].logits, runs[1].scores + runs[1].logits):
                assert a.device.type == "cuda" and close(a.cpu(), b.cpu()), la
