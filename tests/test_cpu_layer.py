"""The fused CPU decoder layer (``lookahead_kernels.cpu_layer``, ``csrc/cpu_layer.cpp``) against its reference, the
model's own layer in plain torch, run in float64.

Each case runs a whole model (two layers) on one step after a committed prefix: the prefix's keys and values are
random, every cache row the step does not own is NaN past the prefix (a read of one shows up as NaN), and the rows
the step owns start NaN too, so a row the op fails to write fails the comparison of the caches. Shapes: MHA and
GQA, head sizes 16 to 128, hidden and intermediate sizes that are not multiples of the vector width, biases on
q/k/v, o and the MLP, Qwen3's norms of each q and k head, ragged batches, plain, prefill, window and tree steps.
"""

from __future__ import annotations

import copy

import pytest
import torch

from lookahead.model import LlamaForCausalLM, ModelConfig
from lookahead_kernels import StepLayout
from tests.test_attention import tree_layout


@pytest.fixture(scope="module", autouse=True)
def ops():
    from lookahead_kernels.cpu_ops import cpu_ops_available, cpu_ops_error

    if not cpu_ops_available():
        pytest.skip(f"the CPU ops did not build: {cpu_ops_error()}")


def random_model(hidden, inter, heads, kv_heads, head_dim, bias, seed=0, layers=2, qk_norm=False,
                 nope_layers=()) -> LlamaForCausalLM:
    config = ModelConfig(vocab_size=67, hidden_size=hidden, intermediate_size=inter, num_layers=layers,
                         num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, max_position_embeddings=512,
                         attention_bias=bias, mlp_bias=bias, tie_word_embeddings=not bias, qk_norm=qk_norm,
                         nope_layers=nope_layers)
    model = LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.2 * noise if "norm" in name else 0.3 * noise)
    return model.eval()


def poisoned_cache(model, batch, lens, T, seed=1):
    """Random keys/values below each sequence's ``cache_len``, NaN everywhere else (the step's own rows too)."""
    cache = model.new_cache(batch, max(lens) + T + 3)
    g = torch.Generator().manual_seed(seed)
    for t in (cache.k, cache.v):
        t.fill_(float("nan"))
        for b, n in enumerate(lens):
            t[:, b, :n] = torch.randn(t[:, b, :n].shape, generator=g)
    return cache


def run_step(model, cache, ids, layout, lens):
    positions = torch.tensor(lens)[:, None] + layout.position_offsets()
    with torch.inference_mode():
        return model(ids, positions.expand(ids.shape[0], -1), cache, torch.tensor(lens), layout)


def float64_twin(model, cache):
    ref = copy.deepcopy(model).double()
    ref.set_cpu_linear("torch")
    ref_cache = ref.new_cache(cache.batch_size, cache.max_len)
    ref_cache.k.copy_(cache.k)
    ref_cache.v.copy_(cache.v)
    return ref, ref_cache


def step_rows_of(cache, lens, T):
    return torch.stack([torch.stack([cache.k[:, b, n:n + T], cache.v[:, b, n:n + T]]) for b, n in enumerate(lens)])


CASES = [
    # (hidden, intermediate, heads, kv heads, head dim, bias, layout, cache_len per sequence)
    (576, 1536, 9, 3, 64, False, StepLayout(1, 1), [300]),                    # SmolLM2's shape, a plain step
    (40, 70, 4, 2, 16, True, StepLayout.prefill(7), [0, 13]),                 # prefill of a ragged batch, biases
    (96, 100, 3, 3, 32, False, StepLayout.linear(4, 2, 2, 2), [37]),          # window, levels, candidates; MHA
    (200, 48, 2, 1, 128, True, StepLayout.linear(1, 3, 2, 3), [5, 0, 64]),    # D=128, one empty prefix
    (33, 17, 6, 2, 16, False, "tree", [20, 3]),                               # odd widths, per-sequence trees
    (40, 70, 4, 2, 16, True, StepLayout.prefill(300), [0, 13]),               # 600 rows: the MLP in two chunks
]


