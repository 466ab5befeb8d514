"""generate's logits_processor and prefix_allowed_tokens_fn: each row and tree node processed with its own
sequence, greedy output identical to transformers' generate in every config, sampled tokens following the processed
distribution, a constraint's function only ever seeing sequences it allowed, and the errors."""

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList, RepetitionPenaltyLogitsProcessor

from lookahead import LlamaForCausalLM, LookaheadConfig
from lookahead.custom_processors import CustomProcessors, _node_parents
from lookahead.sampling import SamplingParams

from .test_batch import mixed_prompts
from .test_generate import tiny_hf_model
from .test_repetition import (CONFIGS, SAMPLED_VOCAB, path_of, processed_marginals, random_tree,  # noqa: F401
                              sample_and_fit, tiny)  # (tiny: a fixture)
from .test_length_rules import hf_generate


class FollowerBan(LogitsProcessor):
    """Row-wise and depending on the sequence: the token after each row's last token (mod V) is banned, and the
    one at three times its second-to-last (mod V) boosted."""

    def __call__(self, input_ids, scores):
        V = scores.shape[-1]
        out = scores.clone()
        rows = torch.arange(scores.shape[0])
        out[rows, (input_ids[:, -1] + 1) % V] = float("-inf")
        if input_ids.shape[1] > 1:
            out[rows, (input_ids[:, -2] * 3) % V] += 6.0
        return out


def parity_fn(V):
    """Allowed next tokens: those of the parity of the sequence's length plus its batch id."""
    def allowed(batch_id, ids):
        return [t for t in range(V) if (t + ids.shape[0] + batch_id) % 2 == 0]
    return allowed


def test_node_parents_follow_the_preorder():
    import random

    rng = random.Random(0)
    for _ in range(50):
        parents, end = random_tree(rng.randint(1, 15), rng)
        depth = [len(path_of(i, parents)) for i in range(len(parents))]
        assert _node_parents(depth) == parents


@pytest.mark.parametrize("kind", ["processor", "penalty_as_a_processor", "prefix"])
def test_greedy_output_is_transformers_own(tiny, kind):
    hf, model = tiny
    kwargs = {"processor": dict(logits_processor=LogitsProcessorList([FollowerBan()])),
              "penalty_as_a_processor": dict(logits_processor=[RepetitionPenaltyLogitsProcessor(1.4)]),
              "prefix": dict(prefix_allowed_tokens_fn=parity_fn(97))}[kind]
    for ids in [p[None] for p in mixed_prompts()]:
        want = hf_generate(hf, ids, 24, **kwargs)
        assert not torch.equal(want, hf_generate(hf, ids, 24)), "nothing changed: a weak test"
        for la in CONFIGS:
            got = model.generate(ids, max_new_tokens=24, lookahead=la, pad_token_id=0, **kwargs)
            assert torch.equal(got.sequences, want), la
        if kind == "penalty_as_a_processor":  # the caller's processor and the built-in penalty agree
            assert torch.equal(model.generate(ids, max_new_tokens=24, lookahead=CONFIGS[1],
                                              repetition_penalty=1.4).sequences, want)
    static = model.generate(ids, max_new_tokens=24, lookahead=CONFIGS[1], pad_token_id=0, cuda_graphs=False,
                            _static_steps=True, **kwargs)
    assert torch.equal(static.sequences, want)


def test_a_constraint_only_sees_sequences_it_allowed():
    """A small vocabulary, so the window and pool guess often: every sequence the function gets extends one it
    allowed (its last token allowed after the rest), as under plain decoding; and lookahead did accept guesses."""
    hf = tiny_hf_model(seed=0, vocab=SAMPLED_VOCAB)
    model = LlamaForCausalLM.from_hf(hf)
    prompt = torch.tensor([[1, 2, 3, 1, 2, 3, 1, 2]])
    fn = parity_fn(SAMPLED_VOCAB)
    seen = []

    def recording(batch_id, ids):
        seen.append(ids.tolist())
        return fn(batch_id, ids)

    out = model.generate(prompt, max_new_tokens=24, lookahead=LookaheadConfig(window=4, ngram=3, guess=4),
                         prefix_allowed_tokens_fn=recording)
    assert torch.equal(out.sequences, hf_generate(hf, prompt, 24, prefix_allowed_tokens_fn=fn))
    assert max(out.stats.accepted) >= 2, "no step accepted a guess: the tree was not exercised"
    P = prompt.shape[1]
    for s in seen:
        for k in range(P, len(s)):
            assert s[k] in fn(0, torch.tensor(s[:k])), s


