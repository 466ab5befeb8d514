"""bench/gpu_gemv.py, the candidate float32 product for 1-16 rows that the GPU run's ``profile`` part times: against
float64 ``F.linear`` in each configuration it is timed in, each row the same bit for bit whatever the other rows,
its refusals, and its build for sm_90 (Triton's interpreter on a CPU, compiled on a GPU)."""

import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F

from tests.sm90_compile import run_compile_script
from tests.test_attention import check
from tests.test_layer_ops import rand

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


@pytest.fixture(scope="module")
def gemv():
    spec = importlib.util.spec_from_file_location("gpu_gemv", os.path.join(BENCH, "gpu_gemv.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# (rows, N, K): one row; a whole tile of rows; N and K off every tile size, K shorter than a K tile
SHAPES = [(1, 40, 33), (16, 37, 130), (5, 9, 576), (3, 100, 7)]


@pytest.mark.parametrize("M,N,K", SHAPES)
@pytest.mark.parametrize("config", ["gemv bn4 bk128", "gemv bn8 bk64", "gemv bn8 bk128 w8", "gemv bn16 bk64 w8"])
def test_rows_gemv_matches_float64(gemv, kernel_device, M, N, K, config):
    x = rand(M, K, dtype=torch.float32, device=kernel_device)
    w = rand(N, K, dtype=torch.float32, device=kernel_device, seed=1, scale=K ** -0.5)
    y = torch.full((M, N), float("nan"), dtype=torch.float32, device=kernel_device)  # poisoned: every element written
    assert gemv.rows_gemv(x, w, y, gemv.CONFIGS[config]) is y
    check(y, F.linear(x.double().cpu(), w.double().cpu()), torch.float32)
    assert torch.equal(gemv.rows_gemv(x, w, config=gemv.CONFIGS[config]), y)  # its own output, the same


def test_each_row_is_computed_alone(gemv, kernel_device):
    """A row's result is the same bits in a call of 16 rows, of 3 and alone."""
    x = rand(16, 200, dtype=torch.float32, device=kernel_device)
    w = rand(24, 200, dtype=torch.float32, device=kernel_device, seed=1, scale=200 ** -0.5)
    whole = gemv.rows_gemv(x, w)
    assert torch.equal(gemv.rows_gemv(x[5:8], w), whole[5:8])
    assert all(torch.equal(gemv.rows_gemv(x[i: i + 1], w), whole[i: i + 1]) for i in (0, 9, 15))


def test_candidate_runs_time_every_configuration_over_every_weight(gemv, kernel_device):
    """What the GPU run's two timings of the candidate call: one run a configuration, each writing every weight's
    product into its own output."""
    weights = [rand(n, k, dtype=torch.float32, device=kernel_device, seed=s, scale=k ** -0.5)
               for s, (n, k) in enumerate([(24, 40), (9, 40), (17, 70)])]
    xs = {k: rand(3, k, dtype=torch.float32, device=kernel_device, seed=10 + k) for k in (40, 70)}
    outs = [torch.full((3, w.shape[0]), float("nan"), device=kernel_device) for w in weights]
    runs = gemv.candidate_runs(xs, weights, outs)
    assert list(runs) == list(gemv.CONFIGS)
    for name, run in runs.items():
        for y in outs:
            y.fill_(float("nan"))
        run()
        for w, y in zip(weights, outs):
            assert torch.equal(y, gemv.rows_gemv(xs[w.shape[1]], w, config=gemv.CONFIGS[name])), name


def test_rows_gemv_refuses_what_it_cannot_do(gemv, kernel_device):
    x = torch.zeros(4, 8, device=kernel_device)
    w = torch.zeros(5, 8, device=kernel_device)
    for bad_x, bad_w in ((torch.zeros(17, 8, device=kernel_device), w), (x.double(), w.double()),
                         (x, torch.zeros(5, 9, device=kernel_device)), (torch.zeros(0, 8, device=kernel_device), w)):
        with pytest.raises(ValueError, match="rows_gemv: x float32"):
            gemv.rows_gemv(bad_x, bad_w)
    with pytest.raises(ValueError, match="contiguous"):
        gemv.rows_gemv(torch.zeros(8, 4, device=kernel_device).t(), w)
    with pytest.raises(ValueError, match="out must be"):
        gemv.rows_gemv(x, w, torch.zeros(4, 6, device=kernel_device))


def test_rows_gemv_compiles_for_h100(kernel_device):
    """Every configuration the GPU run times, built for sm_90 through ptxas, without a GPU."""
    run_compile_script(_SM90_SCRIPT.replace("BENCH", repr(BENCH)), kernel_device)


_SM90_SCRIPT = r'''
import sys
sys.path.insert(0, BENCH)
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import gpu_gemv

fn = gpu_gemv._rows_gemv_kernel
for block_n, block_k, warps, stages in gpu_gemv.CONFIGS.values():
    sig = {name: "i32" for name in fn.arg_names}
    sig.update({p: "*fp32" for p in ("x_ptr", "w_ptr", "y_ptr")})
    consts = dict(BLOCK_M=gpu_gemv.ROWS, BLOCK_N=block_n, BLOCK_K=block_k)
    sig.update({name: "constexpr" for name in consts})
    triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                   options=dict(num_warps=warps, num_stages=stages))
print("sm90 ok")
'''
