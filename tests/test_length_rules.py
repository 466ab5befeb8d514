"""The rules that count a row's new tokens (min_new_tokens, min_length, forced_bos_token_id, forced_eos_token_id,
remove_invalid_values, exponential_decay_length_penalty, suppress_tokens, begin_suppress_tokens): the oracle against
transformers' processors, a tree's rows against the oracle per node, then generate end to end (plain and lookahead,
greedy identical to transformers' generate; sampled tokens following the processed distribution), and the
arguments' errors."""

import random

import pytest
import torch
from transformers import GenerationConfig

from lookahead import LlamaForCausalLM, LookaheadConfig
from lookahead.processors import LogitsProcessors
from lookahead.sampling import SamplingParams, warp_logits
from lookahead.length_rules import LengthRules, reference_length_rules
from lookahead_kernels import StepLayout
from lookahead_kernels.tree import TreeShape

from .test_batch import mixed_prompts
from .test_generate import tiny_hf_model
from .test_repetition import (CONFIGS, SAMPLED_VOCAB, path_of, processed_marginals, random_tree,  # noqa: F401
                              sample_and_fit, tiny)  # (tiny: a fixture)


def _zeros(name, shape, dtype):
    return torch.zeros(shape, dtype=dtype)


def padded_trees(B: int, N: int, padding: int, rng: random.Random):
    """``B`` random trees of ``N`` nodes then ``padding`` padding nodes: ``(trees, end [B, N + padding], depth)``,
    each tree as ``(parents, end)``, the depths as the tree's encoding gives them (padding: leaves at depth 1)."""
    trees = [random_tree(N, rng) for _ in range(B)]
    end = torch.tensor([e + [N + k + 1 for k in range(padding)] for _, e in trees])
    depth = torch.stack([torch.cat([TreeShape.from_parents(parents).depth, torch.ones(padding, dtype=torch.long)])
                         for parents, _ in trees])
    return trees, end, depth


