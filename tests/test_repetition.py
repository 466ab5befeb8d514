"""repetition_penalty: the penalty of a tree's rows against a per-node oracle, then generate end to end (plain
and lookahead, greedy identical to transformers' generate; sampled rows following the penalised distribution)."""

import random

import pytest
import torch

from lookahead import LlamaForCausalLM, LookaheadConfig
from lookahead.repetition import PromptPenalty, penalise_rows, penalise_tree, reference_penalised
from lookahead.sampling import SamplingParams, warp_logits
from lookahead_kernels import StepLayout

from .test_batch import mixed_prompts
from .test_generate import dev_prompts, hf_greedy, tiny_hf_model
from .test_sampling_e2e import fit_pvalue


def random_tree(n: int, rng: random.Random) -> tuple[list[int], list[int]]:
    """A preorder tree of ``n`` nodes: (parents, end). Node i's parent is x (-1) or on node i-1's path."""
    parents, path = [], []  # path: node i-1 and its ancestors, deepest last
    for i in range(n):
        keep = rng.randint(0, len(path))
        path = path[:keep]
        parents.append(path[-1] if path else -1)
        path.append(i)
    end = list(range(1, n + 1))
    for i in reversed(range(n)):
        if parents[i] >= 0:
            end[parents[i]] = max(end[parents[i]], end[i])
    return parents, end


def path_of(i: int, parents: list[int]) -> list[int]:
    out = []
    while i >= 0:
        out.append(i)
        i = parents[i]
    return out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_tree_rows_are_penalised_for_their_path(seed, penalty):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    B, N, V, padding = 3, rng.randint(1, 12), 11, 2  # a small vocabulary: tokens repeat along paths
    logits = torch.randn(B, N + padding, V)
    tokens = torch.randint(0, V, (B, N + padding))
    seen = torch.rand(B, V) < 0.3
    trees = [random_tree(N, rng) for _ in range(B)]
    end = torch.tensor([e + [N + k + 1 for k in range(padding)] for _, e in trees])
    got = penalise_tree(logits, seen, tokens, end, penalty)
    for b, (parents, _) in enumerate(trees):
        committed = seen[b].nonzero().flatten().tolist()
        for i in range(N):
            context = committed + [int(tokens[b, j]) for j in path_of(i, parents)]
            want = reference_penalised(logits[b, i].double(), context, penalty)
            assert torch.allclose(got[b, i].double(), want, rtol=1e-6, atol=0), (b, i)
    # one tree for the batch ([N] end) and the plain rows
    shared = penalise_tree(logits[:, :N], seen, tokens[:, :N], end[0, :N], penalty)
    for b in range(B):
        for i in range(N):
            context = seen[b].nonzero().flatten().tolist() + [int(tokens[b, j]) for j in path_of(i, trees[0][0])]
            assert torch.equal(shared[b, i], reference_penalised(logits[b, i], context, penalty))
    rows = penalise_rows(logits[:, 0], seen, penalty)
    for b in range(B):
        assert torch.equal(rows[b], reference_penalised(logits[b, 0], seen[b].nonzero().flatten().tolist(), penalty))


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_the_prompt_penalty_is_transformers_own(penalty):
    """encoder_repetition_penalty: every row of a step (x's and each node's) gets transformers' processor's
    result for the row's prompt, whatever tokens followed it."""
    from transformers.generation.logits_process import EncoderRepetitionPenaltyLogitsProcessor

    torch.manual_seed(0)
    B, N, V = 3, 5, 11
    prompts = [[1, 4, 4, 9], [0], [10, 2, 3, 2]]
    sequences = [p + [5, 6] for p in prompts]  # two new tokens each: not part of the prompt
    rule = PromptPenalty(penalty, V)
    rule.start(lambda name, shape, dtype: torch.zeros(shape, dtype=dtype), sequences, [2, 2, 2], False)
    logits = torch.randn(B, N, V)
    tree = rule.tree(logits, torch.zeros(B, N, dtype=torch.long), torch.arange(1, N + 1))
    rows = rule.rows(logits[:, 0])
    for b, prompt in enumerate(prompts):
        # one row at a time, as transformers' generate calls it for one prompt (5.17's processor gathers only
        # as many rows as it has prompts)
        processor = EncoderRepetitionPenaltyLogitsProcessor(penalty, torch.tensor([prompt]))
        want = torch.cat([processor(None, logits[b, i:i + 1].clone()) for i in range(N)])
        assert torch.equal(tree[b], want) and torch.equal(rows[b], want[0]), b


