"""The step-size controller: cost model, planner, automatic mode, and its greedy identity."""

import pytest
import torch

from lookahead import LlamaForCausalLM, LookaheadConfig
from lookahead.controller import StepCosts, StepPlanner, make_plan, step_costs

from .test_generate import hf_greedy, tiny_hf_model

FLAT = ((1, 0.010), (64, 0.0105), (256, 0.0110))      # a GPU: a step costs about the same up to 256 tokens
STEEP = ((1, 0.010), (4, 0.014), (16, 0.030), (64, 0.100))  # a CPU: cost grows with the tokens fed


def test_step_costs_interpolate_and_extrapolate():
    c = StepCosts.from_pairs(STEEP)
    assert c(1) == 0.010 and c(16) == 0.030
    assert c(10) == pytest.approx(0.014 + 6 * (0.016 / 12))
    assert c(128) == pytest.approx(0.100 + 64 * (0.070 / 48))
    assert c.max_tokens == 64
    for bad in (((1, 0.0),), ((2, 0.1), (2, 0.2)), ((0, 0.1),), ()):
        with pytest.raises(ValueError):
            StepCosts.from_pairs(bad)
    with pytest.raises(ValueError, match="step_costs"):
        LookaheadConfig(step_costs=((1, -1.0),))


def test_planner_takes_what_pays():
    flat = StepPlanner(StepCosts.from_pairs(FLAT), 1)
    steep = StepPlanner(StepCosts.from_pairs(STEEP), 1)
    gains = [0.9, 0.8, 0.5, 0.1, 0.05, 0.01]
    assert flat.choose(gains) == 6  # every node adds expected tokens at almost no cost
    # steep: (1 + 0.9 + 0.8 + 0.5) / t(4) = 3.2 / 0.014 beats one more node at t(5)
    assert steep.choose(gains) == 3
    assert steep.choose([0.01, 0.01]) == 0  # nothing pays: a plain step
    assert flat.choose([]) == 0


def test_automatic_plan_uses_the_window_only_where_it_is_cheap(tmp_path):
    model = LlamaForCausalLM.from_hf(tiny_hf_model())
    gpu = make_plan(LookaheadConfig(step_costs=FLAT), model)
    assert (gpu.shape.window, gpu.shape.levels) == (15, 4) and gpu.shape.max_tokens == 256
    assert "pool" in gpu.sources and gpu.planner is not None
    cpu = make_plan(LookaheadConfig(step_costs=STEEP), model)
    assert (cpu.shape.window, cpu.shape.levels, cpu.shape.tree_budget) == (1, 1, 63)
    assert "pool" not in cpu.sources
    fixed = make_plan(LookaheadConfig(max_step_tokens=16), model)
    assert fixed.planner is None and fixed.shape.max_tokens == 16


@pytest.mark.parametrize("costs", [FLAT, STEEP, ((1, 0.01), (2, 1.0))])
def test_automatic_mode_is_greedy_identical_and_deterministic(costs):
    hf = tiny_hf_model()
    ours = LlamaForCausalLM.from_hf(hf)
    ids = torch.cat([torch.tensor([[5, 6, 7, 8] * 3]), torch.randint(0, 97, (1, 6),
                                                                    generator=torch.Generator().manual_seed(3))], 1)
    ref = hf_greedy(hf, ids, 30)
    cfg = LookaheadConfig(step_costs=costs)
    first = ours.generate(ids, max_new_tokens=30, lookahead=cfg)
    again = ours.generate(ids, max_new_tokens=30, lookahead=cfg)
    assert torch.equal(first.sequences, ref)
    assert first.stats.accepted == again.stats.accepted and first.stats.fed_tokens == again.stats.fed_tokens
    if costs[1][1] == 1.0:  # a second token costs 100x: every step is plain
        assert first.stats.fed_tokens == first.stats.steps == 30


