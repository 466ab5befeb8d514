"""The element-wise layer kernels (``lookahead_kernels.layer_ops``) against their torch references
(``layer_ops_ref``) computed in float64; on the CPU under Triton's interpreter, on a GPU compiled.

Outputs start as NaN where the test can reach them (the launch helper's outputs, the caches' rows); shapes include
widths that are not powers of two and rows longer than one block; every dtype the model runs in.
"""

from __future__ import annotations

import pytest
import torch

from lookahead_kernels import layer_ops_ref as ref
from tests.sm90_compile import run_compile_script
from tests.test_attention import TOL, check, rel_err

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(scope="module")
def ops():
    from lookahead_kernels import layer_ops

    return layer_ops


def rand(*shape, dtype, device, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g)).to(dtype=dtype, device=device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 576), (3, 5, 33), (2, 1, 4096), (7, 1000)])
def test_rms_norm(ops, kernel_device, shape, dtype):
    x = rand(*shape, dtype=dtype, device=kernel_device, scale=3.0)
    w = rand(shape[-1], dtype=dtype, device=kernel_device, seed=1)
    y = torch.full_like(x, float("nan"))
    ops._launch_norm(x, None, w, 1e-5, None, y)
    check(y, ref.rms_norm_reference(x.double(), w.double(), 1e-5), dtype)
    check(ops.rms_norm(x, w, 1e-5), ref.rms_norm_reference(x.double(), w.double(), 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 576), (2, 3, 100)])
def test_add_rms_norm(ops, kernel_device, shape, dtype):
    x = rand(*shape, dtype=dtype, device=kernel_device)
    r = rand(*shape, dtype=dtype, device=kernel_device, seed=2)
    w = rand(shape[-1], dtype=dtype, device=kernel_device, seed=3)
    s, y = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
    ops._launch_norm(x, r, w, 1e-6, s, y)
    if dtype == torch.bfloat16 and kernel_device == "cpu":  # the interpreter rounds bfloat16 its own way
        check(s, (x + r).double(), dtype)
    else:
        assert torch.equal(s, x + r)  # the residual add rounds exactly as torch's
    check(y, ref.rms_norm_reference((x + r).double(), w.double(), 1e-6), dtype)
    s2, y2 = ops.add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(s2, s) and torch.equal(y2, y)


def test_rms_norm_rows_do_not_depend_on_each_other(ops, kernel_device):
    x = rand(6, 200, dtype=torch.bfloat16, device=kernel_device)
    w = rand(200, dtype=torch.bfloat16, device=kernel_device, seed=1)
    whole = ops.rms_norm(x, w, 1e-5)
    assert torch.equal(whole[4:5], ops.rms_norm(x[4:5], w, 1e-5))


ROTARY_CASES = [
    # (B, T, Hq, Hkv, D, cache_len)
    (1, 1, 9, 3, 64, [300]),         # SmolLM2's heads, a plain step
    (2, 3, 4, 2, 16, [5, 0]),        # ragged batch, one empty prefix
    (1, 5, 2, 2, 96, [7]),           # MHA, a head size that is not a power of two
    (3, 2, 8, 1, 128, [0, 40, 2]),   # GQA 8, D=128
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,T,Hq,Hkv,D,lens", ROTARY_CASES)
# qk_norm: Qwen3's norm of each q and k head first; rotate False: a SmolLM3 layer without rotary embedding
@pytest.mark.parametrize("qk_norm,rotate", [(False, True), (True, True), (False, False)])
def test_rotary_cache_write(ops, kernel_device, B, T, Hq, Hkv, D, lens, dtype, qk_norm, rotate):
    qkv = rand(B, T, Hq + 2 * Hkv, D, dtype=dtype, device=kernel_device, scale=3.0 if qk_norm else 1.0)
    norms = (rand(D, dtype=dtype, device=kernel_device, seed=5, scale=0.3) + 1,
             rand(D, dtype=dtype, device=kernel_device, seed=6, scale=0.3) + 1, 1e-6) if qk_norm else ()
    angles = rand(B, T, D // 2, dtype=torch.float32, device=kernel_device, seed=4, scale=30.0)
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    S = max(lens) + T + 2
    k_cache = torch.full((B, S, Hkv, D), float("nan"), dtype=dtype, device=kernel_device)
    v_cache = torch.full_like(k_cache, float("nan"))
    # One sequence: the int form (the eager path's); several: per-sequence lengths on the device (the graphs').
    cache_len = lens[0] if B == 1 else torch.tensor(lens, device=kernel_device)
    q = ops.rotary_cache_write(qkv, cos, sin, k_cache, v_cache, cache_len, Hq, Hkv, *norms, rotate=rotate)
    k_want = torch.full((B, S, Hkv, D), float("nan"), dtype=torch.float64)
    v_want = k_want.clone()
    q_want = ref.rotary_cache_write_reference(qkv.double().cpu(), cos.double().cpu(), sin.double().cpu(), k_want,
                                              v_want, torch.tensor(lens), Hq, Hkv,
                                              *[n.double().cpu() for n in norms[:2]], *norms[2:], rotate=rotate)
    if not rotate:  # q and k as they came
        assert torch.equal(q.cpu(), qkv[:, :, :Hq].cpu())
    # The norm adds two roundings of a half type before the rotation's three; Triton's interpreter truncates bfloat16
    # where the GPU rounds to nearest (test_silu_mul), so there the error may reach twice the tolerance.
    slack = 2 if qk_norm and dtype == torch.bfloat16 and kernel_device == "cpu" else 1
    assert torch.isfinite(q).all() and rel_err(q, q_want) < slack * TOL[dtype]
    for b, n in enumerate(lens):
        assert rel_err(k_cache[b, n:n + T], k_want[b, n:n + T]) < slack * TOL[dtype]
        assert torch.equal(v_cache[b, n:n + T].cpu(), qkv[b, :, Hq + Hkv:].cpu())  # v is copied as it is
        for cache in (k_cache, v_cache):  # nothing else was written
            assert torch.isnan(cache[b, :n]).all() and torch.isnan(cache[b, n + T:]).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2 * 1536), (3, 4, 2 * 1100), (2, 2 * 7)])
