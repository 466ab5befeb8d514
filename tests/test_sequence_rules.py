"""no_repeat_ngram_size, encoder_no_repeat_ngram_size, sequence_bias and bad_words_ids: the oracles against
transformers' own processors, a tree's rows against the oracles (each node's sequence ending with its path), then
generate end to end (plain and lookahead, greedy identical to transformers' generate; sampled tokens following the
processed distribution), and the arguments' errors."""

import random

import pytest
import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import (EncoderNoRepeatNGramLogitsProcessor, NoBadWordsLogitsProcessor,
                                                    NoRepeatNGramLogitsProcessor, SequenceBiasLogitsProcessor)

from lookahead import LlamaForCausalLM, LookaheadConfig
from lookahead.processors import LogitsProcessors
from lookahead.sampling import SamplingParams
from lookahead.sequence_rules import (NoRepeatNGram, PromptNGrams, SequenceBias, TokenHistory, bad_words,
                                      reference_no_repeat, reference_prompt_ngrams, reference_sequence_bias)

from .test_batch import mixed_prompts
from .test_generate import dev_prompts, tiny_hf_model
from .test_repetition import (CONFIGS, SAMPLED_VOCAB, path_of, processed_marginals,  # noqa: F401
                              sample_and_fit, tiny)  # (tiny: a fixture)
from .test_length_rules import batch_rows_decode_alone, hf_generate, padded_trees


def _zeros(name, shape, dtype):
    return torch.zeros(shape, dtype=dtype)


BIASES = {(2,): -1.5, (1, 3): 2.0, (0, 1, 3): -0.75, (4, 4): -4.0, (3,): 0.5, (2, 0, 4, 1): 3.0}


def test_references_are_transformers_own():
    """(Sequences at least as long as every bias: transformers 5.17 and later versions differ on shorter ones.)"""
    rng = random.Random(0)
    for _ in range(300):
        seq = [rng.randrange(5) for _ in range(rng.randint(4, 14))]
        row = torch.randn(5)
        ids = torch.tensor([seq])
        for n in (1, 2, 3, 4):
            want = NoRepeatNGramLogitsProcessor(n)(ids, row[None].clone())[0]
            assert torch.equal(reference_no_repeat(row, seq, n), want), (seq, n)
            short = seq[:rng.randint(1, 3)]
            want = NoRepeatNGramLogitsProcessor(n)(torch.tensor([short]), row[None].clone())[0]
            assert torch.equal(reference_no_repeat(row, short, n), want), (short, n)
            prompt = seq[:rng.randint(1, len(seq))]
            want = EncoderNoRepeatNGramLogitsProcessor(n, torch.tensor([prompt]))(ids, row[None].clone())[0]
            assert torch.equal(reference_prompt_ngrams(row, prompt, seq, n), want), (prompt, seq, n)
        want = SequenceBiasLogitsProcessor(dict(BIASES))(ids, row[None].clone())[0]
        assert torch.equal(reference_sequence_bias(row, seq, BIASES), want), seq
        words = [[3], [1, 2], [0, 4, 4], [2]]
        want = NoBadWordsLogitsProcessor(words, eos_token_id=[2])(ids, row[None].clone())[0]
        assert torch.equal(reference_sequence_bias(row, seq, bad_words([tuple(w) for w in words], [2])), want)
    # a row's whole sequence as a prefix: biased (today's transformers; 5.17 waited for one more token)
    assert reference_sequence_bias(torch.zeros(5), [1], {(1, 3): 2.0, (0, 1, 3): 1.0}).tolist() == [0, 0, 0, 2, 0]


def _rule(kind, history, prompts):
    """The rule and its oracle ``(row, sequence, b)`` (``b``: the row of the batch whose prompt it reads)."""
    if kind.startswith("no_repeat_"):
        n = int(kind[-1])
        return NoRepeatNGram(n, history), lambda row, seq, b: reference_no_repeat(row, seq, n)
    if kind.startswith("prompt_ngrams_"):
        n = int(kind[-1])
        return PromptNGrams(n, history), lambda row, seq, b: reference_prompt_ngrams(row, prompts[b], seq, n)
    words = bad_words([(3,), (1, 2), (0, 4, 4), (2, 2, 2, 2, 2)], eos=())
    biases = BIASES if kind == "sequence_bias" else words
    return SequenceBias(biases, history), lambda row, seq, b: reference_sequence_bias(row, seq, biases)