@pytest.mark.parametrize("hidden,inter,heads,kv_heads,head_dim,bias,layout,lens", CASES)
def test_matches_the_float64_reference(hidden, inter, heads, kv_heads, head_dim, bias, layout, lens):
    check_against_float64(random_model(hidden, inter, heads, kv_heads, head_dim, bias), layout, lens)


@pytest.mark.parametrize("hidden,inter,heads,kv_heads,head_dim,bias,layout,lens", [
    (64, 96, 4, 2, 16, False, "tree", [20, 3]),                # Qwen3's norms of q and k heads, GQA
    (100, 60, 2, 1, 128, True, StepLayout.prefill(5), [0, 9]),  # D = 128 (Qwen3's), biases on q/k/v and o
])
def test_qk_norms_match_the_float64_reference(hidden, inter, heads, kv_heads, head_dim, bias, layout, lens):
    model = random_model(hidden, inter, heads, kv_heads, head_dim, bias, qk_norm=True)
    assert model.layers[0].attn.q_norm.weight.shape == (head_dim,)
    check_against_float64(model, layout, lens)


@pytest.mark.parametrize("nope_layers", [(1,), (0, 2)])  # SmolLM3: layers without rotary embedding
def test_layers_without_rope_match_the_float64_reference(nope_layers):
    model = random_model(64, 96, 4, 2, 16, False, layers=3, nope_layers=nope_layers)
    assert [layer.attn.rotate for layer in model.layers] == [i not in nope_layers for i in range(3)]
    check_against_float64(model, "tree", [20, 3])


def check_against_float64(model, layout, lens):
    if layout == "tree":
        layout, _ = tree_layout(3, 2, ("bushy", "deep"), 9, batch=len(lens), seed=4)
    B, T = len(lens), layout.T
    cache = poisoned_cache(model, B, lens, T)
    ref, ref_cache = float64_twin(model, cache)
    ids = torch.randint(0, model.config.vocab_size, (B, T), generator=torch.Generator().manual_seed(2))
    out = run_step(model, cache, ids, layout, lens)
    assert all(layer._packed.packed is not None for layer in model.layers)  # the fused op ran
    want = run_step(ref, ref_cache, ids, layout, lens)
    assert torch.isfinite(out).all()
    assert ((out.double() - want).abs().max() / want.abs().max()).item() < 2e-5
    got_rows, want_rows = step_rows_of(cache, lens, T), step_rows_of(ref_cache, lens, T)
    assert torch.isfinite(got_rows).all()  # every row the step owns was written
    assert ((got_rows.double() - want_rows).abs().max() / want_rows.abs().max()).item() < 2e-5
    for b, n in enumerate(lens):  # nothing past the step's rows was touched
        assert torch.isnan(cache.k[:, b, n + T:]).all() and torch.isnan(cache.v[:, b, n + T:]).all()


def test_a_row_does_not_depend_on_the_rows_beside_it():
    """Bit-identical logits for x whether it is fed alone or leads a 16-token step: greedy lookahead output equals
    plain greedy output because of this, not merely closeness."""
    model = random_model(576, 1536, 9, 3, 64, False, layers=3)
    ids = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(3))
    alone = run_step(model, poisoned_cache(model, 1, [50], 16), ids[:, :1], StepLayout(1, 1), [50])
    step = run_step(model, poisoned_cache(model, 1, [50], 16), ids, StepLayout.prefill(16), [50])
    assert torch.equal(alone[0, 0], step[0, 0])


def test_a_long_prompt_s_rows_are_the_rows_a_short_one_gives():
    """Bit-identical rows whatever else a prefill holds: a prompt's first 100 rows as a prefill of those alone
    gives them, and a batch of two prompts (900 rows, more than the MLP takes at once: two chunks) each prompt's
    rows as its prefill alone gives them."""
    model = random_model(48, 80, 4, 2, 16, True)
    ids = torch.randint(0, model.config.vocab_size, (1, 450), generator=torch.Generator().manual_seed(5))
    long = run_step(model, poisoned_cache(model, 1, [0], 450), ids, StepLayout.prefill(450), [0])
    short = run_step(model, poisoned_cache(model, 1, [0], 100), ids[:, :100], StepLayout.prefill(100), [0])
    assert torch.equal(long[0, :100], short[0])
    batch = run_step(model, poisoned_cache(model, 2, [0, 0], 450), ids.expand(2, -1), StepLayout.prefill(450), [0, 0])
    assert torch.equal(batch[0], long[0]) and torch.equal(batch[1], long[0])  # 900 rows: two chunks of 450


