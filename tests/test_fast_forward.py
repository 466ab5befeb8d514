"""The fast CPU forward: prepacked linear layers (our small-M GEMM on every instruction set it has, and oneDNN)
against a float64 reference, and the whole model's logits on the packed paths against plain ``F.linear``."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from lookahead import cpu_linear
from lookahead.cpu_linear import CpuLinear, PackedWeight
from lookahead.model import LlamaForCausalLM, ModelConfig
from lookahead_kernels import StepLayout, attention_torch
from lookahead_kernels.attention_ref import StepAttention
from tests.cpu_isa import forced_chunked_rows, forced_isa

needs_onednn = pytest.mark.skipif(not cpu_linear.onednn_linear_available(), reason="torch built without oneDNN")


@pytest.fixture(params=["onednn", "avx512", "avx2", "scalar"])
def packed_mode(request):
    """A PackedWeight mode, our GEMM forced to each instruction set (skipped where the CPU lacks it)."""
    if request.param == "onednn":
        if not cpu_linear.onednn_linear_available():
            pytest.skip("torch built without oneDNN")
        yield "onednn"
        return
    if not cpu_linear.gemm_available():
        pytest.skip(f"no CPU GEMM: {cpu_linear.gemm_error()}")
    with forced_isa(request.param):
        yield "packed"


def ref_linear(x, w, b):
    y = x.double() @ w.double().t()
    return y if b is None else y + b.double()


@pytest.mark.parametrize("M", [1, 2, 3, 7, 13, 16, 33, 128])
@pytest.mark.parametrize("N,K,bias", [(37, 19, True), (130, 67, False), (64, 576, True), (96, 300, False)])
def test_packed_linear_matches_float64(M, N, K, bias, packed_mode):
    g = torch.Generator().manual_seed(M * 1000 + N)
    w = torch.randn(N, K, generator=g)
    b = torch.randn(N, generator=g) if bias else None
    # x is a strided view into a NaN-poisoned buffer: anything read outside the view shows up as NaN.
    buf = torch.full((M, K + 5), float("nan"))
    buf[:, 2:K + 2] = torch.randn(M, K, generator=g)
    x = buf[:, 2:K + 2]
    with torch.inference_mode():
        pack = PackedWeight(packed_mode)
        y = cpu_linear.linear(x, w, b, pack)
    assert pack._backend == ("onednn" if packed_mode == "onednn" else "gemm")
    assert y.shape == (M, N) and y.dtype == torch.float32
    assert torch.isfinite(y).all()
    ref = ref_linear(x, w, b)
    assert (y.double() - ref).abs().max() <= 1e-5 * (1 + ref.abs().max())


@needs_onednn
def test_packed_linear_3d_and_weight_updates():
    lin = CpuLinear(24, 10)
    x = torch.randn(2, 5, 24)
    with torch.inference_mode():
        y = lin(x)
        assert y.shape == (2, 5, 10)
        assert torch.allclose(y, torch.nn.functional.linear(x, lin.weight, lin.bias), atol=1e-5)
    with torch.no_grad():  # an in-place update must not leave a stale packed copy behind
        lin.weight.mul_(-2.0)
    with torch.inference_mode():
        assert torch.allclose(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias), atol=1e-5)
    lin.weight = torch.nn.Parameter(torch.randn(10, 24))  # a new tensor
    with torch.inference_mode():
        assert torch.allclose(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias), atol=1e-5)


def test_grad_and_other_dtypes_take_f_linear():
    lin = CpuLinear(8, 4)
    x = torch.randn(3, 8)
    y = lin(x)  # autograd through the weight: the packed op has no backward, so F.linear runs
    y.sum().backward()
    assert lin.weight.grad is not None
    assert not cpu_linear.packed_applies(x.double(), lin.weight.double())
    with torch.inference_mode():
        assert cpu_linear.linear(x.double(), lin.weight.double(), None, PackedWeight()).dtype == torch.float64


def test_bad_mode_and_copies():
    lin = CpuLinear(8, 4)
    with pytest.raises(ValueError, match="mode"):
        lin.set_mode("fast")
    with pytest.raises(ValueError, match="features"):
        with torch.inference_mode():
            cpu_linear.linear(torch.randn(2, 7), lin.weight, None, PackedWeight())
    with torch.inference_mode():
        lin(torch.randn(2, 8))
    for clone in (copy.deepcopy(lin), pickle.loads(pickle.dumps(lin))):
        with torch.inference_mode():
            x = torch.randn(2, 8)
            assert torch.allclose(clone(x), torch.nn.functional.linear(x, lin.weight, lin.bias), atol=1e-5)


TINY = dict(vocab_size=101, hidden_size=48, intermediate_size=72, num_layers=2, num_heads=6, num_kv_heads=2,
            head_dim=8, max_position_embeddings=256)


def _random_model(tied: bool, bias: bool) -> LlamaForCausalLM:
    torch.manual_seed(1)
    model = LlamaForCausalLM(ModelConfig(**TINY, tie_word_embeddings=tied, attention_bias=bias, mlp_bias=bias))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
    return model.eval()


def _run(model, ids, n_prompt):
    """Prefill, then a 5-token causal step, then a single token: every step's logits."""
    cache = model.new_cache(1, 64)
    out = [model(ids[:, :n_prompt], torch.arange(n_prompt)[None], cache, 0, StepLayout.prefill(n_prompt))]
    out.append(model(ids[:, n_prompt:n_prompt + 5], torch.arange(n_prompt, n_prompt + 5)[None], cache, n_prompt,
                     StepLayout.prefill(5)))
    p = n_prompt + 5
    out.append(model(ids[:, p:p + 1], torch.tensor([[p]]), cache, p, StepLayout.prefill(1)))
    return out


