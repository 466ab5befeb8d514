"""StepRunner: steps run on static buffers give the logits (and KV cache) of the plain forward; CUDA graphs
replay the eager result on a GPU."""

from __future__ import annotations

import pytest
import torch

from lookahead.config import StepShape
from lookahead.model import LlamaForCausalLM, ModelConfig
from lookahead.runner import StepRunner
from lookahead_kernels import StepLayout
from lookahead_kernels.tree import TreeShape

PLAIN = StepShape(1, 1, 0)
TREE = StepShape(3, 2, 5)
TREES = [TreeShape.from_parents(p) for p in ([-1, 0, 1, -1, 3], [-1, -1, -1, 2, 3], [-1, 0, 0, 0, 0])]


def tiny_model(device="cpu", dtype=torch.float32):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=64 if device == "cuda" else 16, max_position_embeddings=512)
    return LlamaForCausalLM(cfg, dtype=dtype, device=device).eval()


def steps(device, batch, count=6, seed=1):
    """(shape, tokens, positions, cache_len, tree, rows) for alternating plain and tree steps."""
    gen = torch.Generator().manual_seed(seed)
    length = torch.randint(5, 9, (batch,), generator=gen)
    out = []
    for i in range(count):
        shape = TREE if i % 2 else PLAIN
        tree = TREES[i % len(TREES)] if shape.tree_budget else None
        layout = StepLayout(shape.window, shape.levels, tree)
        tokens = torch.randint(0, 97, (batch, layout.T), generator=gen)
        positions = length[:, None] + layout.position_offsets()[None]
        rows = torch.tensor([0, layout.T - 1]) if i == 3 else None
        out.append((shape, tokens.to(device), positions.to(device), length.clone().to(device),
                    tree.to(device) if tree is not None else None, None if rows is None else rows.to(device)))
        length += 1 + i % 2  # as if one or two tokens were committed
    return out


def prefilled(model, batch, device, seed=3):
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 97, (batch, 5), generator=gen).to(device)
    cache = model.new_cache(batch, 64)
    positions = torch.arange(5, device=device).expand(batch, 5)
    with torch.inference_mode():
        model(prompt, positions, cache, 0, StepLayout.prefill(5))
    return cache


@pytest.mark.parametrize("batch", [1, 2])
def test_eager_static_buffers_give_the_plain_forward_logits_on_cpu(batch):
    model = tiny_model()
    cache_ref, cache_run = prefilled(model, batch, "cpu"), prefilled(model, batch, "cpu")
    runner = StepRunner(model, cache_run, [PLAIN, TREE])
    for shape, tokens, positions, lens, tree, rows in steps("cpu", batch):
        layout = StepLayout(shape.window, shape.levels, tree)
        with torch.inference_mode():
            ref = model(tokens, positions, cache_ref, lens, layout, rows)
        got = runner.run(shape, tokens, positions, lens, tree, rows)
        assert torch.equal(got, ref), shape
    assert torch.equal(cache_run.k, cache_ref.k) and torch.equal(cache_run.v, cache_ref.v)
    assert runner.captured() == []


def test_int_cache_len_and_shared_tree_are_accepted():
    model = tiny_model()
    cache = prefilled(model, 2, "cpu")
    runner = StepRunner(model, cache, [TREE])
    layout = StepLayout(3, 2, TREES[0])
    tokens = torch.randint(0, 97, (2, layout.T))
    positions = (7 + layout.position_offsets()).expand(2, layout.T)
    got = runner.run(TREE, tokens, positions, 7, TREES[0])
    ref_cache = prefilled(model, 2, "cpu")
    with torch.inference_mode():
        ref = model(tokens, positions, ref_cache, 7, layout)
    assert torch.equal(got, ref)


