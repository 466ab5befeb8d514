"""The C++ step attention (``lookahead_kernels.cpu_attention``) against the float64 dense-mask oracle.

Caches are NaN past each sequence's ``cache_len + T`` (a row read that must not be fails the finiteness check).
Layouts: plain decode steps, prefill blocks, window + linear candidates, random trees shared by the batch or one
per sequence, empty prefixes (rows that see nothing but themselves, or nothing at all), ragged batches, every
supported head size, MHA and GQA.
"""

import pytest
import torch

from lookahead_kernels.attention_ref import attention_dense_reference, attention_torch, step_block, step_block_by_rule
from lookahead_kernels.layout import StepLayout
from tests.cpu_isa import forced_isa
from tests.test_attention import check, make_inputs, tree_layout

cpu_attention = pytest.importorskip("lookahead_kernels.cpu_attention")


@pytest.fixture(scope="module", autouse=True)
def ops():
    from lookahead_kernels.cpu_ops import cpu_ops_available, cpu_ops_error

    if not cpu_ops_available():
        pytest.skip(f"the CPU ops did not build: {cpu_ops_error()}")


@pytest.fixture(params=["avx512", "avx2", "scalar"])
def isa(request):
    """The op's build for each instruction set (16-lane vectors, 8-lane, and the plain build)."""
    with forced_isa(request.param):
        yield request.param


CASES = [
    # (layout, cache_len, Hkv, G, D)
    (StepLayout(1, 1), 300, 3, 3, 64),                       # a plain decode step, SmolLM2's heads
    (StepLayout(1, 1), [7, 0, 130], 2, 2, 16),               # plain step of a ragged batch, one empty prefix
    (StepLayout.prefill(37), 0, 1, 4, 32),                   # a prefill: rows see themselves and earlier ones
    (StepLayout.prefill(16), 5, 2, 1, 128),                  # MHA, D=128
    (StepLayout.linear(4, 2, 2, 2), 37, 1, 2, 64),           # window, levels, linear candidates
    (StepLayout.linear(5, 3, 3, 3), [100, 2], 1, 5, 256),    # G=5 (rows spill over vector tasks), D=256
    (StepLayout.linear(1, 3, 2, 3), 0, 2, 1, 64),            # window 1, empty prefix
]


@pytest.mark.parametrize("layout,cache_len,hkv,group,d", CASES)
def test_matches_oracle(layout, cache_len, hkv, group, d, isa):
    q, k, v, lens = make_inputs(layout, cache_len, hkv, group, d, torch.float32, "cpu")
    out = cpu_attention.attention_cpu(q, k, v, cache_len=lens, layout=layout)
    check(out, attention_dense_reference(q, k, v, cache_len=lens, layout=layout), torch.float32)


@pytest.mark.parametrize("kinds,V,per_seq,cache_len", [
    ("chain", 9, False, 50), ("star", 6, False, [3, 90]), (("deep", "bushy", "padded"), 20, True, [0, 17, 64]),
    (("bushy", "linear"), 33, True, [120, 1]),
])
@pytest.mark.parametrize("window,levels", [(1, 1), (4, 2)])
def test_trees_match_oracle(window, levels, kinds, V, per_seq, cache_len, isa):
    batch = len(cache_len) if isinstance(cache_len, list) else 1
    layout, _ = tree_layout(window, levels, kinds, V, batch=batch if per_seq else None, seed=V)
    q, k, v, lens = make_inputs(layout, cache_len, 3, 3, 64, torch.float32, "cpu", seed=V)
    out = cpu_attention.attention_cpu(q, k, v, cache_len=lens, layout=layout)
    check(out, attention_dense_reference(q, k, v, cache_len=lens, layout=layout), torch.float32)


@pytest.mark.parametrize("kinds,V,per_seq", [
    ("chain", 1, False), ("star", 6, False), (("deep", "bushy", "padded"), 20, True), (("bushy", "linear"), 33, True),
])
@pytest.mark.parametrize("window,levels", [(1, 1), (4, 2), (3, 3)])
def test_the_step_block_follows_the_layout_s_rule(window, levels, kinds, V, per_seq):
    """The visibility built by parts equals the rule evaluated over every pair, plain steps and lookahead branches
    without a tree included."""
    for bare in (StepLayout(1, 1), StepLayout(window, levels), StepLayout.prefill(5)):
        assert torch.equal(step_block(bare, 3, "cpu"), step_block_by_rule(bare, 3, "cpu"))
    layout, _ = tree_layout(window, levels, kinds, V, batch=3 if per_seq else None, seed=V)
    block = step_block(layout, 3, "cpu")
    assert block.shape == ((3,) if per_seq else ()) + (layout.T, layout.T)
    assert torch.equal(block, step_block_by_rule(layout, 3, "cpu"))