def _random_rules(rng: random.Random) -> dict:
    """Some of the rules, at random (the EOS always: the minimum and the decay read it)."""
    rules = dict(eos=[3, 7], min_new=rng.randint(0, 8))
    if rng.random() < 0.5:
        rules.update(always=[0, 11], at_start=[5, 3], begin=rng.randint(0, 1))
    if rng.random() < 0.5:
        rules.update(forced_first=rng.randrange(13))
    if rng.random() < 0.5:
        rules.update(forced_last=rng.sample(range(13), rng.randint(1, 2)), last=rng.randint(0, 9))
    if rng.random() < 0.5:
        rules.update(decay=(rng.randint(0, 4), rng.choice([1.3, 0.7, 2.0])))
    rules.update(remove_invalid=rng.random() < 0.5)
    return rules


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal, NaN where NaN."""
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


def test_the_oracle_is_transformers_processors():
    """reference_length_rules against transformers' own processors, in their order, on rows holding NaN and
    infinities, for counts around every threshold."""
    from transformers import (ExponentialDecayLengthPenalty, ForcedBOSTokenLogitsProcessor,
                              ForcedEOSTokenLogitsProcessor, InfNanRemoveLogitsProcessor, LogitsProcessorList,
                              MinNewTokensLengthLogitsProcessor, SuppressTokensAtBeginLogitsProcessor,
                              SuppressTokensLogitsProcessor)

    torch.manual_seed(0)
    V, L, eos = 13, 1, [3, 7]
    row = torch.randn(V)
    row[2], row[5], row[9] = float("nan"), float("inf"), float("-inf")
    rules = dict(eos=eos, min_new=2, forced_first=4, forced_last=[6, 7], last=5, remove_invalid=True,
                 decay=(1, 1.7), always=[0, 11], at_start=[5, 3], begin=1)
    hf = LogitsProcessorList([
        MinNewTokensLengthLogitsProcessor(L, 2, eos), ForcedBOSTokenLogitsProcessor(4),
        ForcedEOSTokenLogitsProcessor(L + 6, [6, 7]), InfNanRemoveLogitsProcessor(),
        ExponentialDecayLengthPenalty((1, 1.7), eos, L), SuppressTokensLogitsProcessor([0, 11]),
        SuppressTokensAtBeginLogitsProcessor([5, 3], L + 1)])
    for new in range(9):
        want = hf(torch.zeros(1, L + new, dtype=torch.long), row[None].clone())[0]
        got = reference_length_rules(row, new, **rules)
        assert _same(got, want), new


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("replayed", [False, True])
def test_tree_rows_are_processed_for_their_depth(seed, replayed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    B, N, V, padding = 3, rng.randint(1, 12), 13, 2
    logits = torch.randn(B, N + padding, V)
    logits[0, :, 4] = float("nan")
    logits[1, :, 3] = float("inf")
    tokens = torch.randint(0, V, (B, N + padding))
    kinds = _random_rules(rng)
    counts = [rng.randint(0, 5) for _ in range(B)]
    suppression = LengthRules(**kinds)
    suppression.start(_zeros, [[]] * B, counts, replayed)
    trees, end, depth = padded_trees(B, N, padding, rng)
    got = suppression.tree(logits, tokens, end, depth)
    rows = suppression.rows(logits[:, 0])
    for b, (parents, _) in enumerate(trees):
        assert _same(rows[b], reference_length_rules(logits[b, 0], counts[b], **kinds))
        for i in range(N):
            want = reference_length_rules(logits[b, i], counts[b] + len(path_of(i, parents)), **kinds)
            assert _same(got[b, i], want), (b, i)
    # one tree for the whole batch ([N] end), and counts moving on (past every threshold: only `always` is left)
    suppression.add([[]] * B, [c + 1 for c in counts])
    shared = suppression.tree(logits[:, :N], tokens[:, :N], end[0, :N], depth[0, :N])
    for b in range(B):
        for i in range(N):
            want = reference_length_rules(logits[b, i], counts[b] + 1 + len(path_of(i, trees[0][0])), **kinds)
            assert _same(shared[b, i], want), (b, i)
    suppression.add([[]] * B, [20] * B)
    assert _same(suppression.rows(logits[:, 0]), reference_length_rules(logits[:, 0], 20, **kinds))


def test_processors_compose_with_the_penalty():
    """The penalty leaves -inf as it is: suppressing before or after it gives the same rows."""
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 9)
    seq = [[1, 2, 3], [4, 4]]
    both = LogitsProcessors(9, 1.5, eos=[2], length=dict(min_new=3, always=[8]))
    both.start(_zeros, seq, [0, 1], replayed=False, capacity=8)
    penalty_only = LogitsProcessors(9, 1.5)
    penalty_only.start(_zeros, seq, [0, 1], replayed=False, capacity=8)
    got = both.rows(logits[:, 0])
    for b in range(2):
        want = reference_length_rules(penalty_only.rows(logits[:, 0])[b], b, eos=[2], min_new=3, always=[8])
        assert torch.equal(got[b], want)
    assert not LogitsProcessors(9, 1.0, eos=[2], length=dict(min_new=0))  # nothing to do: no processors at all


# ---- end to end ------------------------------------------------------------------------------------------------

def hf_generate(hf, ids, max_new_tokens, **kwargs):
    return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                       pad_token_id=0, **kwargs)


def early_token(hf, ids, at=3):
    """A token plain greedy decoding emits early: as an EOS it ends the output, unless suppressed."""
    return int(hf_generate(hf, ids, at + 1)[0, ids.shape[1] + at])


@pytest.mark.parametrize("kind", ["min_new_tokens", "min_length", "suppress_tokens", "begin_suppress_tokens",
                                  "with_penalty"])
def test_greedy_output_is_transformers_own(tiny, kind):
    hf, model = tiny
    for ids in [p[None] for p in mixed_prompts()]:
        eos = early_token(hf, ids)
        kwargs = {"min_new_tokens": dict(min_new_tokens=12), "min_length": dict(min_length=ids.shape[1] + 9),
                  "suppress_tokens": dict(suppress_tokens=[eos, early_token(hf, ids, 1)]),
                  "begin_suppress_tokens": dict(begin_suppress_tokens=[early_token(hf, ids, 0)]),
                  "with_penalty": dict(min_new_tokens=20, repetition_penalty=1.3)}[kind]
        want = hf_generate(hf, ids, 32, eos_token_id=eos, **kwargs)
        assert not torch.equal(want, hf_generate(hf, ids, 32, eos_token_id=eos)), "nothing changed: a weak test"
        for la in CONFIGS:
            got = model.generate(ids, max_new_tokens=32, lookahead=la, eos_token_id=eos, pad_token_id=0, **kwargs)
            assert torch.equal(got.sequences, want), la
        # the static-step loop (what CUDA graphs replay), run eagerly
        static = model.generate(ids, max_new_tokens=32, lookahead=CONFIGS[1], eos_token_id=eos, pad_token_id=0,
                                cuda_graphs=False, _static_steps=True, **kwargs)
        assert torch.equal(static.sequences, want)


def _same_as_transformers(hf, model, ids, max_new_tokens, **kwargs):
    """Our output (plain, two lookahead configurations and the static-step loop) equals transformers' greedy one;
    returns it."""
    want = hf_generate(hf, ids, max_new_tokens, **kwargs)
    for la, extra in ((None, {}), (CONFIGS[1], {}), (CONFIGS[3], {}),
                      (CONFIGS[1], dict(cuda_graphs=False, _static_steps=True))):
        got = model.generate(ids, max_new_tokens=max_new_tokens, lookahead=la, pad_token_id=0, **kwargs, **extra)
        assert torch.equal(got.sequences, want), (la, extra, kwargs)
    return want


def test_forced_tokens_and_the_length_penalty_are_transformers_own(tiny):
    """forced_eos_token_id ends the output at its last allowed token; exponential_decay_length_penalty raises the
    EOS until it ends the output sooner; forced_bos_token_id (a one-token prompt) forces the first token and moves
    begin_suppress_tokens to the second; remove_invalid_values rides along (the model's scores are all finite)."""
    hf, model = tiny
    for ids in [p[None] for p in mixed_prompts()[:3]]:
        forced = early_token(hf, ids, 5)
        want = _same_as_transformers(hf, model, ids, 12, forced_eos_token_id=forced, eos_token_id=forced,
                                     remove_invalid_values=True)
        assert want[0, -1] == forced and forced not in want[0, ids.shape[1]:-1].tolist(), "a weak test"
        eos = early_token(hf, ids, 14)
        free = hf_generate(hf, ids, 20, eos_token_id=eos)
        decayed = _same_as_transformers(hf, model, ids, 20, eos_token_id=eos,
                                        exponential_decay_length_penalty=(2, 1.6))
        assert decayed.shape[1] < free.shape[1], "the penalty changed nothing: a weak test"
    one = mixed_prompts()[1][None]
    second = early_token(hf, torch.cat([one, torch.tensor([[7]])], 1), 0)
    want = _same_as_transformers(hf, model, one, 10, forced_bos_token_id=7, begin_suppress_tokens=[second])
    assert want[0, 1] == 7 and want[0, 2] != second


@pytest.mark.parametrize("static", [False, True])
def test_each_row_of_a_batch_counts_its_own_tokens(tiny, static):
    """Rows of different prompt lengths stop apart; each suppresses the EOS until its own 10th new token."""
    hf, model = tiny
    batch_rows_decode_alone(hf, model, early_token(hf, mixed_prompts()[0][None], 2), static, min_new_tokens=10)


def batch_rows_decode_alone(hf, model, eos: int, static: bool, **processing) -> None:
    """Each row of a batch of mixed prompts, under ``processing`` and stopping at ``eos`` apart from the others,
    equals transformers' output for its prompt alone (plain and lookahead; the static-step loop with ``static``)."""
    prompts = mixed_prompts()
    alone = [hf_generate(hf, p[None], 24, eos_token_id=eos, **processing)[0, len(p):].tolist() for p in prompts]
    assert any(eos in ref for ref in alone) and not all(eos in ref for ref in alone), "rows should stop apart"
    kwargs = dict(cuda_graphs=False, _static_steps=True) if static else {}
    L = max(len(p) for p in prompts)
    for la in (None, CONFIGS[1], CONFIGS[3]):
        out = model.generate(prompts, max_new_tokens=24, lookahead=la, eos_token_id=eos, pad_token_id=0,
                             **processing, **kwargs)
        for b, ref in enumerate(alone):
            assert out.sequences[b, L: L + len(ref)].tolist() == ref, (la, b)


def test_smollm2_short_answers_held_past_their_end(smollm2):
    """The real model's own EOS ends these answers at their 12th token; held off until then, the answer goes on
    (the EOS's row is a tree node where a step accepts the answer's last words)."""
    hf, ours, tok = smollm2
    for question in ("What is 2+2?", "Name three colors."):
        ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                      return_tensors="pt")
        ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
        free = hf_generate(hf, ids, 24, eos_token_id=hf.config.eos_token_id)
        want = hf_generate(hf, ids, 24, eos_token_id=hf.config.eos_token_id, min_new_tokens=12)
        assert want.shape[1] > free.shape[1], "the minimum changed nothing: a weak test"
        for la in (None, LookaheadConfig(), LookaheadConfig(7, 5, 7)):
            got = ours.generate(ids, max_new_tokens=24, lookahead=la, min_new_tokens=12)
            assert torch.equal(got.sequences, want), (question, la)