def test_default_generate_is_automatic_and_costs_are_cached(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LOOKAHEAD_CACHE_DIR", str(tmp_path))
    hf = tiny_hf_model()
    ours = LlamaForCausalLM.from_hf(hf)
    costs = step_costs(ours)
    assert costs.tokens == (1, 4, 16, 64) and all(s > 0 for s in costs.seconds)
    assert (tmp_path / "step-costs.json").is_file()
    assert "lookahead: measuring this device's step costs (first use; cached in" in capsys.readouterr().err
    assert step_costs(ours) is costs  # memory
    fresh = LlamaForCausalLM.from_hf(hf)
    assert step_costs(fresh) == costs  # disk
    assert capsys.readouterr().err == ""  # read, not measured: nothing said
    ids = torch.tensor([[5, 6, 7, 8] * 3])
    out = ours.generate(ids, max_new_tokens=20)
    assert torch.equal(out.sequences, hf_greedy(hf, ids, 20))
    assert ours.generate(ids, max_new_tokens=20, lookahead=None).stats.fed_tokens == 20


def test_cost_key_names_the_cpu_ops_instruction_set_and_sources():
    from lookahead.controller import cost_key
    from lookahead.cpu_linear import gemm_available
    from lookahead_kernels.cpu_ops import sources_digest

    ours = LlamaForCausalLM.from_hf(tiny_hf_model())
    if not gemm_available():
        pytest.skip("no CPU GEMM: the key names the oneDNN fallback")
    # Timings taken with other kernels, or with the same ones on another instruction set, must not be reused.
    digest = sources_digest()
    assert len(digest) == 12 and int(digest, 16) >= 0
    assert f"linear=ops-{torch.ops.lookahead_gemm.isa()}-{digest}" in cost_key(ours).split("|")


def test_cpu_model_name_tells_cpu_generations_apart(tmp_path):
    from lookahead.controller import cpu_model_name

    # A hypervisor names a Zen 4 and a Zen 5 "AMD EPYC" alike; their step costs differ twofold, so a cost table
    # cached on one must not steer the other. The first processor's block speaks for all.
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\nmodel\t\t: 2\n"
                    "model name\t: AMD EPYC\nstepping\t: 0\n\nprocessor\t: 1\ncpu family\t: 25\nmodel\t\t: 17\n"
                    "model name\t: other\n")
    assert cpu_model_name(str(info)) == "AMD EPYC (family 26, model 2)"
    info.write_text("processor\t: 0\nmodel name\t: Some CPU\n")
    assert cpu_model_name(str(info)) == "Some CPU"
    info.write_text("processor\t: 0\nBogoMIPS\t: 50.00\n")  # no model name (an ARM's cpuinfo): platform's word
    assert cpu_model_name(str(info)) and cpu_model_name(str(tmp_path / "missing"))


def test_host_cost_fits_rows_and_nodes():
    from lookahead.controller import HostCost

    host = HostCost()
    assert host.predict(16, 40) == 0.0  # nothing measured yet
    for rows, nodes in [(1, 8), (1, 3), (16, 10), (16, 0), (4, 12), (9, 9)]:
        host.observe(rows, nodes, 5e-4 * rows + 2e-4 * nodes)
    a, b = host.coefficients
    assert a == pytest.approx(5e-4, rel=1e-6) and b == pytest.approx(2e-4, rel=1e-6)
    assert host.predict(2, 5) == pytest.approx(2e-3, rel=1e-6)
    one = HostCost()  # rows and nodes in one proportion: one term carries the cost, never a negative one
    for _ in range(3):
        one.observe(1, 2, 3e-3)
    assert one.predict(1, 2) == pytest.approx(3e-3) and min(one.coefficients) == 0.0


def test_host_cost_fits_a_fixed_part_where_the_batch_size_changes():
    """A step's own work (c) beside its rows' (a) and nodes' (b): found where the rows change (a batch whose rows
    finish), and left out where they never do (one batch size: c and a * rows are one number), every part >= 0."""
    from lookahead.controller import HostCost

    host = HostCost()
    for rows, nodes in [(16, 40), (16, 90), (12, 30), (8, 20), (16, 64), (4, 10), (8, 70)]:
        host.observe(rows, nodes, 3e-4 + 2e-5 * rows + 1e-6 * nodes)
    assert host.per_step == pytest.approx(3e-4, rel=1e-6)
    assert host.coefficients == pytest.approx((2e-5, 1e-6), rel=1e-6)
    assert host.predict(8, 8) == pytest.approx(3e-4 + 16e-5 + 8e-6, rel=1e-6)
    fixed = HostCost()
    for nodes in (40, 90, 30, 64):
        fixed.observe(16, nodes, 3e-4 + 2e-5 * 16)
    assert fixed.per_step == 0.0 and fixed.predict(16, 50) == pytest.approx(6.2e-4, rel=1e-6)
    # 8 rows of a batch learned at 16: through the origin their host work is half of 16's (0.31 ms) and a node a
    # row accepted 4 times in 10 pays; with the fixed part it is 0.47 ms, and it does not.
    costs = StepCosts((1, 16, 64, 128), (1.3e-3, 1.4e-3, 1.55e-3, 2.2e-3))
    gains = [[0.4]] * 8
    assert StepPlanner(costs, 1, fixed).choose_batch(gains) == 1 and StepPlanner(costs, 1, host).choose_batch(gains) == 0