def test_silu_mul(ops, kernel_device, shape, dtype):
    x = rand(*shape, dtype=dtype, device=kernel_device, scale=4.0)
    out = ops.silu_mul(x)
    assert torch.isfinite(out).all()
    # Two roundings of a half type (silu, then the product) against exact arithmetic; Triton's interpreter
    # truncates to bfloat16 where the GPU rounds to nearest, up to twice the error again.
    slack = 4 if dtype == torch.bfloat16 and kernel_device == "cpu" else 2
    assert rel_err(out, ref.silu_mul_reference(x.double())) < slack * TOL[dtype]


def test_the_model_path_matches_the_references_in_float32(ops, kernel_device):
    """The references are the model's CPU path: the kernels agree with them in the model's float32 too."""
    x = rand(2, 3, 2 * 48, dtype=torch.float32, device=kernel_device)
    assert torch.allclose(ops.silu_mul(x), ref.silu_mul_reference(x), rtol=1e-5, atol=1e-6)
    w = rand(96, dtype=torch.float32, device=kernel_device, seed=1)
    assert torch.allclose(ops.rms_norm(x, w, 1e-5), ref.rms_norm_reference(x, w, 1e-5), rtol=1e-5, atol=1e-5)


def test_bad_inputs_are_value_errors(ops, kernel_device):
    x = rand(2, 8, dtype=torch.float32, device=kernel_device)
    with pytest.raises(ValueError, match="weight must be"):
        ops.rms_norm(x, rand(7, dtype=torch.float32, device=kernel_device), 1e-5)
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        ops.rms_norm(x.double(), rand(8, dtype=torch.float64, device=kernel_device), 1e-5)
    with pytest.raises(ValueError, match="eps"):
        ops.rms_norm(x, rand(8, dtype=torch.float32, device=kernel_device), 0.0)
    with pytest.raises(ValueError, match="residual must match"):
        ops.add_rms_norm(x, x[:1], rand(8, dtype=torch.float32, device=kernel_device), 1e-5)
    with pytest.raises(ValueError, match="even"):
        ops.silu_mul(rand(2, 7, dtype=torch.float32, device=kernel_device))
    qkv = rand(1, 2, 4, 8, dtype=torch.float32, device=kernel_device)
    cache = torch.zeros(1, 5, 1, 8, device=kernel_device)
    lens = torch.tensor([0], device=kernel_device)
    cs = rand(1, 2, 8, dtype=torch.float32, device=kernel_device)
    with pytest.raises(ValueError, match="Hq \\+ 2 Hkv"):
        ops.rotary_cache_write(qkv, cs, cs, cache, cache, lens, 3, 1)
    with pytest.raises(ValueError, match="cache_len must be"):
        ops.rotary_cache_write(qkv, cs, cs, cache, cache, lens.float(), 2, 1)
    with pytest.raises(ValueError, match="k_cache must be"):
        ops.rotary_cache_write(qkv, cs, cs, cache.half(), cache, lens, 2, 1)
    w = rand(8, dtype=torch.float32, device=kernel_device)
    with pytest.raises(ValueError, match="q_norm and k_norm must both be given or both be None"):
        ops.rotary_cache_write(qkv, cs, cs, cache, cache, lens, 2, 1, w)
    with pytest.raises(ValueError, match=r"k_norm must be \[8\] torch.float32"):
        ops.rotary_cache_write(qkv, cs, cs, cache, cache, lens, 2, 1, w, w[:7])
    with pytest.raises(ValueError, match="eps must be > 0"):
        ops.rotary_cache_write(qkv, cs, cs, cache, cache, lens, 2, 1, w, w, 0.0)


