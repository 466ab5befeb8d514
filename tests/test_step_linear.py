"""lookahead_kernels.step_linear: ``x @ weight.T (+ bias)`` against float64 ``F.linear``, each row the same bit for bit
whatever the other rows of the call; which steps the model's linear layers give it on CUDA. Triton's interpreter on a
CPU, compiled on a GPU.
"""

import pytest
import torch
import torch.nn.functional as F

from tests.sm90_compile import run_compile_script
from tests.test_attention import check
from tests.test_layer_ops import rand


@pytest.fixture(scope="module")
def sl():
    from lookahead_kernels import step_linear

    return step_linear


SHAPES = [
    # (rows, N, K): one row; a tile and one more; N and K off every tile size; more rows than columns
    (1, 40, 33),
    (17, 100, 70),
    (3, 96, 576),
    (40, 17, 130),
]


@pytest.mark.parametrize("M,N,K", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_step_linear_matches_float64(sl, kernel_device, M, N, K, bias):
    dtype = torch.float32
    x = rand(M, K, dtype=dtype, device=kernel_device)
    w = rand(N, K, dtype=dtype, device=kernel_device, seed=1, scale=K ** -0.5)
    b = rand(N, dtype=dtype, device=kernel_device, seed=2) if bias else None
    want = F.linear(x.double().cpu(), w.double().cpu(), None if b is None else b.double().cpu())
    y = torch.full((M, N), float("nan"), dtype=dtype, device=kernel_device)  # poisoned: every element written
    sl._launch(x, w, b, y)
    check(y, want, dtype)
    got = sl.step_linear(x, w, b)
    assert got.dtype == dtype and got.shape == (M, N)
    assert torch.equal(got, y)


@pytest.mark.parametrize("M,N,K", [(1, 40, 200), (17, 100, 130), (33, 24, 576)])
@pytest.mark.parametrize("split", [2, 3, 9])
def test_split_k_matches_float64_and_leaves_the_counters_at_zero(sl, kernel_device, M, N, K, split):
    """K cut into runs (the last one short where K is off the tile), each output tile summed by the last of its
    splits to arrive; the counters, given or made, are all 0 again after the call and serve the next."""
    dtype = torch.float32
    x = rand(M, K, dtype=dtype, device=kernel_device)
    w = rand(N, K, dtype=dtype, device=kernel_device, seed=1, scale=K ** -0.5)
    b = rand(N, dtype=dtype, device=kernel_device, seed=2)
    want = F.linear(x.double().cpu(), w.double().cpu(), b.double().cpu())
    config = sl.tile_config(N, K)[:4] + (split,)
    counters = torch.zeros(sl.counters_needed(M, N, config) + 3, dtype=torch.int32, device=kernel_device)
    for given in (counters, None, counters):
        y = torch.full((M, N), float("nan"), dtype=dtype, device=kernel_device)
        sl._launch(x, w, b, y, given, config)
        check(y, want, dtype)
        assert not counters.any()
    first = y.clone()
    sl._launch(x[:1], w, b, y[:1], counters, config)  # fewer rows, the same counters: row 0's bits again
    assert torch.equal(y, first) and not counters.any()


@pytest.mark.parametrize("block_m", [32, 64])
@pytest.mark.parametrize("split", [1, 3])
def test_taller_row_tiles_match_float64(sl, kernel_device, block_m, split):
    """A config's optional sixth element, the rows a tile (rows_config takes 64 from 33 rows): rows
    past the last full tile masked, the counters counted per tile of that height and left at zero."""
    dtype = torch.float32
    M, N, K = block_m + 7, 48, 200
    x = rand(M, K, dtype=dtype, device=kernel_device)
    w = rand(N, K, dtype=dtype, device=kernel_device, seed=1, scale=K ** -0.5)
    b = rand(N, dtype=dtype, device=kernel_device, seed=2)
    want = F.linear(x.double().cpu(), w.double().cpu(), b.double().cpu())
    config = (16, 64, 4, 3, split, block_m)
    needed = sl.counters_needed(M, N, config)
    assert needed == (2 * 3 if split > 1 else 0)  # two row tiles of block_m, three column tiles of 16
    counters = torch.zeros(max(needed, 1), dtype=torch.int32, device=kernel_device)
    y = torch.full((M, N), float("nan"), dtype=dtype, device=kernel_device)
    sl._launch(x, w, b, y, counters, config)
    check(y, want, dtype)
    assert not counters.any()


def test_counters_are_checked(sl, kernel_device):
    x = rand(5, 576, dtype=torch.float32, device=kernel_device)
    w = rand(96, 576, dtype=torch.float32, device=kernel_device, seed=1)
    needed = sl.counters_needed(5, 96, sl.tile_config(96, 576))
    assert needed == 3  # one row tile, three column tiles: K is split
    ok = torch.zeros(needed, dtype=torch.int32, device=kernel_device)
    assert torch.equal(sl.step_linear(x, w, counters=ok), sl.step_linear(x, w))
    for bad in (torch.zeros(needed - 1, dtype=torch.int32, device=kernel_device),
                torch.zeros(needed, dtype=torch.int64, device=kernel_device),
                torch.zeros(2 * needed, dtype=torch.int32, device=kernel_device)[::2], [0] * needed):
        with pytest.raises(ValueError, match="counters must be None or a contiguous int32 tensor of at least 3"):
            sl.step_linear(x, w, counters=bad)


def test_leading_dims_and_strided_rows(sl, kernel_device):
    """``[B, T, K]`` inputs, and rows taken from a wider tensor (a row stride larger than K)."""
    wide = rand(2, 5, 80, dtype=torch.float32, device=kernel_device)
    x = wide[..., :48]
    w = rand(24, 48, dtype=torch.float32, device=kernel_device, seed=1)
    y = sl.step_linear(x, w)
    assert y.shape == (2, 5, 24)
    check(y, F.linear(x.double().cpu(), w.double().cpu()), torch.float32)
    assert torch.equal(y, sl.step_linear(x.contiguous(), w))


def test_a_row_s_result_does_not_depend_on_the_other_rows(sl, kernel_device):
    """A plain step's one row and the same row inside a step of 1 to 32 rows give the same bits, and so do steps of
    33 to 80 rows among themselves (taller tiles; cuBLAS does not promise it: it changes kernels with the row
    count)."""
    N, K, dtype = 72, 200, torch.float32
    x = rand(80, K, dtype=dtype, device=kernel_device)
    w = rand(N, K, dtype=dtype, device=kernel_device, seed=1, scale=K ** -0.5)
    b = rand(N, dtype=dtype, device=kernel_device, seed=2)
    short, tall = sl.step_linear(x[:32], w, b), sl.step_linear(x, w, b)
    for rows in (slice(0, 1), slice(7, 8), slice(31, 32), slice(0, 16), slice(3, 20), slice(16, 32)):
        assert torch.equal(sl.step_linear(x[rows], w, b), short[rows]), rows
    for rows in (slice(0, 33), slice(40, 80), slice(5, 70)):
        assert torch.equal(sl.step_linear(x[rows], w, b), tall[rows]), rows
    want = F.linear(x.double().cpu(), w.double().cpu(), b.double().cpu())
    check(short, want[:32], dtype)
    check(tall, want, dtype)


def test_steps_of_more_rows_take_taller_tiles(sl):
    """rows_config: tile_config's 16-row tiles below 33 rows, 64-row tiles from 33 (K split for about 64 programs
    a row tile); a layer's counters cover both up to its largest step."""
    assert sl.rows_config(1, 576, 576) == sl.rows_config(32, 576, 576) == sl.tile_config(576, 576)
    assert sl.rows_config(33, 576, 576) == sl.rows_config(256, 576, 576) == (32, 32, 4, 3, 4, 64)
    assert sl.rows_config(64, 49152, 576)[4] == 1  # 1536 column tiles: K in one run
    assert sl.counters_for_rows(256, 576, 576) == max(2 * 18, 4 * 18)
    assert sl.counters_for_rows(16, 576, 576) == 18 and sl.counters_for_rows(33, 576, 576) == 2 * 18
    assert sl.counters_for_rows(256, 49152, 576) == 0


def test_tile_sizes_come_from_the_weight_alone(sl):
    """The configuration, and so the order of every sum, is a function of (N, K): never of the rows."""
    for N, K in ((576, 576), (960, 576), (3072, 576), (576, 1536), (49152, 576), (12288, 4096), (40, 33)):
        bn, bk, warps, stages, split = sl.tile_config(N, K)
        assert bn in (16, 32, 64) and bk in (16, 32, 64) and warps >= 1 and stages >= 1
        k_tiles = -(-K // bk)
        assert 1 <= split <= k_tiles and -(-k_tiles // -(-k_tiles // split)) == split  # no split left empty
        assert split == 1 or -(-N // bn) * split <= 2 * sl.TARGET_PROGRAMS
    assert sl.tile_config(576, 576) == (32, 64, 4, 3, 9)  # the H200 sweep's best tiles for SmolLM2; 18 x 9 programs
    assert [sl.tile_config(N, K)[4] for N, K in ((960, 576), (3072, 576), (576, 1536), (49152, 576))] == \
        [9, 3, 12, 1]
    assert sl.tile_config(40, 10)[1] == 16  # a narrow K: a narrow K tile
    # Other tiles (benchmarks compare them) split by the same rule: 60 column tiles want 5 runs of 9 K tiles (5 runs
    # of 2); 30 column tiles aiming at 128 programs want 5 runs of 5 K tiles of 128.
    assert sl.tile_config(960, 576, block_n=16, warps=2) == (16, 64, 2, 3, 5)
    assert sl.tile_config(960, 576, 128, block_n=32, block_k=128) == (32, 128, 4, 3, 5)
    assert sl.tile_config(40, 10, block_k=128)[1] == 16


def test_empty_and_degenerate_shapes(sl, kernel_device):
    w = rand(8, 16, dtype=torch.float32, device=kernel_device)
    assert sl.step_linear(torch.zeros(0, 16, device=kernel_device), w).shape == (0, 8)
    b = rand(8, dtype=torch.float32, device=kernel_device, seed=3)
    y = sl.step_linear(torch.zeros(3, 0, device=kernel_device), torch.zeros(8, 0, device=kernel_device), b)
    assert torch.equal(y, b.expand(3, 8))


def test_bad_inputs_are_value_errors(sl, kernel_device):
    x = rand(2, 8, dtype=torch.float32, device=kernel_device)
    w = rand(4, 8, dtype=torch.float32, device=kernel_device)
    for dtype in (torch.float64, torch.float16, torch.bfloat16):  # float32 only: the half types lost to cuBLAS
        with pytest.raises(ValueError, match="x must be float32"):
            sl.step_linear(x.to(dtype), w.to(dtype))
    with pytest.raises(ValueError, match="agree on K"):
        sl.step_linear(x, w[:, :7])
    with pytest.raises(ValueError, match="weight must be torch.float32"):
        sl.step_linear(x, w.half())
    with pytest.raises(ValueError, match="each row of weight must be contiguous"):
        sl.step_linear(x, rand(8, 4, dtype=torch.float32, device=kernel_device).t())
    with pytest.raises(ValueError, match="bias must be None or a contiguous"):
        sl.step_linear(x, w, rand(5, dtype=torch.float32, device=kernel_device))
    with pytest.raises(ValueError, match="x must be a tensor"):
        sl.step_linear([[1.0] * 8], w)


def test_registered_as_a_custom_op(sl, kernel_device):
    x = rand(3, 32, dtype=torch.float32, device=kernel_device)
    w = rand(16, 32, dtype=torch.float32, device=kernel_device, seed=1)
    b = rand(16, dtype=torch.float32, device=kernel_device, seed=2)
    utils = ("test_schema", "test_faketensor")
    counters = torch.zeros(8, dtype=torch.int32, device=kernel_device)
    torch.library.opcheck(torch.ops.lookahead.step_linear, (x, w, b, None), test_utils=utils)
    torch.library.opcheck(torch.ops.lookahead.step_linear, (x, w, None, counters), test_utils=utils)


def test_the_model_takes_the_kernel_for_float32_cuda_steps_of_2_to_256_rows():
    """Which products take the kernel (cuBLAS beat it at one row on the H200; past 256 rows unmeasured; half types
    not measured for it), and that the CPU path is left as it was."""
    from types import SimpleNamespace

    from lookahead.cpu_linear import GPU_KERNEL_ROWS, step_kernel_applies

    def tensor(rows, dtype=torch.float32, cuda=True, grad=False, row_stride=1):
        return SimpleNamespace(is_cuda=cuda, dtype=dtype, shape=torch.Size([*rows, 576]), requires_grad=grad,
                               dim=lambda: len(rows) + 1, stride=lambda d: row_stride,
                               is_contiguous=lambda: row_stride == 1)

    w = tensor([960])
    assert [step_kernel_applies(tensor([m]), w) for m in (1, 2, 16, 64, 65, 256, 257, 1024)] == \
        [False, True, True, True, True, True, False, False]
    assert step_kernel_applies(tensor([1, 16]), w) and step_kernel_applies(tensor([4, 16]), w)  # rows: B x T
    assert not step_kernel_applies(tensor([16], cuda=False), w)
    assert not step_kernel_applies(tensor([16], torch.bfloat16), tensor([960], torch.bfloat16))
    assert not step_kernel_applies(tensor([16]), tensor([960], row_stride=960))  # a transposed weight: cuBLAS
    assert step_kernel_applies(tensor([16]), w, tensor([]))  # a bias: [960]
    assert not step_kernel_applies(tensor([16]), w, tensor([], row_stride=2))
    assert not step_kernel_applies(tensor([16]), w, tensor([], torch.float16))
    with torch.enable_grad():
        assert not step_kernel_applies(tensor([16], grad=True), w)
    assert list(GPU_KERNEL_ROWS) == list(range(2, 257))


def test_each_layer_keeps_its_counters_for_the_kernel():
    """The model's layers hand the kernel counters they keep (a graph replays them without a fill): enough for the
    kernel's largest step, zeros, the same tensor call after call; none where the weight's K is not split."""
    from lookahead.cpu_linear import GPU_KERNEL_ROWS, PackedWeight
    from lookahead_kernels.step_linear import counters_for_rows

    pack = PackedWeight()
    w = torch.zeros(576, 1536)
    counters = pack.step_counters(w)
    assert counters.dtype == torch.int32 and not counters.any()
    assert counters.numel() == counters_for_rows(GPU_KERNEL_ROWS[-1], 576, 1536) == 4 * 18  # 256 rows, 64 a tile
    assert pack.step_counters(w) is counters
    assert pack.step_counters(torch.zeros(49152, 576)) is None  # the vocabulary projection: K in one run
    pack.clear()
    assert pack.step_counters(w) is not counters


@pytest.mark.gpu
def test_split_k_gives_the_same_bits_launch_after_launch_on_the_gpu():
    """The splits of a tile finish in whatever order the GPU runs them; the last one adds them in split order, so
    500 launches of SmolLM2's split products (eager and replayed from a graph) give the same bits, and leave their
    counters at zero. A race (a sum read before it was written) would show as a differing launch."""
    from lookahead_kernels import step_linear as sl

    for N, K in ((960, 576), (576, 1536)):
        x = rand(16, K, dtype=torch.float32, device="cuda")
        w = rand(N, K, dtype=torch.float32, device="cuda", seed=1, scale=K ** -0.5)
        assert sl.tile_config(N, K)[4] > 1
        counters = torch.zeros(sl.counters_needed(16, N, sl.tile_config(N, K)), dtype=torch.int32, device="cuda")
        first = sl.step_linear(x, w, counters=counters)
        check(first, F.linear(x.double().cpu(), w.double().cpu()), torch.float32)
        outs = [sl.step_linear(x, w, counters=counters) for _ in range(250)]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = sl.step_linear(x, w, counters=counters)
        for _ in range(250):
            graph.replay()
            outs.append(y.clone())
        torch.cuda.synchronize()
        assert all(torch.equal(o, first) for o in outs) and not counters.any()


@pytest.mark.gpu
def test_on_the_gpu_steps_of_a_few_rows_take_the_kernel_and_decode_as_plain():
    """float32 through the whole loop (graphs, plain and lookahead steps): the lookahead steps' products take the
    kernel, the plain steps' cuBLAS, and greedy lookahead gives plain decoding's tokens."""
    from unittest import mock

    import lookahead_kernels.step_linear as module
    from lookahead import LookaheadConfig
    from tests.test_batch import mixed_prompts
    from tests.test_static_steps import cuda_tiny

    model = cuda_tiny()
    prompts = [p.cuda() for p in mixed_prompts()]
    calls = []
    real = module.step_linear

    def counted(x, weight, bias=None, counters=None):
        calls.append(x.shape[:-1].numel())
        return real(x, weight, bias, counters)

    with mock.patch.object(module, "step_linear", counted):
        for la in (LookaheadConfig(window=4, ngram=3, guess=4),
                   LookaheadConfig(step_costs=[(1, 1e-3), (64, 1.01e-3), (256, 1.05e-3)])):
            for ids in [p[None] for p in prompts] + [prompts]:
                want = model.generate(ids, max_new_tokens=32, lookahead=None).sequences
                assert torch.equal(model.generate(ids, max_new_tokens=32, lookahead=la).sequences, want), la
    assert calls and all(2 <= m <= 256 for m in calls)


def test_kernel_compiles_for_h100(kernel_device):
    """The kernel built for sm_90 through ptxas (tf32x3 dots, the model's tiles at 16 rows and the taller ones; with
    and without a bias), without a GPU."""
    run_compile_script(_SM90_SCRIPT, kernel_device)


_SM90_SCRIPT = r'''
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from lookahead_kernels import step_linear as sl

h100 = GPUTarget("cuda", 90, 32)
fn = sl._linear_kernel
for N, K, M in ((576, 576, 16), (49152, 576, 16), (576, 576, 64), (576, 1536, 256)):  # split 9 ways, not; 64 rows
    config = sl.rows_config(M, N, K)
    bn, bk, warps, stages, split = config[:5]
    for bias in (False, True):
        sig = {name: "i32" for name in fn.arg_names}
        sig.update({p: "*fp32" for p in ("x_ptr", "w_ptr", "b_ptr", "y_ptr", "part_ptr")})
        sig["count_ptr"] = "*i32"
        consts = dict(HAS_BIAS=bias, BLOCK_M=sl._rows_a_tile(config), BLOCK_N=bn, BLOCK_K=bk, SPLIT=split,
                      FP32_DOT=sl._FP32_DOT)
        sig.update({name: "constexpr" for name in consts})
        triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=h100,
                       options=dict(num_warps=warps, num_stages=stages))
print("sm90 ok")
'''