def test_fields_from_a_generation_config(tiny):
    hf, model = tiny
    ids = mixed_prompts()[0][None]
    eos = early_token(hf, ids)
    config = GenerationConfig(min_new_tokens=12, suppress_tokens=[1, 2], eos_token_id=eos)
    want = hf_generate(hf, ids, 20, generation_config=config)
    assert torch.equal(model.generate(ids, max_new_tokens=20, generation_config=config, pad_token_id=0).sequences,
                       want)
    # a keyword overrides the config's
    want = hf_generate(hf, ids, 20, generation_config=config, min_new_tokens=0)
    assert torch.equal(model.generate(ids, max_new_tokens=20, generation_config=config, min_new_tokens=0,
                                      pad_token_id=0).sequences, want)


@pytest.mark.parametrize("kwargs,message", [
    (dict(min_new_tokens=-1), "min_new_tokens must be an int >= 0"),
    (dict(min_new_tokens="3"), "min_new_tokens must be an int >= 0"),
    (dict(min_new_tokens=True), "min_new_tokens must be an int >= 0"),
    (dict(min_length=2.5), "min_length must be an int >= 0"),
    (dict(suppress_tokens=[-1]), "suppress_tokens must be a list of token ids"),
    (dict(suppress_tokens="1,2"), "suppress_tokens must be a list of token ids"),
    (dict(begin_suppress_tokens=[1.5]), "begin_suppress_tokens must be a list of token ids"),
    (dict(suppress_tokens=[97]), r"suppress_tokens must hold token ids in \[0, 97\)"),
    (dict(begin_suppress_tokens=[3, 200]), r"begin_suppress_tokens must hold token ids in \[0, 97\)"),
    (dict(forced_bos_token_id=-1), "forced_bos_token_id must be an int >= 0"),
    (dict(forced_bos_token_id=5, suppress_tokens=[5, 6]), r"every token of forced_bos_token_id \(\[5\]\) is also in"),
    (dict(forced_eos_token_id=[2, 3], suppress_tokens=[3, 2]), r"every token of forced_eos_token_id \(\[2, 3\]\)"),
    (dict(forced_eos_token_id=[3, 97]), r"forced_eos_token_id must hold token ids in \[0, 97\)"),
    (dict(exponential_decay_length_penalty=(1,)), r"exponential_decay_length_penalty must be \(start_index"),
    (dict(exponential_decay_length_penalty=(1, float("nan"))), "an int and a finite number"),
    (dict(remove_invalid_values="yes"), "remove_invalid_values must be a bool"),
    (dict(renormalize_logits=1), "renormalize_logits must be a bool"),
    (dict(do_sample=True, top_h=1.5), r"top_h must be a number in \(0, 1\]"),
    (dict(encoder_repetition_penalty=0.0), "encoder_repetition_penalty must be a number > 0"),
    (dict(encoder_no_repeat_ngram_size=-1), "encoder_no_repeat_ngram_size must be an int >= 0"),
    (dict(forced_eos_token_id=3, prefix_allowed_tokens_fn=lambda b, ids: [1, 2]),
     "prefix_allowed_tokens_fn together with forced_eos_token_id is not supported"),
])
def test_bad_arguments_are_clear_errors(tiny, kwargs, message):
    _, model = tiny
    with pytest.raises(ValueError, match=message):
        model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, **kwargs)