def test_opcheck(ops, kernel_device):
    x = rand(2, 3, 16, dtype=torch.float32, device=kernel_device)
    w = rand(16, dtype=torch.float32, device=kernel_device, seed=1)
    utils = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(torch.ops.lookahead.rms_norm, (x, w, 1e-5), test_utils=utils)
    torch.library.opcheck(torch.ops.lookahead.add_rms_norm, (x, x, w, 1e-5), test_utils=utils)
    torch.library.opcheck(torch.ops.lookahead.silu_mul, (x,), test_utils=utils)
    qkv = rand(1, 2, 4, 8, dtype=torch.float32, device=kernel_device)
    cs = rand(1, 2, 8, dtype=torch.float32, device=kernel_device)
    cache = torch.zeros(1, 5, 1, 8, device=kernel_device)
    for norms, rotate in (((None, None), True), ((cs[0, 0], cs[0, 1]), True), ((None, None), False)):
        torch.library.opcheck(torch.ops.lookahead.rotary_cache_write,
                              (qkv, cs, cs, cache, cache.clone(), torch.tensor([1], device=kernel_device), 0, 2, 1,
                               *norms, 1e-6, rotate), test_utils=utils)


_SM90_SCRIPT = r'''
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from lookahead_kernels import layer_ops as lo

h100 = GPUTarget("cuda", 90, 32)


def build(fn, pointers, consts, warps, ones=()):
    sig = {name: "i32" for name in fn.arg_names}
    sig.update(pointers)
    consts = dict(consts, **{name: 1 for name in ones})
    sig.update({name: "constexpr" for name in consts})
    sig["eps"] = "fp32" if "eps" in sig else None
    sig = {k: v for k, v in sig.items() if v is not None}
    triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=h100, options=dict(num_warps=warps))


# Each kernel once in float32 and once in bfloat16 (the rounding path); the norm with and without the residual.
for dt, res in (("fp32", False), ("bf16", True)):
    build(lo._rms_norm_kernel, {p: "*" + dt for p in ("x_ptr", "r_ptr", "w_ptr", "s_ptr", "y_ptr")},
          dict(HAS_RESIDUAL=res, ROUND=dt != "fp32", BLOCK=4096), 8)
    for rotate in (True, False):  # with and without the rotation (SmolLM3's layers without RoPE)
        build(lo._rotary_cache_kernel, dict({p: "*" + dt for p in ("x_ptr", "cos_ptr", "sin_ptr", "q_ptr", "k_ptr",
                                                                   "v_ptr", "qn_ptr", "kn_ptr")}, len_ptr="*i64"),
              dict(HALF=64, BLOCK_D=128, ROUND=dt != "fp32", PER_ROW=dt != "fp32", QK_NORM=res, ROTATE=rotate), 1)
    build(lo._silu_mul_kernel, dict(x_ptr="*" + dt, y_ptr="*" + dt), dict(ROUND=dt != "fp32", BLOCK=1024), 4)
print("sm90 ok")
'''


def test_kernels_compile_for_h100(kernel_device):
    """Each kernel built for sm_90 through ptxas (float32 and the bfloat16 rounding path), without a GPU."""
    run_compile_script(_SM90_SCRIPT, kernel_device)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_the_model_on_the_gpu_takes_the_kernels_and_matches_the_cpu(dtype, tol):
    """The model's CUDA path (these kernels, the attention kernel) against its CPU path on the same weights:
    a prefill, a tree step and a plain step; logits and the KV cache."""
    from lookahead.model import LlamaForCausalLM, ModelConfig
    from lookahead_kernels import StepLayout
    from tests.test_attention import tree_layout

    torch.manual_seed(0)
    config = ModelConfig(vocab_size=300, hidden_size=256, intermediate_size=704, num_layers=3, num_heads=8,
                         num_kv_heads=2, head_dim=32, max_position_embeddings=512)
    cpu = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in cpu.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.05 * torch.randn_like(p))
    gpu = LlamaForCausalLM(config, dtype=dtype, device="cuda").eval()
    gpu.load_state_dict(cpu.state_dict())
    tree_step, _ = tree_layout(3, 2, "bushy", 10)
    ids = torch.randint(0, 300, (1, 40))
    steps = [(StepLayout.prefill(20), 0), (tree_step, 20), (StepLayout(1, 1), 20 + tree_step.T)]
    caches = [m.new_cache(1, 64) for m in (cpu, gpu)]
    with torch.inference_mode():
        for layout, n in steps:
            tok = ids[:, n:n + layout.T] if layout.T + n <= 40 else ids[:, :layout.T]
            pos = n + layout.position_offsets()[None]
            want = cpu(tok, pos, caches[0], n, layout)
            got = gpu(tok.cuda(), pos.cuda(), caches[1], n, layout)
            assert torch.isfinite(got).all()
            assert rel_err(got, want) < tol
    assert rel_err(caches[1].k[:, :, :n + 1], caches[0].k[:, :, :n + 1]) < tol
    assert rel_err(caches[1].v[:, :, :n + 1], caches[0].v[:, :, :n + 1]) < tol