def test_bad_inputs_are_value_errors():
    model = tiny_model()
    cache = prefilled(model, 1, "cpu")
    runner = StepRunner(model, cache, [PLAIN, TREE])
    one = torch.zeros(1, 1, dtype=torch.long)
    with pytest.raises(ValueError, match="not on this runner's menu"):
        runner.run(StepShape(2, 2, 0), one, one, 5)
    with pytest.raises(ValueError, match="tokens must be an integer tensor"):
        runner.run(PLAIN, torch.zeros(1, 2, dtype=torch.long), one, 5)
    with pytest.raises(ValueError, match="needs a TreeShape of 5 nodes"):
        runner.run(TREE, torch.zeros(1, 11, dtype=torch.long), torch.zeros(1, 11, dtype=torch.long), 5)
    with pytest.raises(ValueError, match="has no tree"):
        runner.run(PLAIN, one, one, 5, TREES[0])
    with pytest.raises(ValueError, match="within the cache"):
        runner.run(PLAIN, one, one, 64)
    with pytest.raises(ValueError, match="cache_len must be"):
        runner.run(PLAIN, one, one, 2.0)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA model"):
        StepRunner(model, cache, [PLAIN], graphs=True)
    with pytest.raises(ValueError, match="menu must be"):
        StepRunner(model, cache, [])


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 2])
def test_cuda_graph_replay_equals_eager_on_cuda(batch):
    model = tiny_model("cuda")
    cache_eager, cache_graph = prefilled(model, batch, "cuda"), prefilled(model, batch, "cuda")
    eager = StepRunner(model, cache_eager, [PLAIN, TREE])
    graphed = StepRunner(model, cache_graph, [PLAIN, TREE], graphs=True)
    for shape, tokens, positions, lens, tree, rows in steps("cuda", batch, count=8):
        ref = eager.run(shape, tokens, positions, lens, tree, rows).clone()
        got = graphed.run(shape, tokens, positions, lens, tree, rows)
        torch.cuda.synchronize()
        assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5), shape
    assert set(graphed.captured()) == {PLAIN, TREE}
    assert torch.allclose(cache_graph.k, cache_eager.k, rtol=1e-5, atol=1e-5)


def packed_steps(batch, seed=7):
    """(shape, trees, lens, step built argument by argument, the same packed) for plain and tree steps of one and
    two window levels, trees of other sizes per row padded to the shape, and parked rows at position 0."""
    from lookahead.draft import DraftTree, DraftTrees
    from lookahead.step import build_step, packed_plain_step

    gen = torch.Generator().manual_seed(seed)
    out = []
    for shape in (PLAIN, StepShape(1, 1, 5), StepShape(3, 2, 5), StepShape(3, 1, 0)):
        lens = torch.randint(5, 30, (batch,), generator=gen).tolist()
        if batch > 1:
            lens[-1] = 0  # a parked row
        L, V = shape.window * shape.levels, shape.tree_budget
        window_tokens = torch.randint(0, 97, (batch, L), generator=gen)
        if shape == PLAIN:
            xs = window_tokens[:, 0].tolist()
            packed = packed_plain_step(xs, lens)
            plain = (torch.tensor([[x] for x in xs]), torch.tensor([[n] for n in lens]))
            out.append((shape, None, lens, plain, packed))
            continue
        trees = None
        if V:
            rows = []
            for b in range(batch):
                parents = [-1, 0, 1, -1, 3][: V - b % 2]  # row 1 keeps one node fewer: padded
                shape_b = TreeShape.from_parents(parents + [-1] * (V - len(parents)))
                tokens = torch.randint(0, 97, (V,), generator=gen)
                rows.append(DraftTree(tokens, shape_b, len(parents), parents, [[] for _ in parents],
                                      int(shape_b.depth[: len(parents)].max())))
            trees = DraftTrees.stack(rows)
        given = build_step(lens, window_tokens, shape.levels, shape.window, trees, "cpu")
        packed = build_step(lens, window_tokens, shape.levels, shape.window, trees, "cpu", pack=True)
        out.append((shape, trees, lens, given, packed))
    return out