@pytest.mark.parametrize("mode", ["packed", "onednn"])
@pytest.mark.parametrize("tied,bias", [(True, False), (False, True)])
def test_model_packed_matches_plain_linear(tied, bias, mode):
    model = _random_model(tied, bias)
    keys = sorted(model.state_dict())
    ids = torch.randint(0, TINY["vocab_size"], (1, 20))
    with torch.inference_mode():
        model.set_cpu_linear(mode)
        fast = _run(model, ids, 14)
        model.set_cpu_linear("torch")
        plain = _run(model, ids, 14)
        model.set_cpu_linear("onednn" if mode == "packed" else "packed")  # the other layout, then back
        _run(model, ids, 14)
        model.set_cpu_linear(mode)
        again = _run(model, ids, 14)
    for f, p, a in zip(fast, plain, again):
        assert torch.isfinite(f).all()
        assert (f - p).abs().max() <= 1e-4 * p.abs().max()
        assert torch.equal(f, a)  # the packed copies are reused or remade identically
    assert sorted(model.state_dict()) == keys  # the packed copies are not state
    with pytest.raises(ValueError, match="mode"):
        model.set_cpu_linear("bf16")


@pytest.mark.parametrize("tied", [True, False])
def test_weights_are_packed_before_generate_starts_its_clock(tied, monkeypatch):
    """``prepare_cpu_weights`` packs every linear layer (the tied head too); ``generate`` calls it before its clock
    starts and its forwards reuse those copies, so a process's first call does not count the packing. The "torch"
    mode packs nothing."""
    model = _random_model(tied, False)
    packs = [m.pack for m in model.modules() if isinstance(m, CpuLinear)]
    packs += [model._tied_head_pack] if tied else []
    model.set_cpu_linear("torch")
    model.prepare_cpu_weights()
    assert all(p._packed is None for p in packs)
    model.set_cpu_linear("packed")
    if cpu_linear._backend("packed") is None:
        pytest.skip("neither our GEMM nor oneDNN is available here")
    calls = []
    real = model.prepare_cpu_weights

    def prepare():
        calls.append([p._packed is None for p in packs])
        real()
        calls.append([id(p._packed) for p in packs])

    monkeypatch.setattr(model, "prepare_cpu_weights", prepare)
    model.generate(torch.randint(0, TINY["vocab_size"], (1, 6)), max_new_tokens=4, lookahead=None)
    assert calls[0] == [True] * len(packs)  # nothing packed before the call
    assert calls[1] == [id(p._packed) for p in packs]  # packed once, before the forwards, and reused by them


def test_gemm_rejects_bad_arguments():
    if not cpu_linear.gemm_available():
        pytest.skip(f"no CPU GEMM: {cpu_linear.gemm_error()}")
    gemm = torch.ops.lookahead_gemm
    packed = gemm.pack(torch.randn(40, 24))
    assert packed.shape == (2, 24, 32)  # 40 columns in groups of 32, zero-padded
    with pytest.raises(ValueError, match="K="):
        gemm.linear(torch.randn(3, 23), packed, 40, None)
    with pytest.raises(ValueError, match="n="):
        gemm.linear(torch.randn(3, 24), packed, 70, None)
    with pytest.raises(ValueError, match="bias"):
        gemm.linear(torch.randn(3, 24), packed, 40, torch.randn(39))
    with pytest.raises(ValueError, match="force_isa"):
        gemm.force_isa("sse")
    with pytest.raises(ValueError, match="force_chunked_rows"):
        gemm.force_chunked_rows(-2)
    own = gemm.chunked_rows()  # 24 on a Zen 5 with AVX-512, else the kernels' own limit (12, 8 or 4)
    assert own in (4, 8, 12, 24)
    with forced_chunked_rows(0):
        assert gemm.chunked_rows() < 24
    assert gemm.chunked_rows() == own
    assert gemm.linear(torch.randn(0, 24), packed, 40, None).shape == (0, 40)