# ---- end to end ------------------------------------------------------------------------------------------------

CONFIGS = [None, LookaheadConfig(window=4, ngram=3, guess=4), LookaheadConfig(window=3, ngram=4, guess=3),
           LookaheadConfig(), LookaheadConfig(max_step_tokens=16, sources=("pool",))]


@pytest.fixture(scope="module")
def tiny():
    hf = tiny_hf_model(seed=3)
    return hf, LlamaForCausalLM.from_hf(hf)


def hf_penalised(hf, ids, max_new_tokens, penalty, eos_token_id=None):
    return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                       repetition_penalty=penalty, eos_token_id=eos_token_id, pad_token_id=0)


@pytest.mark.parametrize("penalty", [1.3, 0.8])
def test_greedy_output_is_transformers_own_under_a_penalty(tiny, penalty):
    hf, model = tiny
    prompts = [p[None] for p in mixed_prompts()]
    for ids in prompts:
        want = hf_penalised(hf, ids, 32, penalty)
        assert not torch.equal(want, hf_greedy(hf, ids, 32)), "the penalty changed nothing: a weak test"
        for la in CONFIGS:
            assert torch.equal(model.generate(ids, max_new_tokens=32, lookahead=la, repetition_penalty=penalty)
                               .sequences, want), la
        # the static-step loop (what CUDA graphs replay), run eagerly
        static = model.generate(ids, max_new_tokens=32, lookahead=CONFIGS[1], repetition_penalty=penalty,
                                cuda_graphs=False, _static_steps=True)
        assert torch.equal(static.sequences, want)


@pytest.mark.parametrize("static", [False, True])
def test_each_row_of_a_batch_keeps_its_own_context(tiny, static):
    """Rows stop apart (an EOS, or a longer prompt's context): each keeps its own committed tokens."""
    hf, model = tiny
    prompts = mixed_prompts()
    alone = [hf_penalised(hf, p[None], 24, 1.3)[0, len(p):] for p in prompts]
    eos = int(alone[0][5])
    alone = [hf_penalised(hf, p[None], 24, 1.3, eos_token_id=eos)[0, len(p):] for p in prompts]
    kwargs = dict(cuda_graphs=False, _static_steps=True) if static else {}
    for la in (None, CONFIGS[1], CONFIGS[3]):
        out = model.generate(prompts, max_new_tokens=24, lookahead=la, repetition_penalty=1.3, eos_token_id=eos,
                             pad_token_id=0, **kwargs)
        L = max(len(p) for p in prompts)
        for b, ref in enumerate(alone):
            ref = ref.tolist()
            if eos in ref:
                ref = ref[: ref.index(eos) + 1]
            assert out.sequences[b, L: L + len(ref)].tolist() == ref, (la, b)


def test_smollm2_dev_prompts_under_a_penalty(smollm2):
    hf, ours, tok = smollm2
    for name in ("mt_bench_dev.jsonl", "humaneval_dev.jsonl"):
        for ids in dev_prompts(tok, name, 2):
            want = hf_penalised(hf, ids, 24, 1.2, eos_token_id=hf.config.eos_token_id)
            for la in (None, LookaheadConfig(), LookaheadConfig(7, 5, 7)):
                got = ours.generate(ids, max_new_tokens=24, lookahead=la, repetition_penalty=1.2)
                assert torch.equal(got.sequences, want), (name, la)


@pytest.mark.parametrize("kwargs,message", [
    (dict(repetition_penalty=0.0), "repetition_penalty must be a number > 0"),
    (dict(repetition_penalty=-1), "repetition_penalty must be a number > 0"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty must be a number > 0"),
    (dict(repetition_penalty="1.2"), "repetition_penalty must be a number > 0"),
    (dict(repetition_penalty=True), "repetition_penalty must be a number > 0"),
])
def test_bad_penalties_are_clear_errors(tiny, kwargs, message):
    _, model = tiny
    with pytest.raises(ValueError, match=message):
        model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, **kwargs)


SAMPLED_VOCAB, SAMPLES = 16, 2500