@pytest.mark.parametrize("batch", [1, 3])
def test_a_packed_step_is_the_step_given_argument_by_argument(batch):
    """build_step(pack=True) and packed_plain_step lay a step out as the runner's buffers (input_spans): its views
    equal the step built tensor by tensor, and the runner's buffers hold the same after either, bit for bit."""
    model = tiny_model()
    shapes = [PLAIN, StepShape(1, 1, 5), StepShape(3, 2, 5), StepShape(3, 1, 0)]
    by_args, by_block = (StepRunner(model, model.new_cache(batch, 64), shapes) for _ in range(2))
    for shape, trees, lens, given, packed in packed_steps(batch):
        if shape == PLAIN:
            tokens, positions = given
            by_args.run(shape, tokens, positions, torch.tensor(lens))
            block, block_tokens, block_positions = packed
            by_block.run(shape, block_tokens, block_positions, None, packed=block)
        else:
            for name in ("tokens", "positions", "logits_rows", "logits_tokens", "num_nodes"):
                assert torch.equal(getattr(packed, name), getattr(given, name)), (shape, name)
            assert packed.layout.T == given.layout.T and packed.node_rows == given.node_rows
            assert packed.packed.data_ptr() == packed.tokens.data_ptr()  # views of the block
            by_args.run(shape, given.tokens, given.positions, given.positions[:, 0], given.layout.tree,
                        given.logits_rows, given.num_nodes)
            by_block.run(shape, packed.tokens, packed.positions, None, packed.layout.tree, packed.logits_rows,
                         packed.num_nodes, packed=packed.packed)
        rows = None if shape == PLAIN else len(given.logits_rows)
        a, b = (r._buffers_for(shape, None if rows is None else torch.arange(rows)) for r in (by_args, by_block))
        assert torch.equal(a.device_block, b.device_block), shape
    assert torch.equal(by_args.cache.k, by_block.cache.k)


@pytest.mark.gpu
def test_a_packed_step_reaches_a_cuda_runner_through_its_staging_block():
    """On CUDA the packed block goes through the pinned staging block in one copy: replayed graphs give the same
    logits as the step given argument by argument."""
    model = tiny_model("cuda")
    shapes = [PLAIN, StepShape(1, 1, 5), StepShape(3, 2, 5), StepShape(3, 1, 0)]
    by_args, by_block = (StepRunner(model, prefilled(model, 3, "cuda"), shapes, graphs=True) for _ in range(2))
    for shape, trees, lens, given, packed in packed_steps(3):
        if shape == PLAIN:
            ref = by_args.run(shape, *given, torch.tensor(lens)).clone()
            block, block_tokens, block_positions = packed
            got = by_block.run(shape, block_tokens, block_positions, None, packed=block)
        else:
            ref = by_args.run(shape, given.tokens, given.positions, given.positions[:, 0], given.layout.tree,
                              given.logits_rows, given.num_nodes).clone()
            got = by_block.run(shape, packed.tokens, packed.positions, None, packed.layout.tree, packed.logits_rows,
                               packed.num_nodes, packed=packed.packed)
        assert torch.equal(got, ref), shape
    assert torch.equal(by_block.cache.k, by_args.cache.k)


def test_packed_inputs_that_do_not_fit_are_value_errors():
    from lookahead.step import packed_plain_step

    model = tiny_model()
    runner = StepRunner(model, prefilled(model, 2, "cpu"), [PLAIN])
    one = torch.zeros(2, 1, dtype=torch.long)
    with pytest.raises(ValueError, match="packed must be a contiguous int64 CPU tensor of 8 elements"):
        runner.run(PLAIN, one, one, None, packed=packed_plain_step([1, 2, 3], [4, 5, 6])[0])
    with pytest.raises(ValueError, match="packed must be"):
        runner.run(PLAIN, one, one, None, packed=packed_plain_step([1, 2], [4, 5])[0].int())
    with pytest.raises(ValueError, match="within the cache"):
        runner.run(PLAIN, one, one, None, packed=packed_plain_step([1, 2], [4, 64])[0])
    with pytest.raises(ValueError, match="within the cache"):
        runner.run(PLAIN, one, one, None, packed=packed_plain_step([1, 2], [-1, 3])[0])
    with pytest.raises(ValueError, match="device must be the CPU"):
        from lookahead.step import build_step

        build_step([3], torch.zeros(1, 1, dtype=torch.long), 1, 1, None, "meta", pack=True)