SAMPLES = 1500


@pytest.mark.parametrize("lookahead", [LookaheadConfig(window=4, ngram=3, guess=4), None])
def test_sampled_tokens_follow_the_suppressed_distribution(lookahead):
    model = LlamaForCausalLM.from_hf(tiny_hf_model(seed=0, vocab=SAMPLED_VOCAB))
    prompt = model.generate(torch.tensor([[1]]), max_new_tokens=15).sequences
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0)
    with torch.inference_mode():
        first = warp_logits(model(prompt, torch.arange(prompt.shape[1])[None], model.new_cache(1, prompt.shape[1]),
                                  0, StepLayout.prefill(prompt.shape[1]), torch.tensor([prompt.shape[1] - 1]))[0, 0],
                            params)
        # the second likeliest first token: suppressing it moves mass, and the likeliest (this prompt's repeated
        # token, which the window and pool guess) keeps steps accepting
        eos = int(first.argsort(descending=True)[1])
        assert first[eos] > 0.05
        # (the EOS can only come last: min_new_tokens is 2 of 3)
        marginals = processed_marginals(model, prompt, params,
                                        lambda row, context, k: reference_length_rules(row, k, eos=[eos], min_new=2))
    samples = sample_and_fit(model, prompt, lookahead, marginals, SAMPLES, 7, min_new_tokens=2, eos_token_id=eos,
                             pad_token_id=0)
    assert not (samples[:, :2] == eos).any()