def test_gemm_unavailable_falls_back_to_onednn(monkeypatch):
    # Where the extension cannot be built (no compiler, LOOKAHEAD_CPU_GEMM=0), "packed" runs on oneDNN.
    monkeypatch.setattr(cpu_linear, "gemm_available", lambda build=True: False)
    lin = CpuLinear(24, 10)
    x = torch.randn(3, 24)
    with torch.inference_mode():
        y = lin(x)
    assert lin.pack._backend == ("onednn" if cpu_linear.onednn_linear_available() else None)
    assert torch.allclose(y, torch.nn.functional.linear(x, lin.weight, lin.bias), atol=1e-5)


def test_step_attention_matches_attention_torch_per_sequence_lengths():
    torch.manual_seed(0)
    B, T, Hq, Hkv, D, S = 3, 4, 6, 2, 8, 32
    q = torch.randn(B, T, Hq, D)
    k, v = torch.randn(B, S, Hkv, D), torch.randn(B, S, Hkv, D)
    lens = torch.tensor([0, 5, 11])
    layout = StepLayout.prefill(T)
    ref = attention_torch(q, k, v, cache_len=lens, layout=layout)
    out = StepAttention(layout, lens, B, q.device)(q, k, v, cache_len=lens, layout=layout)
    assert torch.allclose(out, ref, atol=1e-6)
    with pytest.raises(ValueError, match="layout"):
        StepAttention(layout, lens, B, q.device)(q, k, v, layout=StepLayout.prefill(T))