def test_a_weight_changed_in_place_or_replaced_is_repacked():
    model = random_model(64, 96, 4, 2, 16, True)
    ids = torch.randint(0, model.config.vocab_size, (1, 3), generator=torch.Generator().manual_seed(5))
    layout = StepLayout.prefill(3)

    def close_to_plain():
        fast = run_step(model, poisoned_cache(model, 1, [4], 3), ids, layout, [4])
        model.set_cpu_linear("torch")
        plain = run_step(model, poisoned_cache(model, 1, [4], 3), ids, layout, [4])
        model.set_cpu_linear("packed")
        return ((fast - plain).abs().max() / plain.abs().max()).item() < 1e-5

    assert close_to_plain()
    with torch.no_grad():
        model.layers[1].mlp.down_proj.weight.mul_(-2.0)  # in place: its version moves
    assert close_to_plain()
    # New weights at random_model's scale (at 1 instead of 0.3, float32 rounding through two layers reached the
    # tolerance for 3% of draws).
    model.layers[0].attn.qkv_proj.weight = torch.nn.Parameter(
        0.3 * torch.randn(model.layers[0].attn.qkv_proj.weight.shape))
    assert close_to_plain()
    model.layers[0].mlp.gate_up_proj.weight.data = 0.3 * torch.randn(model.layers[0].mlp.gate_up_proj.weight.shape)
    assert close_to_plain()
    # Norm weights and biases are not packed: the op reads the current ones each step.
    model.layers[1].mlp_norm.weight = torch.nn.Parameter(torch.rand(64) + 0.5)
    with torch.no_grad():
        model.layers[0].attn.qkv_proj.bias.add_(1.0)
    assert close_to_plain()
    twin = copy.deepcopy(model)  # a copy starts without packed weights (no second copy of them in memory)
    assert all(layer._packed.packed is None for layer in twin.layers)


def test_within_weights_fixed_the_packed_weights_are_looked_up_once():
    """generate's steps run within ``weights_fixed()``: one lookup of the packed weights serves every step (checking
    30 layers' weights each step cost 0.5 ms of a 16 ms SmolLM2 step); outside it, every forward checks them."""
    model = random_model(64, 96, 4, 2, 16, True)
    ids = torch.randint(0, model.config.vocab_size, (1, 3), generator=torch.Generator().manual_seed(6))
    layout = StepLayout.prefill(3)
    lookups = []
    lookup = model._lookup_stack

    def counted(x, attend):
        lookups.append(1)
        return lookup(x, attend)

    model._lookup_stack = counted

    def step():
        return run_step(model, poisoned_cache(model, 1, [4], 3), ids, layout, [4])

    outside = step()
    with model.weights_fixed():
        first, second = step(), step()
        assert len(lookups) == 2 and torch.equal(first, outside) and torch.equal(second, outside)
        with model.weights_fixed():  # nested: its own lookup, and the outer one's is kept for after it
            step()
        assert len(lookups) == 3
        step()
        assert len(lookups) == 3
        model.set_cpu_linear("torch")  # another mode: looked up again
        plain = step()
        assert len(lookups) == 4 and ((plain - outside).abs().max() / outside.abs().max()).item() < 1e-5
        model.set_cpu_linear("packed")
        assert torch.equal(step(), outside) and len(lookups) == 5
    step()
    step()
    assert len(lookups) == 7