@pytest.mark.gpu
def test_cuda_graphs_keep_the_suppression_exact():
    """Replayed graphs read the rows' counts from the runner's state: a second call with fresh counts (the same
    graphs) and one with other ids (new graphs) equal the eager loop."""
    from .test_static_steps import cuda_tiny

    model = cuda_tiny()
    prompts = mixed_prompts()
    flat = [(1, 1e-3), (64, 1.01e-3), (256, 1.05e-3)]  # the planner takes trees whatever this GPU measures
    for la in (None, LookaheadConfig(window=4, ngram=3, guess=4), LookaheadConfig(step_costs=flat)):
        eos = int(model.generate(prompts[0][None].cuda(), max_new_tokens=4, lookahead=None).sequences[0, -1])
        for kwargs in (dict(min_new_tokens=12), dict(min_new_tokens=12), dict(min_new_tokens=5, suppress_tokens=[1])):
            for ids in (prompts[0], prompts[2]):
                eager = model.generate(ids[None].cuda(), max_new_tokens=24, lookahead=la, eos_token_id=eos,
                                       cuda_graphs=False, **kwargs).sequences
                graphs = model.generate(ids[None].cuda(), max_new_tokens=24, lookahead=la, eos_token_id=eos,
                                        cuda_graphs=True, **kwargs).sequences
                assert torch.equal(graphs, eager), (la, kwargs)
        batch = model.generate([p.cuda() for p in prompts], max_new_tokens=24, lookahead=la, eos_token_id=eos,
                               min_new_tokens=12).sequences
        eager = model.generate([p.cuda() for p in prompts], max_new_tokens=24, lookahead=la, eos_token_id=eos,
                               min_new_tokens=12, cuda_graphs=False).sequences
        assert torch.equal(batch, eager), la