@pytest.mark.gpu
def test_host_inputs_reach_a_cuda_runner_through_its_staging_block():
    """Inputs on the host are staged in pinned memory and copied once: the same logits as device inputs."""
    model = tiny_model("cuda")
    cache_dev, cache_host = prefilled(model, 2, "cuda"), prefilled(model, 2, "cuda")
    on_device = StepRunner(model, cache_dev, [PLAIN, TREE], graphs=True)
    from_host = StepRunner(model, cache_host, [PLAIN, TREE], graphs=True)
    for shape, tokens, positions, lens, tree, rows in steps("cuda", 2, count=8):
        ref = on_device.run(shape, tokens, positions, lens, tree, rows).clone()
        got = from_host.run(shape, tokens.cpu(), positions.cpu(), lens.cpu(), None if tree is None else tree.to("cpu"),
                            None if rows is None else rows.cpu())
        assert torch.equal(got, ref), shape
    assert all(b.staged is not None for b in from_host._buffers.values())
    assert torch.equal(cache_host.k, cache_dev.k)


class Recorder:
    """A ``finish`` that keeps what it was given and returns a marker."""

    key = ("recorder",)
    uniforms_per_row = 0

    def __init__(self):
        self.seen = []

    def __call__(self, logits, inputs):
        self.seen.append((logits.clone(), inputs))
        return torch.full((1,), len(self.seen))


def test_finish_sees_the_logits_and_the_step_s_static_inputs():
    model = tiny_model()
    cache_ref, cache_run = prefilled(model, 2, "cpu"), prefilled(model, 2, "cpu")
    runner = StepRunner(model, cache_run, [TREE])
    shape, tokens, positions, lens, tree, _ = steps("cpu", 2)[1]
    finish = Recorder()
    got = runner.run(shape, tokens, positions, lens, tree, None, torch.tensor([5, 2]), finish)
    assert got.tolist() == [1]
    logits, inputs = finish.seen[0]
    with torch.inference_mode():
        assert torch.equal(logits, model(tokens, positions, cache_ref, lens, StepLayout(3, 2, tree)))
    assert torch.equal(inputs.tokens, tokens) and torch.equal(inputs.end, tree.end.expand(2, 5))
    assert inputs.num_nodes.tolist() == [5, 2] and torch.equal(inputs.cache_len, lens)
    assert inputs.cache is cache_run
    runner.run(shape, tokens, positions, lens, tree, None, None, finish)
    assert finish.seen[1][1].num_nodes.tolist() == [5, 5]  # no count given: the whole tree
    with pytest.raises(ValueError, match="num_nodes must be"):
        runner.run(shape, tokens, positions, lens, tree, None, torch.tensor([1.0, 2.0]), finish)