def test_the_python_layer_serves_where_the_op_does_not_apply():
    model = random_model(64, 96, 4, 2, 16, False)
    ids = torch.randint(0, model.config.vocab_size, (1, 2))
    model.set_cpu_linear("onednn")
    run_step(model, poisoned_cache(model, 1, [3], 2), ids, StepLayout.prefill(2), [3])
    assert all(layer._packed.packed is None for layer in model.layers)
    model.set_cpu_linear("packed")
    run_step(model, poisoned_cache(model, 1, [3], 2), ids, StepLayout.prefill(2), [3])
    assert all(layer._packed.packed is not None for layer in model.layers)


def _op_args(T=2, cache_len=3, norm=64, layers=2):
    model = random_model(64, 96, 4, 2, 16, False, layers=layers)
    x = torch.randn(1, T, 64)
    cos, sin = model.rotary(torch.arange(T)[None])
    cache = model.new_cache(1, 8)
    with torch.inference_mode():
        packed = [[lin.pack.get(lin.weight)[1] for lin in layer._linears] for layer in model.layers]
    norms = [torch.ones(norm)] + [torch.ones(64)] * (layers - 1)
    none = [None] * layers
    return (x, cos, sin, cache.k, cache.v, torch.tensor([cache_len]), torch.ones(1, T, T, dtype=torch.bool), 0.25,
            1e-6, 4, 2, 96, norms, [p[0] for p in packed], none, [p[1] for p in packed], none,
            [torch.ones(64)] * layers, [p[2] for p in packed], none, [p[3] for p in packed], none, none, none, [])


def test_op_checks_its_arguments():
    op = torch.ops.lookahead_cpu.decoder_stack
    with pytest.raises(ValueError, match="within the cache"):
        op(*_op_args(cache_len=7))
    with pytest.raises(ValueError, match="attn_norm must be a float32 CPU tensor"):
        op(*_op_args(norm=63))
    args = list(_op_args())
    args[12] = args[12][:1]  # one attn_norm for a cache of two layers
    with pytest.raises(ValueError, match="one attn_norm per layer"):
        op(*args)
    args = list(_op_args())
    args[13] = args[13][:1]  # one qkv weight for two layers
    with pytest.raises(ValueError, match="every per-layer list must hold 2"):
        op(*args)
    args = list(_op_args())
    args[22] = [torch.ones(16)] * 2  # q_norm without k_norm
    with pytest.raises(ValueError, match="q_norm and k_norm must both be given or both be None"):
        op(*args)
    args[23] = [torch.ones(15)] * 2  # head_dim is 16
    with pytest.raises(ValueError, match=r"k_norm must be a float32 CPU tensor \[16\]"):
        op(*args)
    args = list(_op_args())
    args[24] = [2]  # a third layer of two
    with pytest.raises(ValueError, match="nope_layers must index the 2 layers"):
        op(*args)


def test_opcheck():
    torch.library.opcheck(torch.ops.lookahead_cpu.decoder_stack, _op_args(), test_utils=("test_schema",
                                                                                         "test_autograd_registration"))


# The fused CPU step: lookahead_cpu::forward_step (embedding, rotary tables, the stack, final norm and projection).
@pytest.mark.parametrize("bias", [False, True])  # tied head (the embedding), an lm_head of its own
def test_the_fused_step_gives_the_split_path_s_logits(bias):
    model = random_model(48, 80, 4, 2, 16, bias)
    lens = [6, 2]
    layout = StepLayout.prefill(4)
    ids = torch.randint(0, model.config.vocab_size, (2, 4))
    positions = torch.tensor(lens)[:, None] + layout.position_offsets()
    split = copy.deepcopy(model)
    split._fused_step = lambda *args: None  # hidden() + logits(): the torch final norm, the head's own call
    for rows in (None, torch.tensor([3, -4, 1])):
        cache = poisoned_cache(model, 2, lens, 4)
        split_cache = copy.deepcopy(cache)
        with torch.inference_mode():
            fused = model(ids, positions, cache, torch.tensor(lens), layout, rows)
            want = split(ids, positions, split_cache, torch.tensor(lens), layout, rows)
        assert fused.shape == want.shape == (2, 4 if rows is None else 3, model.config.vocab_size)
        assert torch.isfinite(fused).all()
        assert (fused - want).abs().max() <= 1e-5 * (1 + want.abs().max())
        assert torch.equal(step_rows_of(cache, lens, 4), step_rows_of(split_cache, lens, 4))  # the same keys