def test_one_slow_step_does_not_turn_lookahead_off_but_a_real_rise_is_followed():
    from lookahead.controller import HOST_OUTLIER, HostCost

    costs = StepCosts((1, 16, 64), (0.007, 0.009, 0.030))
    gains = [[0.9, 0.8, 0.7]]
    host = HostCost()
    for _ in range(30):
        host.observe(1, 3, 1e-3)
    assert StepPlanner(costs, 1, host).choose_batch(gains) == 3
    # A stall of 200 ms (a garbage collection, another process): the planner would take no tree again, so the
    # fit would never be measured again. It counts as HOST_OUTLIER times the prediction.
    host.observe(1, 3, 0.2)
    assert host.predict(1, 3) < 1e-3 * (1 + HOST_OUTLIER) / 2
    assert StepPlanner(costs, 1, host).choose_batch(gains) == 3
    for _ in range(60):  # the host really got slower (20x): the fit follows it within tens of steps
        host.observe(1, 3, 0.02)
    assert host.predict(1, 3) > 0.015
    assert StepPlanner(costs, 1, host).choose_batch(gains) == 0


def test_planner_charges_host_work_and_a_batch_margin():
    from lookahead.controller import BATCH_MARGIN, HostCost

    costs = StepCosts((1, 16, 64), (0.010, 0.011, 0.030))
    gains = [[0.5]] * 4  # each row's one node: 2 more tokens for the batch at about the same step cost
    assert StepPlanner(costs, 1).choose_batch(gains) == 1
    host = HostCost()
    host.observe(4, 4, 0.008)  # two milliseconds a row: the trees no longer pay
    assert StepPlanner(costs, 1, host).choose_batch(gains) == 0
    # A tree that beats a plain step by less than the margin is not taken by a batch (batch 1 takes it).
    edge = [[(BATCH_MARGIN - 1) / 2]] * 2
    flat = StepCosts((1, 64), (0.010, 0.010))
    assert StepPlanner(flat, 1).choose_batch(edge) == 0
    assert StepPlanner(flat, 1).choose_batch(edge[:1]) == 1


def _choose_batch_by_every_size(planner, gains, sizes=None):
    """choose_batch's rule evaluated as its docstring states it: each size V's expected tokens over its cost."""
    from lookahead.controller import BATCH_MARGIN

    B = len(gains)
    per_row, per_node = planner.host.coefficients if planner.host is not None else (0.0, 0.0)
    per_step = planner.host.per_step if planner.host is not None else 0.0
    best, best_rate = 0, B / planner.costs(B * planner.window_tokens)
    for V in range(1, max(map(len, gains)) + 1):
        fed = V if sizes is None else next((z for z in sizes if z >= V), None)
        if fed is None:
            break
        expected = B + planner._scale() * sum(sum(g[:V]) for g in gains)
        nodes = sum(min(len(g), V) for g in gains)
        rate = expected / (planner.costs(B * (planner.window_tokens + fed)) + per_step + per_row * B + per_node * nodes)
        if rate > best_rate * (BATCH_MARGIN if B > 1 and best == 0 else 1.0):
            best, best_rate = V, rate
    return best


@pytest.mark.parametrize("batch", [1, 2, 5, 16])
def test_planner_choice_equals_evaluating_every_size(batch):
    from lookahead.controller import HostCost

    g = torch.Generator().manual_seed(batch)
    costs = StepCosts.from_pairs([(1, 2.15e-3), (16, 3.29e-3), (64, 3.51e-3), (256, 5.05e-3), (1024, 16e-3)])
    host = HostCost()
    host.observe(batch, 8 * batch, 1e-4 * batch)
    for trial in range(60):
        lengths = torch.randint(0, 40, (batch,), generator=g).tolist()
        # decreasing reach probabilities along each row, some rows all but worthless
        gains = [(torch.rand(n, generator=g).sort(descending=True).values * (trial % 3) / 2).tolist()
                 for n in lengths]
        if not any(gains):
            continue
        sizes = [0, 4, 8, 17, 35] if trial % 2 else None
        for planner in (StepPlanner(costs, 1), StepPlanner(costs, 60, host)):
            assert planner.choose_batch(gains, sizes) == _choose_batch_by_every_size(planner, gains, sizes), \
                (gains, sizes)