def test_each_row_of_a_batch_gets_its_own_batch_id(tiny):
    hf, model = tiny
    prompts = mixed_prompts()
    fn = parity_fn(97)
    L = max(len(p) for p in prompts)
    for la in (None, CONFIGS[1]):
        out = model.generate(prompts, max_new_tokens=16, lookahead=la, prefix_allowed_tokens_fn=fn, pad_token_id=0)
        for b, p in enumerate(prompts):
            alone = hf_generate(hf, p[None], 16, prefix_allowed_tokens_fn=lambda _, ids, b=b: fn(b, ids))
            assert out.sequences[b, L - len(p):].tolist() == alone[0].tolist(), (la, b)
        # two rows at once, a finished row's place going to the next prompt (eager and static, which then moves to
        # fewer rows): each row is still called with its own index among the prompts
        for path in ({}, dict(cuda_graphs=False, _static_steps=True)):
            refilled = model.generate(prompts, max_new_tokens=16, lookahead=la, prefix_allowed_tokens_fn=fn,
                                      pad_token_id=0, max_batch_size=2, **path)
            assert torch.equal(refilled.sequences, out.sequences), (la, path)


SAMPLES = 1500


def test_sampled_tokens_follow_the_processed_distribution():
    model = LlamaForCausalLM.from_hf(tiny_hf_model(seed=0, vocab=SAMPLED_VOCAB))
    prompt = model.generate(torch.tensor([[1]]), max_new_tokens=15).sequences
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0)
    ban = FollowerBan()
    with torch.inference_mode():
        marginals = processed_marginals(model, prompt, params,
                                        lambda row, context, k: ban(torch.tensor([context]), row[None])[0])
    sample_and_fit(model, prompt, LookaheadConfig(window=4, ngram=3, guess=4), marginals, SAMPLES, 3,
                   logits_processor=[ban])


def test_tree_needs_the_steps_x_rows():
    custom = CustomProcessors([FollowerBan()])
    custom.start(None, [[1, 2]], [0], replayed=False)
    with pytest.raises(RuntimeError, match="call rows\\(\\) first"):
        custom.tree(torch.zeros(1, 2, 5), torch.zeros(1, 2, dtype=torch.long), torch.tensor([1, 2]),
                    torch.tensor([1, 1]))


@pytest.mark.parametrize("kwargs,message", [
    (dict(logits_processor=FollowerBan()), "logits_processor must be a list of callables"),
    (dict(logits_processor=[3]), "logits_processor must be a list of callables"),
    (dict(prefix_allowed_tokens_fn=[1, 2]), "prefix_allowed_tokens_fn must be a callable"),
    (dict(logits_processor=[RepetitionPenaltyLogitsProcessor(1.2)], repetition_penalty=1.1),
     "holds a RepetitionPenaltyLogitsProcessor and repetition_penalty is set too"),
    (dict(prefix_allowed_tokens_fn=lambda b, ids: []), "returned no allowed token for batch id 0"),
    (dict(logits_processor=[lambda ids, scores: scores[:, :5]]), "must return scores of shape \\(1, 97\\)"),
    (dict(logits_processor=[FollowerBan()], cuda_graphs=True), "which a CUDA graph cannot replay"),
])
def test_bad_arguments_are_clear_errors(tiny, kwargs, message):
    _, model = tiny
    with pytest.raises(ValueError, match=message):
        model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, **kwargs)


@pytest.mark.parametrize("lookahead", [None, LookaheadConfig(max_step_tokens=8)], ids=["plain", "lookahead"])
def test_a_sampled_step_with_no_token_left_is_a_clear_error(tiny, lookahead):
    """A processor that removes every token leaves the draw nothing: a ValueError saying so, where the draw's
    sentinel (-1) once went into the output (or into the next step's input, failing there)."""
    _, model = tiny
    nothing = [lambda ids, scores: torch.full_like(scores, float("-inf"))]
    with pytest.raises(ValueError, match="no token could be drawn for new token 1"):
        model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=True, logits_processor=nothing,
                       lookahead=lookahead)


@pytest.mark.gpu
def test_a_cuda_model_runs_the_callers_processors_eagerly():
    from .test_static_steps import cuda_tiny

    model = cuda_tiny()
    ids = mixed_prompts()[0][None].cuda()
    kwargs = dict(logits_processor=[FollowerBan()], prefix_allowed_tokens_fn=parity_fn(model.config.vocab_size))
    for la in (None, LookaheadConfig(window=4, ngram=3, guess=4)):
        unset = model.generate(ids, max_new_tokens=24, lookahead=la, **kwargs).sequences
        eager = model.generate(ids, max_new_tokens=24, lookahead=la, cuda_graphs=False, **kwargs).sequences
        assert torch.equal(unset, eager), la