# Quantised checkpoints: weights that are exactly d * q + m (4-bit q) or d * q (8-bit q) per block of 32 along K,
# with a half-precision d (or, 4-bit, a half times a 6-bit scale: GGUF's Q4_K), are packed as those integers and
# expanded in the GEMM to the very same floats.
def quantised_weight(N, K, fmt, g, full_range=True):
    """``[N, K]`` float32 as a Q4_1 (``fmt="q4"``), Q8_0 (``"q8"``), Q6_K-like (``"q8h"``) or Q5_1 (``"q8m"``)
    checkpoint dequantises:
    with ``full_range`` every block holds its format's extreme q (as llama.cpp's quantiser makes them), else blocks
    use less."""
    blocks = (N, K // 32, 32)
    d = (torch.rand(N, K // 32, 1, generator=g) * 0.02 + 1e-4).half().float()
    if fmt == "q4":
        top = 16 if full_range else 12
        q = torch.randint(0, top, blocks, generator=g).float()
        if full_range:
            q[..., 0], q[..., 1] = 0, 15
        m = (torch.randn(N, K // 32, 1, generator=g) * 0.1).half().float()
        return (d * q + m).reshape(N, K)
    if fmt == "q8m":  # as Q5_1: d * q + m, 5-bit q
        q = torch.randint(0, 32 if full_range else 24, blocks, generator=g).float()
        if full_range:
            q[..., 0], q[..., 1] = 0, 31
        m = (torch.randn(N, K // 32, 1, generator=g) * 0.1).half().float()
        return (d * q + m).reshape(N, K)
    if fmt == "q8h":  # as Q6_K: a half per 256 weights times an 8-bit scale per 16, q in [-32, 31]
        top = 32 if full_range else 20
        q = torch.randint(-top, top, (N, K // 16, 16), generator=g).float()
        if full_range:
            q[..., 3] = -32
        scale = torch.randint(-128, 128, (N, K // 16, 1), generator=g).float()
        return (d.repeat_interleave(2, dim=1) * scale * q).reshape(N, K)
    top = 128 if full_range else 90
    q = torch.randint(-top + 1, top, blocks, generator=g).float()
    if full_range:
        q[..., 3] = -127
    return (d * q).reshape(N, K)


@pytest.mark.parametrize("isa", ["avx512", "avx2", "scalar"])
@pytest.mark.parametrize("fmt", ["q4", "q8", "q8h", "q8m"])
@pytest.mark.parametrize("N,K", [(37, 64), (130, 96), (64, 576), (33, 32)])
def test_quantised_packing_gives_the_float32_layout_s_results(N, K, fmt, isa):
    if not cpu_linear.gemm_available():
        pytest.skip(f"no CPU GEMM: {cpu_linear.gemm_error()}")
    gemm = torch.ops.lookahead_gemm
    g = torch.Generator().manual_seed(N * 7 + K)
    for full_range in (True, False):
        w = quantised_weight(N, K, fmt, g, full_range)
        b = torch.randn(N, generator=g)
        with forced_isa(isa):
            packed, named, plain = gemm.pack(w), gemm.pack(w, fmt), gemm.pack(w, "f32")
            assert gemm.packed_format(packed) == gemm.packed_format(named) == fmt
            assert gemm.packed_format(plain) == "f32"
            assert torch.equal(packed, named)
            # The blocks, then the f32 layout: the blocks take under a third of the f32 bytes.
            assert packed.nbytes - plain.nbytes < plain.nbytes / 3
            # Up to 8 rows (AVX2) or 12 (AVX-512) expand the blocks in registers (4 through an L1 block without
            # AVX2); more read the blocks in chunks of at most that many (up to 24 rows, where forced or on a Zen 5)
            # or the f32 layout: every way must give the float32 layout's bits.
            for chunked, rows in ((0, (1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 12, 13, 33)), (24, (9, 13, 16, 17, 24, 25))):
                with forced_chunked_rows(chunked):
                    for M in rows:
                        buf = torch.full((M, K + 3), float("nan"))
                        buf[:, 1:K + 1] = torch.randn(M, K, generator=g)
                        x = buf[:, 1:K + 1]  # a strided view into NaN: a read outside it shows up
                        y = gemm.linear(x, packed, N, b)
                        assert torch.isfinite(y).all()
                        assert torch.equal(y, gemm.linear(x, plain, N, b))
                        ref = ref_linear(x, w, b)
                        assert (y.double() - ref).abs().max() <= 1e-5 * (1 + ref.abs().max())


def k_quant_scales(sc, mn):
    """Q4_K's and Q5_K's 12 bytes of 6-bit scales and mins per 256 weights (gguf-py's get_scale_min, inverted)."""
    np = pytest.importorskip("numpy")
    scales = np.zeros((sc.shape[0], 12), np.uint8)
    for j in range(4):
        scales[:, j] = (sc[:, j] & 63) | ((sc[:, 4 + j] >> 4) << 6)
        scales[:, 4 + j] = (mn[:, j] & 63) | ((mn[:, 4 + j] >> 4) << 6)
        scales[:, 8 + j] = (sc[:, 4 + j] & 15) | ((mn[:, 4 + j] & 15) << 4)
    return scales


def gguf_q4_k_blocks(N, K, g, positive_blocks=False):
    """An ``[N, K]`` GGUF Q4_K tensor's bytes, uint8 ``[N, K / 256 * 144]``: random blocks (a half ``d`` and ``dmin``
    per 256 weights, 6-bit scales and mins and 4-bit q per 32). Some sub-blocks have scale 0 (constant) or min 0,
    and with ``positive_blocks`` every min is 0 and q starts above 0 (a block of positive weights: its smallest
    value has no q of 0)."""
    np = pytest.importorskip("numpy")
    n = N * K // 256
    rng = np.random.default_rng(int(torch.randint(0, 2**31, (1,), generator=g)))
    d = (rng.random(n) * 1e-3 + 1e-5).astype(np.float16)
    dmin = (rng.random(n) * 1e-2 + 1e-5).astype(np.float16)
    sc = rng.integers(1, 64, (n, 8))
    mn = rng.integers(0, 64, (n, 8))
    sc[::7, 3] = 0
    mn[::5, 1] = 0
    q = rng.integers(0, 16, (n, 8, 32))
    if positive_blocks:
        mn[:] = 0
        q = rng.integers(3, 14, (n, 8, 32))
    scales = k_quant_scales(sc, mn)
    qs = q.reshape(n, 4, 2, 32)  # per 64 weights: the first 32 in the low nibbles, the next in the high ones
    nibbles = (qs[:, :, 0] | (qs[:, :, 1] << 4)).astype(np.uint8).reshape(n, 128)
    raw = np.concatenate([d.view(np.uint8).reshape(n, 2), dmin.view(np.uint8).reshape(n, 2), scales, nibbles], 1)
    return raw.reshape(N, -1)


def gguf_q4_k_weight(N, K, g, positive_blocks=False):
    """:func:`gguf_q4_k_blocks` as transformers loads them: dequantised by gguf-py (the code it calls), float32."""
    np = pytest.importorskip("numpy")
    gguf = pytest.importorskip("gguf")
    w = gguf.dequantize(gguf_q4_k_blocks(N, K, g, positive_blocks), gguf.GGMLQuantizationType.Q4_K)
    return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)).reshape(N, K)


@pytest.mark.parametrize("N,K,positive", [(40, 256, False), (33, 512, False), (64, 256, True)])
def test_gguf_q4_k_packs_as_q4_and_gives_the_float32_layout_s_results(N, K, positive):
    if not cpu_linear.gemm_available():
        pytest.skip(f"no CPU GEMM: {cpu_linear.gemm_error()}")
    gemm = torch.ops.lookahead_gemm
    g = torch.Generator().manual_seed(N + K)
    w = gguf_q4_k_weight(N, K, g, positive)
    packed, plain = gemm.pack(w), gemm.pack(w, "f32")
    assert gemm.packed_format(packed) == "q4"
    for M in (1, 3, 4, 6):
        x = torch.randn(M, K, generator=g)
        y = gemm.linear(x, packed, N, None)
        assert torch.equal(y, gemm.linear(x, plain, N, None))
        ref = ref_linear(x, w, None)
        assert (y.double() - ref).abs().max() <= 1e-5 * (1 + ref.abs().max())
    one = w.clone()
    one[N - 1, 77] = one[N - 1, 77].nextafter(torch.tensor(1.0))  # one float off: its group reads float32
    assert gemm.packed_format(gemm.pack(one)) == "mixed"
    x = torch.randn(2, K, generator=g)
    assert torch.equal(gemm.linear(x, gemm.pack(one), N, None), gemm.linear(x, gemm.pack(one, "f32"), N, None))


def gguf_dequantised(raw, qtype: str, N: int, K: int) -> torch.Tensor:
    np = pytest.importorskip("numpy")
    gguf = pytest.importorskip("gguf")
    w = gguf.dequantize(raw.reshape(N, -1), getattr(gguf.GGMLQuantizationType, qtype))
    return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)).reshape(N, K)


@pytest.mark.parametrize("qtype,bits,want", [("Q4_0", 4, "q4"), ("Q5_0", 5, "q8")])
def test_gguf_q4_0_and_q5_0_pack_with_either_sign_of_scale(qtype, bits, want):
    """Q4_0 and Q5_0 dequantise to ``d * (q - 8)`` and ``d * (q - 16)``: ``|d| * q' + m`` and ``|d| * q'``. llama.cpp
    gives a block a negative ``d`` when its largest magnitude is positive; then ``q = 8`` (``16``) dequantises to
    -0.0, which the blocks give back as +0.0: the GEMM's results are the same bits (``same_weight`` in
    ``csrc/small_gemm.cpp``), checked here with inputs that hold exact zeros of both signs too."""
    np = pytest.importorskip("numpy")
    if not cpu_linear.gemm_available():
        pytest.skip(f"no CPU GEMM: {cpu_linear.gemm_error()}")
    gemm = torch.ops.lookahead_gemm
    rng = np.random.default_rng(bits)
    N, K = 48, 96
    n = N * K // 32
    d = ((rng.random(n) * 0.02 + 1e-4) * rng.choice([-1, 1], n)).astype(np.float16)
    q = rng.integers(0, 2 ** bits, (n, 32)).astype(np.uint32)
    q[:, 5] = 2 ** (bits - 1)  # dequantises to zero: -0.0 under a negative d
    nibbles = (q[:, :16] & 15) | ((q[:, 16:] & 15) << 4)
    parts = [d.view(np.uint8).reshape(n, 2)]
    if bits == 5:  # Q5_0: each weight's fifth bit, 32 of them in 4 bytes, then the nibbles
        high = ((q >> 4) & 1) << np.arange(32, dtype=np.uint32)
        parts.append(high.sum(1, dtype=np.uint32).astype("<u4").view(np.uint8).reshape(n, 4))
    raw = np.concatenate(parts + [nibbles.astype(np.uint8)], 1)
    w = gguf_dequantised(raw, qtype, N, K)
    assert (w == 0).any() and torch.signbit(w[w == 0]).any()  # the -0.0 weights are there
    packed, plain = gemm.pack(w), gemm.pack(w, "f32")
    assert gemm.packed_format(packed) == want
    for M in (1, 3, 6):
        x = torch.randn(M, K)
        x[0, :40] = 0.0  # exact zeros of both signs: products of zeros
        x[-1, 10:30] = -0.0
        y = gemm.linear(x, packed, N, None)
        assert torch.equal(y.view(torch.int32), gemm.linear(x, plain, N, None).view(torch.int32))  # the bits


def gguf_q6_k_blocks(N, K, seed):
    """An ``[N, K]`` GGUF Q6_K tensor's bytes, uint8 ``[N, K / 256 * 210]``: per 256 weights the low 4 bits of
    q + 32, their high 2 bits, 16 int8 scales and a half ``d`` (of either sign); every block holds a q of 0, which
    a negative scale dequantises to -0.0."""
    np = pytest.importorskip("numpy")
    rng = np.random.default_rng(seed)
    n = N * K // 256
    u = rng.integers(0, 64, (n, 256))  # q + 32
    u[:, 7] = 32
    low, high = u & 15, u >> 4
    ql = np.concatenate([low[:, 128 * c: 128 * c + 64] | (low[:, 128 * c + 64: 128 * c + 128] << 4)
                         for c in range(2)], 1)
    qh = np.concatenate([sum(high[:, 128 * c + 32 * t: 128 * c + 32 * t + 32] << (2 * t) for t in range(4))
                         for c in range(2)], 1)
    scales = rng.integers(-128, 128, (n, 16)).astype(np.int8)
    d = ((rng.random(n) * 1e-3 + 1e-6) * rng.choice([-1, 1], n)).astype(np.float16)
    raw = np.concatenate([ql.astype(np.uint8), qh.astype(np.uint8), scales.view(np.uint8),
                          d.view(np.uint8).reshape(n, 2)], 1)
    return raw.reshape(N, -1)


def gguf_q5_blocks(qtype, N, K, seed):
    """An ``[N, K]`` GGUF Q5_1 or Q5_K tensor's bytes: 5-bit q with a half scale and offset per 32 (Q5_1), or a half
    ``d`` and ``dmin`` per 256 times 6-bit scales and mins per 32 (Q5_K, some mins 0)."""
    np = pytest.importorskip("numpy")
    rng = np.random.default_rng(seed)
    if qtype == "Q5_1":
        n = N * K // 32
        u = rng.integers(0, 32, (n, 32))
        d = (rng.random(n) * 0.02 + 1e-4).astype(np.float16)
        m = (rng.standard_normal(n) * 0.1).astype(np.float16)
        high = ((u >> 4) << np.arange(32)).sum(1).astype("<u4").view(np.uint8).reshape(n, 4)
        low = (u[:, :16] & 15) | ((u[:, 16:] & 15) << 4)
        raw = np.concatenate([d.view(np.uint8).reshape(n, 2), m.view(np.uint8).reshape(n, 2), high,
                              low.astype(np.uint8)], 1)
        return raw.reshape(N, -1)
    n = N * K // 256
    u = rng.integers(0, 32, (n, 256))
    sc, mn = rng.integers(1, 64, (n, 8)), rng.integers(0, 64, (n, 8))
    mn[::3, 2] = 0
    d = (rng.random(n) * 1e-3 + 1e-5).astype(np.float16)
    dmin = (rng.random(n) * 1e-2 + 1e-5).astype(np.float16)
    low, high = u & 15, u >> 4
    qs = np.concatenate([low[:, 64 * c: 64 * c + 32] | (low[:, 64 * c + 32: 64 * c + 64] << 4) for c in range(4)], 1)
    qh = sum(high[:, 32 * t: 32 * t + 32] << t for t in range(8))
    raw = np.concatenate([d.view(np.uint8).reshape(n, 2), dmin.view(np.uint8).reshape(n, 2), k_quant_scales(sc, mn),
                          qh.astype(np.uint8), qs.astype(np.uint8)], 1)
    return raw.reshape(N, -1)


def gguf_random_k_blocks(qtype, N, K, seed):
    """An ``[N, K]`` GGUF Q2_K or Q3_K tensor's bytes: random bytes (every pattern is a valid block: any q, scale
    and mask bits) with each super-block's half scales (Q3_K: ``d``; Q2_K: ``d`` and ``dmin``, the block's last
    bytes) set to finite values, ``d`` of either sign."""
    np = pytest.importorskip("numpy")
    rng = np.random.default_rng(seed)
    size, halves = {"Q2_K": (84, 2), "Q3_K": (110, 1)}[qtype]
    n = N * K // 256
    raw = rng.integers(0, 256, (n, size)).astype(np.uint8)
    scales = (rng.random((n, halves)) * 1e-3 + 1e-6).astype(np.float16)
    scales[:, 0] *= rng.choice([-1, 1], n).astype(np.float16)
    raw[:, size - 2 * halves:] = scales.view(np.uint8).reshape(n, 2 * halves)
    return raw.reshape(N, -1)


@pytest.mark.parametrize("qtype,layout", [("Q6_K", "q8h"), ("Q3_K", "q8h"), ("Q5_1", "q8m"), ("Q5_K", "q8m"),
                                          ("Q2_K", "f32")])
def test_gguf_k_quants_and_q5_pack_as_q8h_and_q8m_and_give_the_float32_layout_s_results(qtype, layout):
    """Q6_K (the 6-bit type "Q4_K_M" files use for some layers and the head) dequantises to ``(d * sc) * q``: a half
    ``d`` per 256 weights, an 8-bit ``sc`` per 16, q in [-32, 31]; exact products, so the q8h blocks (int8 q, a
    scale per 16 along K) hold it. So does Q3_K's ``(d * (sc - 32)) * q``, 6-bit ``sc`` per 16 and q in [-4, 3]
    ("Q3_K_M" files' main type). The 5-bit types with an offset (Q5_K is "Q5_K_M" files' main type) go to q8m:
    q4's scale and offset per 32 along K, a byte a q. Q2_K, whose offset changes every 16 weights, fits none and
    stays float32 (correct, not faster)."""
    if not cpu_linear.gemm_available():
        pytest.skip(f"no CPU GEMM: {cpu_linear.gemm_error()}")
    gemm = torch.ops.lookahead_gemm
    N, K = 40, 512
    raw = gguf_q6_k_blocks(N, K, seed=6) if qtype == "Q6_K" else gguf_random_k_blocks(qtype, N, K, seed=3) \
        if qtype in ("Q2_K", "Q3_K") else gguf_q5_blocks(qtype, N, K, seed=len(qtype))
    w = gguf_dequantised(raw, qtype, N, K)
    packed, plain = gemm.pack(w), gemm.pack(w, "f32")
    assert gemm.packed_format(packed) == layout
    for M in (1, 2, 3, 4, 5, 7, 8):
        x = torch.randn(M, K)
        x[0, :20] = 0.0
        assert torch.equal(gemm.linear(x, packed, N, None).view(torch.int32),
                           gemm.linear(x, plain, N, None).view(torch.int32))


def test_a_weight_whose_groups_fit_one_form_in_common_takes_it_not_mixed():
    """Q3_K's blocks fit q8h and, where no product is +128, q8 too: group by group a weight could take both. Its
    first group fitting q8 (a Q8_0-like group, which q8h holds as well) must not make it mixed: one form that
    every group fits is preferred."""
    if not cpu_linear.gemm_available():
        pytest.skip(f"no CPU GEMM: {cpu_linear.gemm_error()}")
    gemm = torch.ops.lookahead_gemm
    g = torch.Generator().manual_seed(5)
    K = 256
    w = torch.cat([quantised_weight(32, K, "q8", g), quantised_weight(40, K, "q8h", g)])
    packed, plain = gemm.pack(w), gemm.pack(w, "f32")
    assert gemm.packed_format(packed) == "q8h"
    x = torch.randn(3, K, generator=g)
    assert torch.equal(gemm.linear(x, packed, w.shape[0], None), gemm.linear(x, plain, w.shape[0], None))


@pytest.mark.parametrize("isa", ["avx512", "avx2", "scalar"])
def test_a_weight_of_several_types_packs_each_group_in_its_own(isa):
    """A fused weight of several GGUF tensors (q/k/v of a "Q4_K_M" layer: Q4_K q and k, a Q6_K v) fits no one
    layout: each group of 32 columns takes its own, and groups of no quantised form read the f32 layout."""
    if not cpu_linear.gemm_available():
        pytest.skip(f"no CPU GEMM: {cpu_linear.gemm_error()}")
    gemm = torch.ops.lookahead_gemm
    g = torch.Generator().manual_seed(9)
    K = 256
    parts = [gguf_q4_k_weight(64, K, g), gguf_dequantised(gguf_q6_k_blocks(32, K, seed=9), "Q6_K", 32, K),
             torch.randn(32, K, generator=g), quantised_weight(17, K, "q8", g)]  # the last group 17 columns wide
    w = torch.cat(parts)
    N = w.shape[0]
    with forced_isa(isa):
        packed, plain = gemm.pack(w), gemm.pack(w, "f32")
        assert gemm.packed_format(packed) == "mixed"
        for chunked, rows in ((0, (1, 2, 3, 4, 5, 6, 8, 12, 13)), (24, (13, 20, 24))):  # chunks: as above
            with forced_chunked_rows(chunked):
                for M in rows:
                    buf = torch.full((M, K + 2), float("nan"))
                    buf[:, 1:K + 1] = torch.randn(M, K, generator=g)
                    x = buf[:, 1:K + 1]
                    b = torch.randn(N, generator=g)
                    y = gemm.linear(x, packed, N, b)
                    assert torch.equal(y.view(torch.int32), gemm.linear(x, plain, N, b).view(torch.int32))
                    ref = ref_linear(x, w, b)
                    assert (y.double() - ref).abs().max() <= 1e-5 * (1 + ref.abs().max())
    assert gemm.packed_format(gemm.pack(torch.randn(40, 64))) == "f32"  # no group of a quantised form
    damaged = packed.clone()
    damaged[64 + 8: 64 + 16] = 255  # the first group's offset, far out of the tensor
    with pytest.raises(ValueError, match="group table"):
        gemm.linear(torch.randn(1, K), damaged, N, None)


def test_pack_keeps_float32_unless_every_float_is_reproduced():
    if not cpu_linear.gemm_available():
        pytest.skip(f"no CPU GEMM: {cpu_linear.gemm_error()}")
    gemm = torch.ops.lookahead_gemm
    g = torch.Generator().manual_seed(3)
    w4, w8 = quantised_weight(40, 64, "q4", g), quantised_weight(40, 64, "q8", g)
    assert gemm.packed_format(gemm.pack(w4)) == "q4"
    assert gemm.packed_format(gemm.pack(w8)) == "q8"  # 8-bit values are no 4-bit block
    assert gemm.packed_format(gemm.pack(torch.randn(40, 64))) == "f32"
    assert gemm.packed_format(gemm.pack(w4[:, :48])) == "f32"  # K not a multiple of 32
    assert gemm.packed_format(gemm.pack(w4.nextafter(torch.tensor(1.0)))) == "f32"  # every float one ulp off
    # A single float off, or a NaN: that group of 32 columns reads the float32 layout, the others their blocks; but
    # a weight whose first group is of no quantised form is taken for a float one (mixed is not tried).
    off = w4.clone().index_put_((torch.tensor([17]), torch.tensor([5])), w4[17, 5].nextafter(torch.tensor(1.0)))
    assert gemm.packed_format(gemm.pack(off)) == "f32"
    for bad in (w4.clone().index_put_((torch.tensor([35]), torch.tensor([5])), w4[35, 5].nextafter(torch.tensor(1.0))),
                w4.clone().index_put_((torch.tensor([39]), torch.tensor([63])), torch.tensor(float("nan")))):
        packed = gemm.pack(bad)
        assert gemm.packed_format(packed) == "mixed"
        x = torch.randn(3, 64, generator=g)
        y, want = gemm.linear(x, packed, 40, None), gemm.linear(x, gemm.pack(bad, "f32"), 40, None)
        assert torch.equal(y.isnan(), want.isnan()) and torch.equal(y.nan_to_num(), want.nan_to_num())
    zeros = torch.zeros(40, 64)
    zeros[3, 7] = -0.0  # comes back as +0.0, which gives every product the same bits (same_weight)
    assert gemm.packed_format(gemm.pack(zeros)) == "q4"
    signed = w8.clone()
    signed[5, 9] = -0.0
    assert gemm.packed_format(gemm.pack(signed)) == "q8"
    x = torch.randn(3, 64)
    x[1, :9] = 0.0
    assert torch.equal(gemm.linear(x, gemm.pack(signed), 40, None).view(torch.int32),
                       gemm.linear(x, gemm.pack(signed, "f32"), 40, None).view(torch.int32))
    with pytest.raises(ValueError, match="not exactly q4"):
        gemm.pack(w8, "q4")
    with pytest.raises(ValueError, match="format"):
        gemm.pack(w4, "q5")
    with pytest.raises(ValueError, match="not exactly q8h"):
        gemm.pack(torch.randn(40, 64), "q8h")
    # Another uint8 tensor, or a packed one cut short or with its header damaged, is refused, not read.
    packed = gemm.pack(w4)
    damaged = packed.clone()
    damaged[0] ^= 1
    for bad in (torch.zeros(2, 2, 700, dtype=torch.uint8), torch.zeros(5000, dtype=torch.uint8), packed[:-64].clone(),
                damaged):
        with pytest.raises(ValueError, match="must come from lookahead_gemm.pack"):
            gemm.linear(torch.randn(2, 64), bad, 40, None)
    with pytest.raises(ValueError, match="K="):
        gemm.linear(torch.randn(2, 32), packed, 40, None)
    with pytest.raises(ValueError, match="n="):
        gemm.linear(torch.randn(2, 64), packed, 70, None)