def test_the_planner_scales_its_gains_by_what_came_true():
    from lookahead.controller import CALIBRATION_PRIOR, HOST_DECAY, GainCalibration, HostCost

    cal = GainCalibration()
    assert cal.factor == 1.0
    cal.observe(10.0, 14.0)  # more than expected: estimates are never scaled up
    assert cal.factor == 1.0
    cal = GainCalibration()
    cal.observe(10.0, 5.0)
    prior = HOST_DECAY * CALIBRATION_PRIOR
    assert cal.factor == pytest.approx((prior + 5.0) / (prior + 10.0))
    cal.observe(0.0, 3.0)  # a step that expected nothing tells nothing
    assert cal.factor == pytest.approx((prior + 5.0) / (prior + 10.0))

    flat = StepCosts((1, 64), (0.010, 0.010))
    gains = [[0.3, 0.3]] * 4
    planner = StepPlanner(flat, 1, HostCost())
    assert planner.choose_batch(gains) == 2
    rising = StepCosts((1, 64), (0.010, 0.073))  # a token more costs 1 ms: one row's tree pays unscaled only
    one_row = StepPlanner(rising, 1, HostCost())
    assert one_row.choose(gains[0]) == 2
    for _ in range(40):  # the trees keep adding nothing: the estimates shrink until no tree pays
        planner.observe_gain(2.4, 0.0)
        one_row.observe_gain(2.4, 0.0)
    assert planner.calibration.factor < 0.05 and one_row.calibration.factor < 0.05
    assert planner.choose_batch(gains) == 0
    assert one_row.choose(gains[0]) == 0  # one row as well
    # Declined steps verify nothing: the estimate ages back toward the prior, so trees are tried again later
    # (else nothing could lift it within the call).
    declined = 0
    while one_row.choose(gains[0]) == 0:
        one_row.observe_declined()
        declined += 1
    assert 10 < declined < 100 and one_row.calibration.factor < 1.0
    for _ in range(400):
        planner.observe_declined()
    assert planner.calibration.factor == pytest.approx(1.0, abs=1e-6)
    assert StepPlanner(flat, 1).calibration is None  # a given cost table: nothing learned, deterministic
    StepPlanner(flat, 1).observe_declined()  # and nothing to age


def test_backoff_doubles_and_resets():
    from lookahead.generate import MAX_BACKOFF, _Backoff

    b = _Backoff()
    waits = []
    for _ in range(7):
        b.miss()
        n = 0
        while b.waiting():
            n += 1
        waits.append(n)
    assert waits == [1, 2, 4, 8, 16, 16, 16][:7] and max(waits) == MAX_BACKOFF
    b.hit()
    b.miss()
    assert b.wait == 1


def test_step_costs_through_the_static_runner(tmp_path):
    """The CUDA path (each size through a StepRunner, graphs there) runs eagerly on the CPU: same sizes, positive
    times, and the cache the runner wrote stays within bounds."""
    from lookahead.controller import measure_step_costs

    model = LlamaForCausalLM.from_hf(tiny_hf_model())
    costs = measure_step_costs(model, menu=(1, 4, 9), runs=1, static=True)
    assert costs.tokens == (1, 4, 9) and all(s > 0 for s in costs.seconds)


def test_step_costs_time_every_size_once_a_round(monkeypatch):
    """A warm-up of each size, then rounds that each time every size once (a slow spell slows all sizes alike)."""
    from lookahead.controller import measure_step_costs

    model = LlamaForCausalLM.from_hf(tiny_hf_model())
    sizes = []
    forward = type(model).forward
    monkeypatch.setattr(type(model), "forward", lambda self, ids, *a, **k: sizes.append(ids.shape[1]) or
                        forward(self, ids, *a, **k))
    costs = measure_step_costs(model, menu=(1, 4, 9), runs=3, static=False)
    assert sizes == [1, 4, 9] * 4 and costs.tokens == (1, 4, 9) and all(s > 0 for s in costs.seconds)


def test_step_costs_time_a_step_with_its_verification():
    """The static path times what generate's graphs hold: the forward and the greedy finish of that shape (the
    plain step's argmax; a tree's verifier up to its size, with successor tops of every row it computes)."""
    from lookahead.config import StepShape
    from lookahead.controller import _greedy_finish
    from lookahead.verification import PlainChoice, StepVerifier

    plain = _greedy_finish(StepShape(1, 1, 0))
    assert isinstance(plain, PlainChoice) and plain.uniforms_per_row == 0  # greedy: a graph holds it whole
    tree = _greedy_finish(StepShape(1, 1, 15))
    assert isinstance(tree, StepVerifier) and tree.uniforms_per_row == 0
    assert tree.max_accept == 15 and tree.successor_rows == 16 and tree.successor_k > 0


def test_only_greedy_steps_age_the_calibration(tmp_path, monkeypatch):
    monkeypatch.setenv("LOOKAHEAD_CACHE_DIR", str(tmp_path))
    calls = []
    monkeypatch.setattr(StepPlanner, "observe_declined", lambda self: calls.append(1))
    ours = LlamaForCausalLM.from_hf(tiny_hf_model())
    ids = torch.tensor([[5, 6, 7, 8] * 3])
    # A given table: a measured one on a loaded machine (the suite's other workers) could make every tree pay.
    la = LookaheadConfig(step_costs=STEEP)
    ours.generate(ids, max_new_tokens=60, do_sample=True, temperature=1.0, generator=torch.Generator().manual_seed(0),
                  lookahead=la)
    assert calls == []  # a sampled step's declines tell nothing new (GainCalibration.relax)
    ours.generate(ids, max_new_tokens=60, lookahead=la)
    assert calls  # greedy ones do