@pytest.mark.parametrize("kind", ["no_repeat_2", "no_repeat_3", "sequence_bias", "bad_words", "prompt_ngrams_1",
                                  "prompt_ngrams_3"])
@pytest.mark.parametrize("replayed", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_tree_rows_follow_their_own_sequence(seed, replayed, kind):
    """Each node's row against the oracle over the row's committed sequence followed by the node's path; rows of
    different lengths (some shorter than an n-gram), a small vocabulary so that n-grams repeat along paths."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    B, N, V, padding = 3, rng.randint(1, 12), 5, 2
    sequences = [[rng.randrange(V) for _ in range(rng.randint(1, 9))] for _ in range(B)]
    history = TokenHistory()
    history.start(_zeros, sequences, 40, replayed)
    rule, reference = _rule(kind, history, [list(s) for s in sequences])
    rule.start(_zeros, sequences, [0] * B, replayed)
    for step in range(3):
        logits = torch.randn(B, N + padding, V)
        tokens = torch.randint(0, V, (B, N + padding))
        trees, end, depth = padded_trees(B, N, padding, rng)
        got = rule.tree(logits, tokens, end, depth)
        rows = rule.rows(logits[:, 0])
        for b, (parents, _) in enumerate(trees):
            assert torch.equal(rows[b], reference(logits[b, 0], sequences[b], b)), (step, b)
            for i in range(N):
                path = [int(tokens[b, j]) for j in reversed(path_of(i, parents))]
                assert torch.equal(got[b, i], reference(logits[b, i], sequences[b] + path, b)), (step, b, i)
        # one tree for the whole batch ([N] end and depth)
        shared = rule.tree(logits[:, :N], tokens[:, :N], end[0, :N], depth[0, :N])
        for b in range(B):
            for i in range(N):
                path = [int(tokens[b, j]) for j in reversed(path_of(i, trees[0][0]))]
                assert torch.equal(shared[b, i], reference(logits[b, i], sequences[b] + path, b)), (step, b, i)
        added = [[rng.randrange(V) for _ in range(rng.randint(0, 4))] for _ in range(B)]
        history.add(added)
        sequences = [s + a for s, a in zip(sequences, added)]
    history.keep([2, 0])
    rule.keep([2, 0])
    logits = torch.randn(2, V)
    rows = rule.rows(logits)
    for r, b in enumerate([2, 0]):
        assert torch.equal(rows[r], reference(logits[r], sequences[b], b))


def test_the_processors_keep_transformers_order():
    """The sequence bias comes before the penalty (which it changes); the bans after it (which they commute with)."""
    torch.manual_seed(0)
    logits = torch.randn(2, 6)
    seq = [[1, 3, 1], [0, 4, 4, 1]]
    both = LogitsProcessors(6, 1.7, no_repeat_ngram_size=2, sequence_bias=BIASES,
                            bad_words=bad_words([(4, 1, 5)], ()))
    both.start(_zeros, seq, [0, 0], replayed=False, capacity=8)
    from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor

    hf = LogitsProcessorList([SequenceBiasLogitsProcessor(dict(BIASES)),
                              RepetitionPenaltyLogitsProcessor(1.7), NoRepeatNGramLogitsProcessor(2),
                              NoBadWordsLogitsProcessor([[4, 1, 5]])])
    got = both.rows(logits)
    for b in range(2):
        assert torch.equal(got[b], hf(torch.tensor([seq[b]]), logits[b][None].clone())[0])


@pytest.mark.parametrize("replayed", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_a_refilled_place_restarts_as_if_the_batch_started_so(seed, replayed):
    """``LogitsProcessors.restart`` of some rows (waiting prompts taking finished rows' places) leaves every
    processor's rows and tree nodes as a fresh ``start`` over the batch's rows as they now are would."""
    from lookahead.custom_processors import CustomProcessors

    rng = random.Random(seed)
    torch.manual_seed(seed)
    B, V, N, capacity = 4, 13, 6, 40

    rules = dict(no_repeat_ngram_size=rng.choice([0, 2, 3]), prompt_ngram_size=rng.choice([0, 1, 2]),
                 length=dict(min_new=rng.randint(0, 6), always=[0, 11], at_start=[5], begin=0,
                             decay=rng.choice([None, (2, 1.3)])))

    def processors():
        custom = None if replayed else CustomProcessors(
            [], lambda batch_id, ids: [(batch_id + int(ids[-1])) % V, (3 * batch_id + 1) % V, 7])
        return LogitsProcessors(V, 1.3, eos=[3, 7], prompt_penalty=0.8, sequence_bias={(2,): -1.5, (1, 3): 2.0},
                                bad_words={(4, 4): float("-inf")}, custom=custom, **rules)

    def sequence():
        return [rng.randrange(V) for _ in range(rng.randint(1, 9))]

    kept = {}

    def runner_state(name, shape, dtype):  # a runner's tensors: the same ones again
        if name not in kept or kept[name].shape != shape:
            kept[name] = torch.zeros(shape, dtype=dtype)
        return kept[name]

    state = runner_state if replayed else _zeros
    sequences, counts, ids = [sequence() for _ in range(B)], [0] * B, list(range(B))
    ours = processors()
    ours.start(state, sequences, counts, replayed, capacity, batch_ids=ids)
    for step in range(4):
        added = [[rng.randrange(V) for _ in range(rng.randint(1, 3))] for _ in range(B)]
        sequences = [s + a for s, a in zip(sequences, added)]
        counts = [c + len(a) for c, a in zip(counts, added)]
        ours.add(added, counts)
        places = sorted(rng.sample(range(B), rng.randint(1, 2)))
        for b in places:  # a waiting prompt (new tokens: 0; a prompt of its own) takes row b's place
            sequences[b], counts[b], ids[b] = sequence(), 0, max(ids) + 1
        ours.restart(places, [sequences[b] for b in places], [counts[b] for b in places], [ids[b] for b in places])
        fresh = processors()
        fresh.start(_zeros, sequences, counts, replayed, capacity, batch_ids=ids)
        logits = torch.randn(B, N + 1, V)
        tokens = torch.randint(0, V, (B, N))
        _, end, depth = padded_trees(B, N, 0, rng)
        assert torch.equal(ours.rows(logits[:, 0]), fresh.rows(logits[:, 0])), step
        assert torch.equal(ours.tree(logits[:, 1:], tokens, end, depth),
                           fresh.tree(logits[:, 1:], tokens, end, depth)), step


# ---- end to end ------------------------------------------------------------------------------------------------

def _kwargs(kind, hf, ids):
    """Arguments that change the greedy output of ``ids`` (the sequence bias and the bad words aim at the tokens
    plain decoding emits)."""
    plain = hf_generate(hf, ids, 8)[0, ids.shape[1]:].tolist()
    return {"no_repeat_2": dict(no_repeat_ngram_size=2), "no_repeat_3": dict(no_repeat_ngram_size=3),
            "sequence_bias": dict(sequence_bias=[[plain[1:3], -30.0], [[plain[4]], -2.0], [plain[:2], 5.0]]),
            "bad_words": dict(bad_words_ids=[plain[2:4], [plain[5]], plain[:1] + plain[2:3]]),
            "with_penalty": dict(no_repeat_ngram_size=3, repetition_penalty=1.2,
                                 bad_words_ids=[plain[3:5]]),
            "prompt_rules": dict(encoder_no_repeat_ngram_size=2, encoder_repetition_penalty=1.6)}[kind]


@pytest.mark.parametrize("kind", ["no_repeat_2", "no_repeat_3", "sequence_bias", "bad_words", "with_penalty",
                                  "prompt_rules"])
def test_greedy_output_is_transformers_own(tiny, kind):
    hf, model = tiny
    changed = 0
    for ids in [p[None] for p in mixed_prompts()]:
        kwargs = _kwargs(kind, hf, ids)
        want = hf_generate(hf, ids, 32, **kwargs)
        changed += not torch.equal(want, hf_generate(hf, ids, 32))
        for la in CONFIGS:
            got = model.generate(ids, max_new_tokens=32, lookahead=la, pad_token_id=0, **kwargs)
            assert torch.equal(got.sequences, want), la
        # the static-step loop (what CUDA graphs replay), run eagerly
        static = model.generate(ids, max_new_tokens=32, lookahead=CONFIGS[1], pad_token_id=0, cuda_graphs=False,
                                _static_steps=True, **kwargs)
        assert torch.equal(static.sequences, want)
    assert changed, "the rules changed no output: a weak test"


@pytest.mark.parametrize("n", [2, 3, 4])
def test_greedy_output_is_transformers_own_in_a_small_vocabulary(n):
    """16 tokens: the model repeats itself within a few steps, so the rule bans on every prompt."""
    hf = tiny_hf_model(seed=0, vocab=SAMPLED_VOCAB)
    model = LlamaForCausalLM.from_hf(hf)
    for ids in [p[None] % SAMPLED_VOCAB for p in mixed_prompts()]:
        want = hf_generate(hf, ids, 32, no_repeat_ngram_size=n)
        assert not torch.equal(want, hf_generate(hf, ids, 32)), "nothing changed: a weak test"
        for la in CONFIGS[1:]:
            got = model.generate(ids, max_new_tokens=32, lookahead=la, pad_token_id=0, no_repeat_ngram_size=n)
            assert torch.equal(got.sequences, want), la


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("rule", ["no_repeat_ngram_size", "encoder_no_repeat_ngram_size"])
def test_each_row_of_a_batch_keeps_its_own_sequence(tiny, static, rule):
    """Rows of different lengths, stopping apart at an EOS: each bans its own repeats (or its own prompt's
    n-grams), as it would alone."""
    hf, model = tiny
    eos = int(hf_generate(hf, mixed_prompts()[0][None], 8, **{rule: 2})[0, -1])
    batch_rows_decode_alone(hf, model, eos, static, **{rule: 2})


def test_smollm2_dev_prompts_without_repeated_trigrams(smollm2):
    hf, ours, tok = smollm2
    changed = 0
    for name in ("mt_bench_dev.jsonl", "humaneval_dev.jsonl"):
        for ids in dev_prompts(tok, name, 1):
            want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=48, do_sample=False,
                               no_repeat_ngram_size=3)
            changed += not torch.equal(want, ours.generate(ids, max_new_tokens=48, lookahead=None).sequences)
            for la in (None, LookaheadConfig(), LookaheadConfig(7, 5, 7)):
                got = ours.generate(ids, max_new_tokens=48, lookahead=la, no_repeat_ngram_size=3)
                assert torch.equal(got.sequences, want), (name, la)
    assert changed, "no answer repeated a trigram: a weak test"


def test_fields_from_a_generation_config(tiny):
    hf, model = tiny
    ids = mixed_prompts()[0][None]
    config = GenerationConfig(no_repeat_ngram_size=2, bad_words_ids=[[5, 6]], sequence_bias=[[[7], -3.0]])
    want = hf_generate(hf, ids, 20, generation_config=config)
    assert torch.equal(model.generate(ids, max_new_tokens=20, generation_config=config, pad_token_id=0).sequences,
                       want)
    want = hf_generate(hf, ids, 20, generation_config=config, no_repeat_ngram_size=0)  # a keyword overrides
    assert torch.equal(model.generate(ids, max_new_tokens=20, generation_config=config, no_repeat_ngram_size=0,
                                      pad_token_id=0).sequences, want)


@pytest.mark.parametrize("kwargs,message", [
    (dict(no_repeat_ngram_size=-1), "no_repeat_ngram_size must be an int >= 0"),
    (dict(no_repeat_ngram_size=2.0), "no_repeat_ngram_size must be an int >= 0"),
    (dict(bad_words_ids=[]), "bad_words_ids must be a non-empty list"),
    (dict(bad_words_ids=[[1], []]), "each bad_words_ids entry must be a non-empty list of token ids"),
    (dict(bad_words_ids=[[1, -2]]), "each bad_words_ids entry must be a non-empty list of token ids"),
    (dict(bad_words_ids=[[1, 97]]), r"bad_words_ids must hold token ids in \[0, 97\), got \[97\]"),
    (dict(sequence_bias={(1,): 2}), None),  # an int bias is a number: accepted
    (dict(sequence_bias=[[[1], "big"]]), "sequence_bias's bias for \\[1\\] must be a number"),
    (dict(sequence_bias=[[[1], float("inf")]]), "must be a number \\(finite, or -inf\\)"),
    (dict(sequence_bias=[[[1], float("nan")]]), "must be a number \\(finite, or -inf\\)"),
    (dict(sequence_bias=[1, 2]), "sequence_bias must be a list of \\[\\[token ids\\], bias\\] pairs"),
    (dict(sequence_bias=[]), "sequence_bias is empty"),
    (dict(sequence_bias={(): 1.0}), "each sequence_bias sequence must be a non-empty list"),
    (dict(sequence_bias={(200, 1): 1.0}), r"sequence_bias must hold token ids in \[0, 97\), got \[200\]"),
])
def test_bad_arguments_are_clear_errors(tiny, kwargs, message):
    _, model = tiny
    if message is None:
        model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, **kwargs)
        return
    with pytest.raises(ValueError, match=message):
        model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, **kwargs)


SAMPLES = 1500


def test_sampled_tokens_follow_the_distribution_without_repeats():
    """With lookahead (plain steps process x's row by the same call, which the oracle tests check)."""
    lookahead = LookaheadConfig(window=4, ngram=3, guess=4)
    model = LlamaForCausalLM.from_hf(tiny_hf_model(seed=0, vocab=SAMPLED_VOCAB))
    prompt = model.generate(torch.tensor([[1]]), max_new_tokens=15).sequences
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0)
    with torch.inference_mode():
        marginals = processed_marginals(model, prompt, params,
                                        lambda row, context, k: reference_no_repeat(row, context, 2))
    # the prompt repeats itself, so the ban moves mass at every position
    samples = sample_and_fit(model, prompt, lookahead, marginals, SAMPLES, 5, no_repeat_ngram_size=2)
    P = prompt.shape[1]
    for s in samples.tolist():  # no new token completes a bigram the sequence before it holds
        whole = prompt[0].tolist() + s
        for k in range(P, len(whole)):
            assert (whole[k - 1], whole[k]) not in set(zip(whole[:k - 1], whole[1:k])), whole


@pytest.mark.gpu
def test_cuda_graphs_keep_the_sequence_rules_exact():
    """Replayed graphs read the rows' sequences from the runner's state: a second call (the same graphs, another
    prompt) and a batch equal the eager loop."""
    from .test_static_steps import cuda_tiny

    model = cuda_tiny()
    prompts = mixed_prompts()
    flat = [(1, 1e-3), (64, 1.01e-3), (256, 1.05e-3)]  # the planner takes trees whatever this GPU measures
    rules = (dict(no_repeat_ngram_size=3), dict(no_repeat_ngram_size=2, bad_words_ids=[[5, 6], [7]]),
             dict(sequence_bias=[[[1, 2], -3.0], [[9], 1.5]], repetition_penalty=1.2))
    for la in (None, LookaheadConfig(window=4, ngram=3, guess=4), LookaheadConfig(step_costs=flat)):
        for kwargs in rules:
            for ids in (prompts[0], prompts[2], prompts[0]):
                eager = model.generate(ids[None].cuda(), max_new_tokens=24, lookahead=la, cuda_graphs=False,
                                       **kwargs).sequences
                graphs = model.generate(ids[None].cuda(), max_new_tokens=24, lookahead=la, cuda_graphs=True,
                                        **kwargs).sequences
                assert torch.equal(graphs, eager), (la, kwargs)
        batch = model.generate([p.cuda() for p in prompts], max_new_tokens=24, lookahead=la,
                               **rules[1]).sequences
        eager = model.generate([p.cuda() for p in prompts], max_new_tokens=24, lookahead=la, cuda_graphs=False,
                               **rules[1]).sequences
        assert torch.equal(batch, eager), la
