"""lookahead_kernels.row_topk: each row's k largest logits and their softmax among themselves, against a stable top-k
in float64 (NaN the largest, the lower index first among equals), over vocabularies of one to three slices, 2-D rows
and slices of a step's 3-D logits, the half types. Triton's interpreter on a CPU, compiled on a GPU."""

import pytest
import torch

from tests.sm90_compile import run_compile_script
from tests.test_draft_native import stable_top


@pytest.fixture(scope="module")
def rt():
    from lookahead_kernels import row_topk

    return row_topk


def _check(ids, probs, x, k):
    want_ids, want_probs = stable_top(x.float().cpu(), min(k, x.shape[-1]))
    assert ids.dtype == torch.int64 and probs.dtype == torch.float32
    assert ids.shape == probs.shape == (*x.shape[:-1], min(k, x.shape[-1]))
    assert torch.equal(ids.cpu(), want_ids)
    finite = ~want_probs.isnan()
    assert torch.equal(probs.cpu().isnan(), ~finite)  # a NaN among a row's top k makes its probabilities NaN
    assert torch.allclose(probs.cpu().double()[finite], want_probs[finite], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("V", [1, 7, 200, 2048, 2049, 5000])
@pytest.mark.parametrize("k", [1, 3, 8, 16])
@pytest.mark.filterwarnings("ignore:invalid value encountered")  # the interpreter's NumPy on the NaN row
def test_row_top_k_equals_a_stable_top_k(rt, kernel_device, V, k):
    gen = torch.Generator().manual_seed(V * 131 + k)
    for view in ("2d", "3d-slice"):
        full = torch.randn(3, 5, V, generator=gen) * 4
        full[0, 1] = full[0, 1].round()  # exact ties, the lower index first
        full[1, 2, V // 2] = float("nan")
        full[2, 3, -1] = float("inf")
        full = full.to(kernel_device)
        x = full[1] if view == "2d" else full[:, 1:4]  # rows of a larger step's logits, as the verifier passes
        ids, probs = rt.row_top_k(x, k)
        _check(ids, probs, x, k)


def test_many_candidates_and_negative_rows(rt, kernel_device):
    """k = 70 (128 candidates a slice) over three slices; rows of negative logits, -inf and -0.0 among them."""
    x = -torch.rand(4, 4200, generator=torch.Generator().manual_seed(5)) * 10
    x[1, :100] = -0.0
    x[1, 50] = 0.0
    x[2, 7] = float("-inf")
    x = x.to(kernel_device)
    ids, probs = rt.row_top_k(x, 70)
    _check(ids, probs, x, 70)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_types_select_as_their_float32_values(rt, kernel_device, dtype):
    x = (torch.randn(6, 3000, generator=torch.Generator().manual_seed(7)) * 3).to(dtype).to(kernel_device)
    ids, probs = rt.row_top_k(x, 8)
    _check(ids, probs, x, 8)


def test_matches_the_successor_table_reference_where_no_entries_tie(rt, kernel_device):
    from lookahead.successors import SuccessorTable

    x = torch.randn(2, 6, 4000, generator=torch.Generator().manual_seed(3)).to(kernel_device)
    ids, probs = rt.row_top_k(x[:, :5], 8)
    ref_ids, ref_probs = SuccessorTable.top_reference(x[:, :5], 8)
    assert torch.equal(ids, ref_ids) and torch.allclose(probs, ref_probs, rtol=1e-6, atol=0)


def test_registered_as_a_custom_op(rt, kernel_device):
    x = torch.randn(3, 100, device=kernel_device)
    ids, probs = torch.ops.lookahead.row_top_k(x, 4)
    want = rt.row_top_k(x, 4)
    assert torch.equal(ids, want[0]) and torch.equal(probs, want[1])


def test_bad_inputs_are_value_errors(rt, kernel_device):
    assert rt.unreadable(torch.zeros(2, 3, 5, device=kernel_device)[:, 1:]) is None  # what SuccessorTable.top asks
    assert "float32" in rt.unreadable(torch.zeros(2, 5, dtype=torch.float64, device=kernel_device))
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        rt.row_top_k(torch.zeros(2, 5, dtype=torch.float64, device=kernel_device), 3)
    with pytest.raises(ValueError, match="last dimension contiguous"):
        rt.row_top_k(torch.zeros(5, 2, device=kernel_device).t(), 3)
    with pytest.raises(ValueError, match="V >= 1"):
        rt.row_top_k(torch.zeros(2, 0, device=kernel_device), 3)
    with pytest.raises(ValueError, match=r"\[R, V\] or \[B, R, V\]"):
        rt.row_top_k(torch.zeros(5, device=kernel_device), 3)
    for k in (0, True, 2.0):
        with pytest.raises(ValueError, match="k must be an int >= 1"):
            rt.row_top_k(torch.zeros(2, 5, device=kernel_device), k)


def test_kernels_compile_for_h100(kernel_device):
    """Both kernels built for sm_90 through ptxas (k = 8 over float32 and bfloat16 logits), without a GPU."""
    run_compile_script(_SM90_SCRIPT, kernel_device)


_SM90_SCRIPT = r'''
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from lookahead_kernels import row_topk as rt

h100 = GPUTarget("cuda", 90, 32)
for dtype in ("fp32", "bf16"):
    fn = rt._slice_top_kernel
    sig = {name: "i32" for name in fn.arg_names}
    sig.update(logits_ptr=f"*{dtype}", vals_ptr="*fp32", idx_ptr="*i32")
    consts = dict(K=8, KP=8, SLICE=rt.SLICE)
    sig.update({name: "constexpr" for name in consts})
    triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=h100, options=dict(num_warps=4))
fn = rt._merge_top_kernel
sig = {name: "i32" for name in fn.arg_names}
sig.update(vals_ptr="*fp32", idx_ptr="*i32", ids_ptr="*i64", probs_ptr="*fp32")
consts = dict(K=8, KP=8, CAND=256)
sig.update({name: "constexpr" for name in consts})
triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=h100, options=dict(num_warps=4))
print("sm90 ok")
'''