def test_the_fused_step_applies_only_to_the_packed_gemm():
    model = random_model(64, 96, 4, 2, 16, False)
    ids = torch.randint(0, model.config.vocab_size, (1, 2))
    for mode, used in (("packed", True), ("onednn", False), ("torch", False)):
        model.set_cpu_linear(mode)
        got = run_step(model, poisoned_cache(model, 1, [3], 2), ids, StepLayout.prefill(2), [3])
        assert torch.isfinite(got).all()
        with torch.inference_mode():
            assert (model._packed_head() is not None) == used
    with torch.enable_grad():  # gradients: the Python layers, which autograd sees
        model.set_cpu_linear("packed")
        assert model._fused_step(ids, torch.tensor([[3, 4]]), poisoned_cache(model, 1, [3], 2), 3,
                                 StepLayout.prefill(2), None) is None


def test_the_fused_step_checks_ids_positions_and_rows():
    model = random_model(64, 96, 4, 2, 16, False)
    cache = poisoned_cache(model, 1, [3], 2)
    V = model.config.vocab_size
    with torch.inference_mode():
        with pytest.raises(ValueError, match=rf"input_ids must lie in \[0, vocab_size={V}\), got min 0 max {V}"):
            model(torch.tensor([[0, V]]), torch.tensor([[3, 4]]), cache, 3, StepLayout.prefill(2))
        with pytest.raises(ValueError, match=r"positions must lie in \[0, max_position_embeddings=512\)"):
            model(torch.tensor([[0, 1]]), torch.tensor([[-1, 4]]), cache, 3, StepLayout.prefill(2))
        with pytest.raises(ValueError, match="logits_rows must index the step's T=2 tokens"):
            model(torch.tensor([[0, 1]]), torch.tensor([[3, 4]]), cache, 3, StepLayout.prefill(2), torch.tensor([2]))
        ok = model(torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([[3, 4]]), cache, 3, StepLayout.prefill(2))
    assert torch.isfinite(ok).all()


def test_rotary_tables_are_float64_cosines_of_the_float32_angles():
    inv = torch.rand(24, dtype=torch.float64).float() * 0.9 + 1e-4
    positions = torch.randint(0, 40000, (3, 5))
    cos, sin = torch.ops.lookahead_cpu.rotary_tables(positions, inv)
    assert cos.shape == sin.shape == (3, 5, 48) and cos.dtype == torch.float32
    angles = (positions[..., None].float() * inv).double()  # the angle rounded to float32, as the torch path does
    for got, want in ((cos, angles.cos()), (sin, angles.sin())):
        assert torch.equal(got[..., :24], got[..., 24:])
        assert (got[..., :24].double() - want).abs().max() <= 2 ** -24  # within rounding to float32
    with pytest.raises(ValueError, match="positions must be an int64"):
        torch.ops.lookahead_cpu.rotary_tables(positions.float(), inv)


def test_opcheck_of_the_fused_step():
    model = random_model(64, 96, 4, 2, 16, False)
    args = _op_args()
    cache = model.new_cache(1, 8)
    with torch.inference_mode():
        head = model._packed_head()
    step_args = (torch.tensor([[1, 2]]), torch.tensor([[3, 4]]), 512, model.rope_inv_freq_bits.view(torch.float32),
                 model.embed.weight.detach(), cache.k, cache.v) + args[5:] + (torch.ones(64), 1e-6, head, None)
    torch.library.opcheck(torch.ops.lookahead_cpu.forward_step, step_args,
                          test_utils=("test_schema", "test_autograd_registration"))
    torch.library.opcheck(torch.ops.lookahead_cpu.rotary_tables, (torch.tensor([[3, 4]]), torch.ones(8)),
                          test_utils=("test_schema", "test_autograd_registration"))
