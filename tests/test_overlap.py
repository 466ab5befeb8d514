"""Overlapped steps (lookahead/overlap.py): a step that writes the next one's inputs on the device, and the loop
that launches each step before reading the last. Every row stays its own plain greedy output; a parked row stays
where it is; a row's step past its end is dropped; near the model's last positions the loop goes step by step."""

from __future__ import annotations

import pytest
import torch

from lookahead import LlamaForCausalLM, LookaheadConfig
from lookahead.config import StepShape
from lookahead.overlap import OverlappedSteps
from lookahead.runner import StepRunner
from lookahead.step import packed_plain_step
from lookahead.verification import PlainChoice, Sampler

from .test_batch import check_rows, mixed_prompts, rows_stopping_apart
from .test_generate import tiny_hf_model

STATIC = dict(cuda_graphs=False, _static_steps=True)
PLAIN = StepShape(1, 1, 0)


@pytest.fixture(scope="module")
def tiny():
    return LlamaForCausalLM.from_hf(tiny_hf_model())


def _counting_replays(monkeypatch) -> list:
    calls = []
    original = StepRunner.replay

    def replay(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(StepRunner, "replay", replay)
    return calls


def test_an_advancing_step_feeds_what_it_chose(tiny):
    """Plain steps: ``run(advance=True)`` then ``replay``s equal steps packed on the host from the chosen tokens;
    a parked row's inputs stay as written."""
    B, steps = 3, 5
    xs, lens = [5, 9, 11], [0, 0, 0]
    sampler = Sampler(False, 1.0, None, None, None, None, ())
    finish = PlainChoice(sampler)
    caches = [tiny.new_cache(B, 64) for _ in range(2)]
    runners = [StepRunner(tiny, c, [PLAIN]) for c in caches]
    advancing, reference = runners
    advancing.set_live([True, False, True])
    packed, tokens, positions = packed_plain_step(xs, lens)
    got = [advancing.run(PLAIN, tokens, positions, None, packed=packed, finish=finish, advance=True).tolist()]
    got += [advancing.replay(PLAIN, finish).tolist() for _ in range(steps - 1)]
    want, ref_xs, ref_lens = [], list(xs), list(lens)
    for _ in range(steps):
        packed, tokens, positions = packed_plain_step(ref_xs, ref_lens)
        chosen = reference.run(PLAIN, tokens, positions, None, packed=packed, finish=finish).tolist()
        want.append(chosen)
        ref_xs = [c if b != 1 else x for b, (c, x) in enumerate(zip(chosen, ref_xs))]
        ref_lens = [n + (b != 1) for b, n in enumerate(ref_lens)]
    assert got == want
    buf = next(iter(advancing._buffers.values()))
    assert buf.inputs.cache_len.tolist() == [steps, 0, steps]
    assert buf.inputs.positions[:, 0].tolist() == [steps, 0, steps]
    assert buf.inputs.tokens[1, 0].item() == 9


def test_advance_and_replay_are_refused_where_they_cannot_be(tiny):
    runner = StepRunner(tiny, tiny.new_cache(2, 32), [PLAIN, StepShape(2, 2, 0)])
    finish = PlainChoice(Sampler(False, 1.0, None, None, None, None, ()))
    packed, tokens, positions = packed_plain_step([1, 2], [0, 0])
    with pytest.raises(ValueError, match="advance needs a finish"):
        runner.run(PLAIN, tokens, positions, None, packed=packed, advance=True)
    with pytest.raises(ValueError, match="replay needs an advancing run"):
        runner.replay(PLAIN, finish)
    with pytest.raises(ValueError, match="set_live needs 2 flags"):
        runner.set_live([True])


@pytest.mark.parametrize("lookahead", [None, LookaheadConfig(device_tree=4)], ids=["plain", "device-tree"])
def test_overlapped_rows_equal_their_own_greedy_output(tiny, lookahead, monkeypatch):
    """Rows stopping at different steps, all at once (the batch moving to smaller runners) and refilled: each row
    its own greedy output, the steps overlapped (replayed) unless turned off, and the same steps either way."""
    prompts = mixed_prompts() + [torch.tensor([4] * 5)]
    eos, refs = rows_stopping_apart(tiny, prompts)
    calls = _counting_replays(monkeypatch)
    for rows in (None, 2):
        counts = []
        for overlap in (True, False):
            calls.clear()
            out = tiny.generate(prompts, max_new_tokens=24, lookahead=lookahead, eos_token_id=eos, pad_token_id=0,
                                max_batch_size=rows, _overlap_steps=overlap, **STATIC)
            check_rows(out, refs, prompts, pad_id=0)
            assert out.stats.new_tokens == sum(out.stats.accepted)
            assert (len(calls) > out.stats.steps // 2) if overlap else not calls
            counts.append([(r.steps, r.accepted) for r in out.stats.rows])
        assert counts[0] == counts[1]


@pytest.mark.parametrize("lookahead", [None, LookaheadConfig(device_tree=4)], ids=["plain", "device-tree"])
def test_overlapped_rows_reach_the_models_last_position(lookahead):
    """Prompts that end right at the model's positions: the device-tree steps give way to plain ones there, after
    the step in flight, and nothing runs past the positions."""
    model = LlamaForCausalLM.from_hf(tiny_hf_model(max_position_embeddings=40))
    prompts = [torch.tensor([3, 4, 5] * 4), torch.tensor([7, 8] * 6), torch.tensor([9, 1, 2, 6] * 3)]
    refs = [model.generate(p, max_new_tokens=28, lookahead=None).sequences[0] for p in prompts]
    for rows in (None, 1):
        out = model.generate(prompts, max_new_tokens=28, lookahead=lookahead, pad_token_id=0, max_batch_size=rows,
                             _overlap_steps=True, **STATIC)
        check_rows(out, refs, prompts, pad_id=0)


def test_sampled_overlapped_rows_match_step_by_step():
    """A seeded sampled plain call whose rows stop together draws the same numbers in the same order whether its
    steps overlap or not. (Where rows stop apart they need not: a step launched before a row's end was seen draws
    for the whole batch, where the step-by-step loop would have moved to a smaller one first; the device tree's
    chi-square test in tests/test_device_tree.py samples through overlapped steps.)"""
    model = LlamaForCausalLM.from_hf(tiny_hf_model(seed=1))
    outs = [model.generate(mixed_prompts(), max_new_tokens=16, lookahead=None, do_sample=True, top_k=20,
                           generator=torch.Generator().manual_seed(7), pad_token_id=0, _overlap_steps=overlap,
                           **STATIC) for overlap in (True, False)]
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    assert outs[0].stats.steps == outs[1].stats.steps == 16


def test_overlap_is_refused_where_a_step_needs_the_last_ones_result(tiny):
    prompt = torch.tensor([1, 2, 3])
    for kwargs in (dict(repetition_penalty=1.2), dict(output_scores=True, return_dict_in_generate=True)):
        kwargs = dict(dict(lookahead=None), **kwargs)
        with pytest.raises(ValueError, match="_overlap_steps=True needs"):
            tiny.generate(prompt, max_new_tokens=4, _overlap_steps=True, **kwargs, **STATIC)
    with pytest.raises(ValueError, match="_overlap_steps=True needs"):
        tiny.generate(prompt, max_new_tokens=4, lookahead=None, _overlap_steps=True)  # the eager loop
    with pytest.raises(ValueError, match="_overlap_steps must be"):
        tiny.generate(prompt, max_new_tokens=4, lookahead=None, _overlap_steps=1, **STATIC)


@pytest.mark.gpu
@pytest.mark.parametrize("lookahead", [None, LookaheadConfig(device_tree=4)], ids=["plain", "device-tree"])
def test_overlapped_graphs_equal_step_by_step_graphs(lookahead):
    """On CUDA with graphs: the advancing step's capture (its inputs restored around the warm-up runs) and the
    replays launched before each read-back give every row its own greedy output, and the steps replayed."""
    model = LlamaForCausalLM.from_hf(tiny_hf_model().to("cuda"))
    prompts = [p.cuda() for p in mixed_prompts()] + [torch.tensor([4] * 5, device="cuda")]
    eos, refs = rows_stopping_apart(model, prompts)
    outs = []
    for overlap in (True, False):
        for rows in (None, 2):
            out = model.generate(prompts, max_new_tokens=24, lookahead=lookahead, eos_token_id=eos, pad_token_id=0,
                                 max_batch_size=rows, _overlap_steps=overlap)
            check_rows(out, refs, prompts, pad_id=0)
            outs.append([(r.steps, r.accepted) for r in out.stats.rows])
    assert outs[:2] == outs[2:]


def test_no_step_is_launched_past_the_last_token(tiny, monkeypatch):
    """Rows that all end at ``max_new_tokens`` launch no step after their last: a step emits at least one token a
    row, so the loop knows, with a step in flight, that none would be needed."""
    calls = _counting_replays(monkeypatch)
    for max_new in (1, 2, 9):
        calls.clear()
        out = tiny.generate(mixed_prompts(), max_new_tokens=max_new, lookahead=None, _overlap_steps=True, **STATIC)
        assert out.stats.steps == max_new
        assert len(calls) == max_new - 1  # the first step is written from the host, the rest replayed


@pytest.mark.parametrize("lookahead", [
    LookaheadConfig(step_costs=((1, 0.01), (16, 0.05), (64, 0.2))),  # trees never pay: every step plain
    LookaheadConfig(step_costs=((1, 0.010), (16, 0.0101), (64, 0.0102))),  # trees pay: plain steps between them
    LookaheadConfig(window=3, ngram=3, guess=3)], ids=["auto-plain", "auto-trees", "fixed"])
def test_a_lookahead_calls_plain_steps_overlap(lookahead, monkeypatch):
    """A lookahead call's plain steps (a batch too big for trees, a planner's pause, the model's last positions)
    overlap too, waiting for the step in flight before any lookahead step: every row its own greedy output."""
    model = LlamaForCausalLM.from_hf(tiny_hf_model(max_position_embeddings=52))  # the 12-token prompts reach it
    prompts = mixed_prompts() + [torch.tensor([4, 5, 6] * 4)]
    eos, refs = rows_stopping_apart(model, prompts, max_new_tokens=40)
    launches = []
    launch = OverlappedSteps.launch
    monkeypatch.setattr(OverlappedSteps, "launch", lambda self, *a: launches.append(1) or launch(self, *a))
    for rows in (None, 2):
        launches.clear()
        out = model.generate(prompts, max_new_tokens=40, lookahead=lookahead, eos_token_id=eos, pad_token_id=0,
                             max_batch_size=rows, _overlap_steps=True, **STATIC)
        check_rows(out, refs, prompts, pad_id=0)
        tree_steps = sum(1 for r in out.stats.rows for a in r.accepted if a > 1)
        assert launches, "no plain step overlapped"
        assert tree_steps or len(launches) >= out.stats.steps - 1  # no tree: every step plain, overlapped