def test_strided_queries_and_caches():
    layout = StepLayout.linear(3, 2, 2, 2)
    q, k, v, lens = make_inputs(layout, [4, 60], 2, 2, 32, torch.float32, "cpu", strided=True)
    out = cpu_attention.attention_cpu(q, k, v, cache_len=lens, layout=layout)
    check(out, attention_dense_reference(q, k, v, cache_len=lens, layout=layout), torch.float32)


def test_blind_rows_get_zeros_like_the_reference():
    # No prefix and a layout where some rows see nothing: impossible for real layouts (x is always visible),
    # so build the op's visibility block by hand.
    q = torch.randn(1, 3, 2, 16)
    k = torch.randn(1, 3, 1, 16)
    visible = torch.tensor([[[True, False, False], [False, False, False], [True, True, True]]])
    out = torch.ops.lookahead_cpu.step_attention(q, k, k, torch.zeros(1, dtype=torch.long), visible, 0.25)
    assert torch.isfinite(out).all()
    assert (out[0, 1] == 0).all()
    assert torch.allclose(out[0, 0], k[0, 0, 0].expand(2, 16))


@pytest.mark.parametrize("T, density", [(1, 0.3), (7, 0.3), (40, 0.3), (70, 0.95)])
def test_any_visibility_block_matches_a_float64_softmax(T, density, isa):
    """The op takes any [T, T] visibility (a task skips the step keys after the last one its rows see): random
    blocks where early rows see late keys, rows that see only some keys, and rows that see nothing past the prefix,
    against a softmax over each row's visible keys in float64. The dense block has runs of 8 visible keys (read 8
    at a time) broken by single hidden ones."""
    torch.manual_seed(T)
    n, Hkv, G, D = 9, 2, 3, 32
    q = torch.randn(1, T, Hkv * G, D)
    k, v = torch.randn(1, n + T, Hkv, D), torch.randn(1, n + T, Hkv, D)
    visible = torch.rand(1, T, T) < density
    visible[0, 0, -1] = True
    visible[0, -1] = False
    out = torch.ops.lookahead_cpu.step_attention(q, k, v, torch.tensor([n]), visible, D ** -0.5)
    ref = torch.empty(1, T, Hkv * G, D, dtype=torch.float64)
    for t in range(T):
        seen = torch.cat([torch.ones(n, dtype=torch.bool), visible[0, t]])
        for h in range(Hkv * G):
            keys, values = k[0, :, h // G].double()[seen], v[0, :, h // G].double()[seen]
            weights = torch.softmax(keys @ q[0, t, h].double() * D ** -0.5, dim=0)
            ref[0, t, h] = weights @ values
    check(out, ref, torch.float32)


@pytest.mark.parametrize("T", [2, 3, 4, 5, 12])
def test_a_row_does_not_depend_on_the_step_or_batch_around_it(T, isa):
    """Bit-identical per-row results whatever else the step feeds: the plain step's x and a lookahead step's x
    see the same keys, so their outputs (and so greedy decisions) are equal, not merely close. A task of few rows
    runs with keys in the vector lanes, a fuller one with rows in them. With 16 lanes T=1 to 4 take the first (3 to
    12 rows of a GQA group of 3), T=5 the second, T=12 both (rows 16, 16, 4); with 8 lanes T=1 the first, T=2 the
    second, T=3 both (8 and 1). 40 + T and 61 + T keys leave partial blocks."""
    torch.manual_seed(T)
    k, v = torch.randn(2, 80, 3, 64), torch.randn(2, 80, 3, 64)
    q = torch.randn(2, T, 9, 64)
    lens = torch.tensor([40, 61])
    big = cpu_attention.attention_cpu(q, k, v, cache_len=lens, layout=StepLayout.prefill(T))
    for b in range(2):
        alone = cpu_attention.attention_cpu(q[b:b + 1, :1], k[b:b + 1], v[b:b + 1], cache_len=lens[b:b + 1],
                                            layout=StepLayout(1, 1))
        assert torch.equal(big[b, :1], alone[0])
    check(big, attention_dense_reference(q, k, v, cache_len=lens, layout=StepLayout.prefill(T)), torch.float32)


@pytest.mark.parametrize("d", [16, 64, 256])
@pytest.mark.parametrize("rows", list(range(1, 13)))
def test_every_count_of_few_rows_matches_the_oracle_and_the_full_path(rows, d, isa):
    """One plain step of ``rows`` query heads over one KV head: every row count the keys-in-lanes path takes
    (up to 12 on AVX-512), its key blocks taken 4, 2 or 1 at a time, over 7 to 150 keys; each row equal, bit for
    bit, to the same query inside a 16-token step (rows in the lanes), and close to the oracle."""
    torch.manual_seed(rows * 1000 + d)
    T, lens = 16, torch.tensor([6, 70, 149])
    k, v = torch.randn(3, 170, 1, d), torch.randn(3, 170, 1, d)
    q = torch.randn(3, T, rows, d)
    big = cpu_attention.attention_cpu(q, k, v, cache_len=lens, layout=StepLayout.prefill(T))
    k1, v1 = k.clone(), v.clone()
    for b, n in enumerate(lens.tolist()):  # rows past a one-token step's keys must not be read
        k1[b, n + 1:], v1[b, n + 1:] = float("nan"), float("nan")
    alone = cpu_attention.attention_cpu(q[:, :1], k1, v1, cache_len=lens, layout=StepLayout(1, 1))
    assert torch.equal(big[:, :1], alone)
    check(alone, attention_dense_reference(q[:, :1], k, v, cache_len=lens, layout=StepLayout(1, 1)), torch.float32)


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("hkv,group,d,T,lens", [
    (3, 3, 64, 1, [1500]),             # SmolLM2's plain step: 3 tasks on 2 threads
    (3, 3, 64, 4, [1024]),             # 12 rows, keys a multiple of the ranges
    (1, 3, 16, 2, [2100]),             # one task; D of one vector with 16 lanes (no halves)
    (1, 3, 256, 1, [1100, 40, 2000]),  # a ragged batch: sequences of three ranges, one, four
    (5, 2, 128, 1, [1800]),
])
def test_a_long_step_split_over_threads_is_the_same_bits(hkv, group, d, T, lens, isa, two_threads):
    """A decode step of fewer tasks than divide the threads evenly over at least 1024 keys runs in phases spread
    over them (scores and weights by ranges of keys, the output by halves of D): the same bits as one thread
    running it whole, and close to the oracle. Past each step the caches are NaN (never read)."""
    layout = StepLayout(1, 1) if T == 1 else StepLayout.prefill(T)
    q, k, v, cache_len = make_inputs(layout, lens, hkv, group, d, torch.float32, "cpu", seed=T * d)
    split = cpu_attention.attention_cpu(q, k, v, cache_len=cache_len, layout=layout)
    torch.set_num_threads(1)
    whole = cpu_attention.attention_cpu(q, k, v, cache_len=cache_len, layout=layout)
    assert torch.equal(split, whole)
    check(split, attention_dense_reference(q, k, v, cache_len=cache_len, layout=layout), torch.float32)


def test_agrees_with_attention_torch_on_the_model_path():
    layout, _ = tree_layout(4, 3, "bushy", 15)
    q, k, v, lens = make_inputs(layout, 200, 3, 3, 64, torch.float32, "cpu")
    out = cpu_attention.CpuStepAttention(layout, lens, 1)(q, k, v)
    check(out, attention_torch(q, k, v, cache_len=lens, layout=layout).double(), torch.float32)


@pytest.mark.parametrize("bad,message", [
    (dict(dtype=torch.float64), "float32"),
    (dict(d=48), "head_dim"),
])
def test_bad_inputs_are_value_errors(bad, message):
    layout = StepLayout(1, 1)
    q, k, v, lens = make_inputs(layout, 4, 1, 1, bad.get("d", 16), bad.get("dtype", torch.float32), "cpu")
    with pytest.raises(ValueError, match=message):
        cpu_attention.attention_cpu(q, k, v, cache_len=lens, layout=layout)


def test_op_checks_its_arguments():
    q, k = torch.randn(1, 2, 2, 16), torch.randn(1, 4, 1, 16)
    visible = torch.ones(1, 2, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="within the cache"):
        torch.ops.lookahead_cpu.step_attention(q, k, k, torch.tensor([3]), visible, 0.25)
    with pytest.raises(ValueError, match="visible must be bool"):
        torch.ops.lookahead_cpu.step_attention(q, k, k, torch.tensor([0]), visible.float(), 0.25)
    with pytest.raises(ValueError, match="cache_len must be int64"):
        torch.ops.lookahead_cpu.step_attention(q, k, k, torch.tensor([0], dtype=torch.int32), visible, 0.25)


def test_opcheck():
    q, k, v, lens = make_inputs(StepLayout.prefill(4), 6, 1, 2, 16, torch.float32, "cpu")
    visible = torch.tril(torch.ones(1, 4, 4, dtype=torch.bool))
    torch.library.opcheck(torch.ops.lookahead_cpu.step_attention, (q, k.nan_to_num(), v.nan_to_num(),
                                                                    torch.tensor([lens]), visible, 0.5),
                          test_utils=("test_schema", "test_autograd_registration"))