def verifier_steps(device, batch, seed=5):
    """Tree steps with a window (shape TREE), each row's tree a random prefix of real nodes."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for shape, tokens, positions, lens, tree, _ in steps(device, batch, count=8, seed=seed):
        if shape == TREE:
            out.append((tokens, positions, lens, tree, torch.randint(0, 6, (batch,), generator=gen).to(device)))
    return out


def logits_rows(shape):
    layout = StepLayout(shape.window, shape.levels, TREES[0])
    return torch.tensor([0, *layout.last_level_rows(), *range(layout.lookahead_len, layout.T)])


def sampler(do_sample: bool, device="cpu", seed=0):
    from lookahead.verification import Sampler

    # Sharp sampling (few candidates, low temperature) so that nodes set to the argmax are often accepted.
    return Sampler(do_sample, 0.05, 3, 1.0, torch.Generator(device).manual_seed(seed))


@pytest.mark.parametrize("do_sample", [False, True])
@pytest.mark.parametrize("batch", [1, 3])
def test_a_verifier_run_by_the_runner_equals_one_run_after_the_model(batch, do_sample):
    """Verification, guesses, successor tops and KV compaction through the runner's buffers: the same read-back
    and the same cache as the verifier on the model's own logits (sampling: from the same random numbers, which
    the runner draws into its buffer before the step)."""
    from lookahead.verification import StepInputs, StepVerifier, step_uniforms

    model = tiny_model()
    cache_ref, cache_run = prefilled(model, batch, "cpu"), prefilled(model, batch, "cpu")
    runner = StepRunner(model, cache_run, [TREE])
    verifier = StepVerifier(sampler(do_sample), TREE, 5, 4, 1 + 3 + 5)
    reference = StepVerifier(sampler(do_sample), TREE, 5, 4, 1 + 3 + 5)
    assert verifier.uniforms_per_row == (5 + 1 + 3 if do_sample else 0)
    rows = logits_rows(TREE)
    accepted = 0
    for tokens, positions, lens, tree, num_nodes in verifier_steps("cpu", batch):
        # Make some nodes match: each node's token is what the model predicts at its parent.
        layout = StepLayout(3, 2, tree)
        with torch.inference_mode():
            probe = model(tokens, positions, cache_ref, lens, layout, rows)
        tokens[:, 6:] = probe[:, 4:].argmax(-1).roll(1, dims=1)
        tokens[:, 6] = probe[:, 0].argmax(-1)
        with torch.inference_mode():
            ref_logits = model(tokens, positions, cache_ref, lens, layout, rows)
            u = step_uniforms(reference, batch, "cpu")
            assert (u is None) == (not do_sample)
            want = reference.read(reference(ref_logits, StepInputs(tokens, tree.end, num_nodes, cache_ref, lens, u)))
        got = verifier.read(runner.run(TREE, tokens, positions, lens, tree, rows, num_nodes, verifier))
        assert got.accept_len == want.accept_len and got.nodes == want.nodes and got.emitted == want.emitted
        assert got.guesses == want.guesses
        assert torch.equal(got.tops, want.tops)  # the ids and the probabilities' bits
        assert all(a <= n for a, n in zip(got.accept_len, num_nodes.tolist()))
        accepted += sum(got.accept_len)
    assert accepted > 0  # the steps above exercised compaction
    assert torch.equal(cache_run.k, cache_ref.k) and torch.equal(cache_run.v, cache_ref.v)


def test_a_sampled_verifier_needs_its_uniforms():
    from lookahead.verification import StepInputs, StepVerifier

    model = tiny_model()
    cache = prefilled(model, 2, "cpu")
    tokens, positions, lens, tree, num_nodes = verifier_steps("cpu", 2)[0]
    with torch.inference_mode():
        logits = model(tokens, positions, cache, lens, StepLayout(3, 2, tree), logits_rows(TREE))
        with pytest.raises(ValueError, match=r"needs uniforms \[B=2, 9\]"):
            StepVerifier(sampler(True), TREE, 5)(logits, StepInputs(tokens, tree.end, num_nodes, cache, lens))


@pytest.mark.gpu
@pytest.mark.parametrize("do_sample", [False, True])
def test_a_cuda_graph_holds_the_verifier(do_sample):
    """Forward, verification and compaction replay as one graph, greedy or sampled (sampling's random numbers
    drawn into the runner's buffer before each replay): the read-back and the cache match the eager runner's."""
    from lookahead.verification import StepVerifier

    model = tiny_model("cuda")
    cache_eager, cache_graph = prefilled(model, 2, "cuda"), prefilled(model, 2, "cuda")
    eager = StepRunner(model, cache_eager, [TREE])
    graphed = StepRunner(model, cache_graph, [TREE], graphs=True)
    rows = logits_rows(TREE).cuda()
    verifiers = [StepVerifier(sampler(do_sample, "cuda"), TREE, 5, 4, 9) for _ in range(2)]
    for tokens, positions, lens, tree, num_nodes in verifier_steps("cuda", 2):
        want = verifiers[0].read(eager.run(TREE, tokens, positions, lens, tree, rows, num_nodes, verifiers[0]))
        got = verifiers[1].read(graphed.run(TREE, tokens, positions, lens, tree, rows, num_nodes, verifiers[1]))
        assert got.accept_len == want.accept_len and got.emitted == want.emitted and got.guesses == want.guesses
    key = next(iter(graphed._buffers))
    assert key[2] == verifiers[1].key
    assert graphed.captured() == [TREE]
    assert torch.allclose(cache_graph.k, cache_eager.k, rtol=1e-5, atol=1e-5)