def processed_marginals(model, prompt, params, process, depth=3) -> list[torch.Tensor]:
    """The marginal distribution of new tokens 1..depth when each row's logits go through ``process(row, context,
    k)`` (``k``: the new tokens before it) before warping, by enumerating every continuation."""
    marginals, weights, prefixes = [], torch.ones(1, dtype=torch.float64), prompt
    for k in range(depth):
        P, L = prefixes.shape
        logits = model(prefixes, torch.arange(L).expand(P, L), model.new_cache(P, L), 0, StepLayout.prefill(L),
                       torch.tensor([L - 1]))[:, 0]
        rows = torch.stack([process(logits[i], prefixes[i].tolist(), k) for i in range(P)])
        joint = weights[:, None] * warp_logits(rows.double(), params).double()
        marginals.append(joint.sum(0))
        weights = joint.reshape(-1)
        prefixes = torch.cat([prefixes.repeat_interleave(SAMPLED_VOCAB, 0),
                              torch.arange(SAMPLED_VOCAB).repeat(P)[:, None]], dim=1)
    return marginals


@pytest.mark.parametrize("lookahead", [LookaheadConfig(window=4, ngram=3, guess=4), None])
def test_sampled_tokens_follow_the_penalised_distribution(lookahead):
    """The distribution as a whole. (This fit does not see a tree row missing its path's penalty: the accepted
    paths here seldom hold a token new to the context. The greedy tests above and the oracle test do.)"""
    model = LlamaForCausalLM.from_hf(tiny_hf_model(seed=0, vocab=SAMPLED_VOCAB))
    prompt = model.generate(torch.tensor([[1]]), max_new_tokens=15).sequences
    params, penalty = SamplingParams(temperature=1.0, top_k=0, top_p=1.0), 1.5
    with torch.inference_mode():
        marginals = processed_marginals(model, prompt, params,
                                        lambda row, context, k: reference_penalised(row, context, penalty))
    samples = sample_and_fit(model, prompt, lookahead, marginals, SAMPLES, 99, repetition_penalty=penalty)
    assert samples.shape == (SAMPLES, 3)


def sample_and_fit(model, prompt, lookahead, marginals, count: int, seed: int, **kwargs) -> torch.Tensor:
    """Draws ``count`` samples of 3 new tokens (full vocabulary, ``kwargs`` for generate), checks that lookahead
    accepted a candidate somewhere and that each position fits its exact marginal; returns the samples."""
    gen = torch.Generator().manual_seed(seed)
    samples, accepted = [], []
    for _ in range(count):
        out = model.generate(prompt, max_new_tokens=3, lookahead=lookahead, do_sample=True, top_k=0, generator=gen,
                             **kwargs)
        samples.append(out.sequences[0, prompt.shape[1]:].tolist())
        accepted.extend(out.stats.accepted)
    samples = torch.tensor(samples)
    if lookahead is not None:
        assert max(accepted) >= 2, "no step accepted a candidate: verification was not exercised"
    for pos, p in enumerate(marginals):
        assert (p[samples[:, pos]] > 0).all()
        pvalue = fit_pvalue(samples[:, pos], p)
        assert pvalue > 1e-3, f"position {pos + 1}: chi-square p-value {pvalue:.2e}"
    return samples


@pytest.mark.gpu
def test_cuda_graphs_keep_the_penalty_exact():
    """On CUDA the steps replay captured graphs, which read each row's context from the runner's buffer: the
    output equals the eager loop's and the CPU model's, and a second call (same graphs, new context) too."""
    from .test_static_steps import cuda_tiny

    model = cuda_tiny()
    cpu = LlamaForCausalLM.from_hf(tiny_hf_model(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                                 num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
                                                 initializer_range=0.05))
    prompts = mixed_prompts()
    flat = [(1, 1e-3), (64, 1.01e-3), (256, 1.05e-3)]  # the planner takes trees whatever this GPU measures
    for la in (None, LookaheadConfig(window=4, ngram=3, guess=4), LookaheadConfig(step_costs=flat)):
        for ids in (prompts[0], prompts[2], prompts[0]):
            want = cpu.generate(ids[None], max_new_tokens=32, lookahead=None, repetition_penalty=1.3).sequences
            eager = model.generate(ids[None].cuda(), max_new_tokens=32, lookahead=la, repetition_penalty=1.3,
                                   cuda_graphs=False).sequences
            graphs = model.generate(ids[None].cuda(), max_new_tokens=32, lookahead=la, repetition_penalty=1.3,
                                    cuda_graphs=True).sequences
            assert torch.equal(graphs, eager), la
            # float32 on both devices; a near tie could still part them, so count rather than require
            assert (graphs.cpu() == want).float().mean() > 0.9, la
        batch = model.generate([p.cuda() for p in prompts], max_new_tokens=24, lookahead=la,
                               repetition_penalty=1.3).sequences
        eager = model.generate([p.cuda() for p in prompts], max_new_tokens=24, lookahead=la, repetition_penalty=1.3,
                               cuda_graphs=False).sequences
        assert torch.equal(batch, eager), la
