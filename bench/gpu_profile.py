"""Where a GPU step's time goes: a diagnostic for issue 11 (prints; not a benchmark of record).

0. ``smolstep``: kernel tables of SmolLM2-shaped float32 steps (T = 1, 16, 128); ``smoltiles``: our attention
   there by tile and precision; ``smollinear``: its linear layers at 1-256 rows, cuBLAS against cuBLASLt;
   ``smolstack``: a step's every linear product (own weights, one graph), cuBLAS against our kernel split or not;
   ``smolgemv``: the same at 1-16 rows against ``bench/gpu_gemv.py``'s candidate (K in one run, no second phase).
1. ``steps``: a SmolLM2-shaped random model (float32): each step size of the controller's menu replayed through a
   StepRunner graph (CUDA events), capture errors printed in full.
2. ``loop``: cProfile of ``generate`` (plain, fixed 15-5-15, automatic) on that model: the host functions that
   cost most per step, and the count of device synchronisations.
3. ``kernels``: GPU time per kernel of one eager 7B-shape bf16 step (torch.profiler), T = 1 and T = 120.
4. ``attention``: our attention against SDPA (dense mask) at 7B shape, T = 120, 4k, timed with and without host
   launch overhead (``do_bench`` vs ``do_bench_cudagraph``), over a few tile configurations.

    python bench/gpu_profile.py [smolstack smolgemv smollinear smolstep smoltiles steps loop verify kernels
                                 attention]
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import sys
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))


def smol_model(device, dtype=torch.float32):
    from lookahead.model import LlamaForCausalLM, ModelConfig

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                      num_heads=9, num_kv_heads=3, head_dim=64, max_position_embeddings=8192,
                      rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg, dtype=dtype, device=device).eval()


def part_steps(device):
    from lookahead.config import StepShape
    from lookahead.runner import StepRunner
    from lookahead_kernels.tree import TreeShape
    from gpu_util import time_ms

    model = smol_model(device)
    context = 256
    menu = (1, 16, 64, 128, 256)
    cache = model.new_cache(1, context + max(menu))
    shapes = [StepShape(1, 1, T - 1) for T in menu] + [StepShape(15, 4, 15), StepShape(15, 1, 15)]
    runner = StepRunner(model, cache, shapes, graphs=True)
    for shape in shapes:
        T = shape.max_tokens
        ids = torch.zeros(1, T, dtype=torch.long, device=device)
        pos = torch.arange(context, context + T, device=device)[None]
        V = shape.tree_budget
        tree = TreeShape.from_parents(list(range(-1, V - 1)), device=device) if V else None
        try:
            ms = time_ms(lambda: runner.run(shape, ids, pos, context, tree), device, reps=20)
            graph_only = time_ms(runner._buffers[runner._key(shape, None, None, False)].graph.replay, device, reps=20)
            print(f"steps: {shape} T={T}: run() {ms:.3f} ms, replay only {graph_only:.3f} ms", flush=True)
        except Exception:
            print(f"steps: {shape} T={T}: FAILED", flush=True)
            traceback.print_exc()
    from lookahead.controller import measure_step_costs

    costs = measure_step_costs(model)
    print("steps: measure_step_costs:", list(zip(costs.tokens, [round(s * 1e3, 3) for s in costs.seconds])))


def part_loop(device):
    from lookahead import LookaheadConfig

    model = smol_model(device)
    g = torch.Generator().manual_seed(0)
    base = torch.randint(0, 2000, (40,), generator=g)
    prompt = torch.cat([base, base[:20], base, base[5:30]])[None].to(device)  # repeats: the pool finds something
    configs = {"plain": None, "fixed-15-5-15": LookaheadConfig(window=15, ngram=5, guess=15),
               "auto": LookaheadConfig()}
    for name, la in configs.items():
        for _ in range(2):  # warm-up: captures, cost measurement
            model.generate(prompt, max_new_tokens=64, lookahead=la, eos_token_id=[])
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(prompt, max_new_tokens=128, lookahead=la, eos_token_id=[])
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        st = out.stats
        print(f"loop: {name}: {wall * 1e3:.1f} ms, {st.steps} steps, {wall / st.steps * 1e3:.3f} ms/step, "
              f"compression {st.compression_ratio:.2f}, fed {st.fed_tokens / max(st.steps, 1):.1f}/step", flush=True)
        prof = cProfile.Profile()
        prof.enable()
        out = model.generate(prompt, max_new_tokens=128, lookahead=la, eos_token_id=[])
        torch.cuda.synchronize()
        prof.disable()
        s = io.StringIO()
        ps = pstats.Stats(prof, stream=s).sort_stats("tottime")
        ps.print_stats(22)
        print(f"loop: {name}: cProfile by tottime ({out.stats.steps} steps)\n" + s.getvalue()[-6000:], flush=True)
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("cumtime").print_stats(30)
        print(f"loop: {name}: cProfile by cumtime\n" + s.getvalue()[-7000:], flush=True)
    if "auto" in configs:
        from lookahead.controller import cost_key

        print("loop: auto step costs:", model.step_costs_cache.get(cost_key(model)))


def part_kernels(device):
    from torch.profiler import ProfilerActivity, profile

    from gpu_util import random_model
    from lookahead_kernels import StepLayout

    model = random_model("llama2-7b", torch.bfloat16, device)
    context = 1024
    cache = model.new_cache(1, context + 128)
    for T in (1, 120):
        layout = StepLayout(1, 1) if T == 1 else StepLayout.linear(15, 4, 15, 4, device=device)
        ids = torch.zeros(1, T, dtype=torch.long, device=device)
        pos = (context + layout.position_offsets(device))[None]
        rows = torch.arange(T, device=device)
        with torch.inference_mode():
            for _ in range(3):
                model(ids, pos, cache, context, layout, rows)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    model(ids, pos, cache, context, layout, rows)
                torch.cuda.synchronize()
        print(f"kernels: 7B bf16 eager step T={T} context {context}, 5 steps:\n" +
              prof.key_averages().table(sort_by="cuda_time_total", row_limit=25), flush=True)
    del model, cache
    torch.cuda.empty_cache()


def part_attention(device):
    import triton.testing

    from bench_attention import make_inputs, sdpa_dense, step_layout
    from lookahead_kernels import attention as attn
    from lookahead_kernels.attention_ref import dense_mask

    context = 4096
    for name, hq, hkv in (("llama2-7b", 32, 32), ("llama3-8b", 32, 8)):
        for kind in ("linear", "tree"):
            layout = step_layout(15, 5, 15, device=device) if kind == "linear" else \
                step_layout(15, 5, 60, "tree", device=device)
            q, k, v = make_inputs(context, layout, hq, hkv, 128, torch.bfloat16, device)
            lens = torch.tensor([context], device=device)
            mask = dense_mask(layout, context, context + layout.T, device=device)
            sdpa = lambda: sdpa_dense(q, k, v, mask)  # noqa: E731
            res = {"sdpa": (triton.testing.do_bench(sdpa), triton.testing.do_bench_cudagraph(sdpa))}
            original = attn._tile_config
            for bm, bn, warps, stages in ((None, None, None, None), (64, 64, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3),
                                          (128, 32, 4, 2), (64, 128, 8, 2), (128, 128, 8, 2), (32, 64, 4, 2)):
                if bm is not None:
                    attn._tile_config = lambda M, D, dt, c=(bm, bn, 128, warps, stages): c
                for splits in (None, 1, 2, 8):
                    fn = lambda: attn.lookahead_attention(q, k, v, cache_len=lens, layout=layout,  # noqa: E731
                                                          num_splits=splits)
                    try:
                        fn()
                        res[f"ours bm={bm} bn={bn} w={warps} s={stages} splits={splits}"] = (
                            triton.testing.do_bench(fn), triton.testing.do_bench_cudagraph(fn))
                    except Exception as exc:
                        print(f"attention: {bm} {bn} {warps} {stages} {splits}: {type(exc).__name__}: {exc}"[:300])
                attn._tile_config = original
            print(f"attention: {name} {kind} T={layout.T} context {context}: (do_bench us, do_bench_cudagraph us)")
            for key, (a, b) in sorted(res.items(), key=lambda kv: kv[1][1]):
                print(f"   {key:50s} {a * 1e3:8.1f} {b * 1e3:8.1f}", flush=True)


def part_verify(device):
    import triton.testing

    from lookahead_kernels import verify_tree_greedy, row_argmax
    from lookahead_kernels.tree import TreeShape

    V = 49152
    tree = TreeShape.from_parents([-1, 0, 1, 2, -1, 4, 5, 6], device=device)
    n = tree.size
    x = torch.randn(1, V, device=device)
    nodes = torch.randn(1, n, V, device=device)
    tokens = torch.randint(0, V, (1, n), device=device)
    num = torch.tensor([n], device=device)
    fn = lambda: verify_tree_greedy(x, nodes, tokens, tree.end, num, 4)  # noqa: E731
    fn()
    print(f"verify: greedy {n} nodes vocab {V}: do_bench {triton.testing.do_bench(fn) * 1e3:.1f} us, "
          f"cudagraph {triton.testing.do_bench_cudagraph(fn) * 1e3:.1f} us", flush=True)
    am = lambda: row_argmax(nodes[0])  # noqa: E731
    print(f"verify: row_argmax {n} rows: do_bench {triton.testing.do_bench(am) * 1e3:.1f} us, "
          f"cudagraph {triton.testing.do_bench_cudagraph(am) * 1e3:.1f} us", flush=True)


def part_smolstep(device):
    """Kernel tables of SmolLM2-shaped float32 eager steps at T = 1, 16 and 128 (a tree of T - 1 nodes): which
    kernels grow with the step's size (the GPU's t(T) / t(1) bounds lookahead's gain on this model)."""
    from torch.profiler import ProfilerActivity, profile

    from lookahead_kernels import StepLayout
    from lookahead_kernels.tree import TreeShape

    model = smol_model(device)
    context = 256
    cache = model.new_cache(1, 1024)
    for T in (1, 16, 128):
        chain = None if T == 1 else TreeShape.from_parents(list(range(-1, T - 2)), device=device)
        layout = StepLayout(1, 1, chain)
        ids = torch.zeros(1, T, dtype=torch.long, device=device)
        pos = (context + layout.position_offsets(device))[None]
        lens = torch.tensor([context], device=device)
        with torch.inference_mode():
            for _ in range(3):
                model(ids, pos, cache, lens, layout)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    model(ids, pos, cache, lens, layout)
                torch.cuda.synchronize()
        print(f"smolstep: fp32 eager step T={T}, 3 steps:\n" +
              prof.key_averages().table(sort_by="cuda_time_total", row_limit=14), flush=True)


def part_smoltiles(device):
    """Our attention at SmolLM2's shape by split-KV count and the least keys a split takes (CUDA-graph timing), the
    float32 products the GPU runs (tf32x3). T = 1 too: on the H200 (session 46) a plain step's attention took 10.4
    us a layer at 256 keys plus 2.3 us merging its key ranges, a third of the step; with at least 256 keys a split
    (``_MIN_CHUNK``), 256 keys are one program's four key tiles in a row whatever the split count. Session 57: the
    least range is 128 keys for up to 64 query rows (``_min_chunk``), and the merge reads only the ranges the keys
    fill; ``default`` is that, the other rows force the least range (and the split count)."""
    import triton.testing

    from lookahead_kernels import StepLayout
    from lookahead_kernels import attention as attn
    from lookahead_kernels.tree import TreeShape

    # Session 54 (context 256): the default tiles were as good as any other, and 4 key ranges of 64 rows beat the
    # default split by 3.4 us a layer at T = 1 (10.0 against 13.4): the split counts and least ranges at two contexts.
    # The default is timed first and again last (session 57's first loop ran slower than the same configs later).
    for context in (256, 1024):
        for T, W, lv, V in ((1, 1, 1, 0), (16, 1, 1, 15), (75, 15, 4, 15), (120, 15, 4, 60)):
            tree = TreeShape.from_parents(list(range(-1, V - 1)), device=device) if V else None
            layout = StepLayout(W, lv, tree)
            q = torch.randn(1, T, 9, 64, device=device)
            k = torch.randn(1, 2048, 3, 64, device=device)
            v = torch.randn(1, 2048, 3, 64, device=device)
            lens = torch.tensor([context], device=device)
            min_chunk = attn._min_chunk
            res = {}
            for chunk in ("default", 256, 128, 64, "default again"):
                if not isinstance(chunk, str):
                    attn._min_chunk = lambda M, c=chunk: c
                for splits in (None,) if isinstance(chunk, str) else (None, 1, 2, 4, 8):
                    fn = lambda: attn.lookahead_attention(q, k, v, cache_len=lens, layout=layout,  # noqa: E731
                                                          num_splits=splits)
                    name = chunk if isinstance(chunk, str) else f"min_chunk={chunk} splits={splits}"
                    try:
                        fn()
                        res[name] = triton.testing.do_bench_cudagraph(fn)
                    except Exception as exc:
                        print(f"smoltiles: {name}: {type(exc).__name__}: {exc}"[:300])
                attn._min_chunk = min_chunk
            print(f"smoltiles: attention fp32 T={T} (W={W}, levels={lv}, tree {V}) context {context}: us (cudagraph)")
            for key, b in sorted(res.items(), key=lambda kv: kv[1])[:8]:
                print(f"   {key:30s} {b * 1e3:8.1f}", flush=True)
            firsts = (f"{res.get(k, float('nan')) * 1e3:.1f}" for k in ("default", "default again"))
            print("   default (first, last): " + " / ".join(firsts))


def part_smollinear(device):
    """SmolLM2's float32 linear layers (a step's qkv, o, gate_up, down and the vocabulary projection) at M = 1 to 256
    rows, through torch's cuBLAS path, through cuBLASLt (``torch.backends.cuda.preferred_blas_library``) and through
    our kernel (``lookahead_kernels.step_linear``, which the model takes at 2-64 rows): the H200 of session 46 ran a
    16-row step's products at 2.5x a one-row step's (cuBLAS's float32 GEMM against its GEMV), the growth that bounds
    lookahead on this model. One layer's five products, microseconds (CUDA graph)."""
    import triton.testing

    from lookahead_kernels.step_linear import step_linear

    shapes = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576), "lm_head": (576, 49152)}
    weights = {name: torch.randn(n, k, device=device) / k ** 0.5 for name, (k, n) in shapes.items()}
    original = torch.backends.cuda.preferred_blas_library()
    print("smollinear: fp32 products, us a call (do_bench_cudagraph); layer = qkv + o + gate_up + down", flush=True)
    try:
        for M in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            line = []
            for library in ("cublas", "cublaslt", "ours"):
                try:
                    torch.backends.cuda.preferred_blas_library("cublas" if library == "ours" else library)
                except RuntimeError as exc:  # a torch built without it
                    line.append(f"{library}: {exc}"[:120])
                    continue
                product = step_linear if library == "ours" else torch.nn.functional.linear
                us = {}
                for name, w in weights.items():
                    x = torch.randn(M, w.shape[1], device=device)
                    fn = lambda: product(x, w)  # noqa: E731
                    try:
                        fn()
                        us[name] = 1e3 * triton.testing.do_bench_cudagraph(fn)
                    except Exception as exc:  # said, not fatal
                        us[name] = float("nan")
                        print(f"smollinear: {library} M={M} {name}: {type(exc).__name__}: {exc}"[:300])
                layer = sum(us[n] for n in ("qkv", "o", "gate_up", "down"))
                line.append(f"{library}: layer {layer:6.1f} lm_head {us['lm_head']:6.1f} ("
                            + " ".join(f"{n} {v:.1f}" for n, v in us.items() if n != "lm_head") + ")")
            print(f"   M={M:<4d} " + " | ".join(line), flush=True)
    finally:
        torch.backends.cuda.preferred_blas_library(original)


def smol_step_shapes(layers: int = 30) -> list[tuple[int, int]]:
    """``(N, K)`` of a SmolLM2 step's float32 products in order: each layer's qkv, o, gate_up and down, then the
    vocabulary projection."""
    return [(960, 576), (576, 576), (3072, 576), (576, 1536)] * layers + [(49152, 576)]


def part_smolstack(device, layers=30, rows=(16, 64, 1, 4, 128, 2, 8, 32, 256, 48)):
    """SmolLM2's float32 linear layers as a step meets them: 30 layers' qkv, o, gate_up and down and the vocabulary
    projection, each with its own weight (540 MB: read from HBM, as in a step, not from L2), the whole sequence
    replayed from one CUDA graph, at M = 1 to 256 rows (the likeliest steps first, in case the time box ends it):
    cuBLAS; our kernel unsplit (its tiles, K in one run, as at git 92b29f2); as the model runs it
    (``rows_config``: 16-row tiles split for 256 programs up to 32 rows, 64-row tiles beyond, session 57); with
    16-row tiles split for 128 and 512 programs; at up to 32 rows one other tile (``tile_variants``), at 33 rows and
    more one other 64-row tile (``tall_variants``). Milliseconds a step (``do_bench_cudagraph`` median); the model
    takes our kernel at 2-256 rows."""
    import triton.testing

    from lookahead_kernels import step_linear as sl

    shapes = smol_step_shapes(layers)
    weights = [torch.randn(n, k, device=device) / k ** 0.5 for n, k in shapes]

    def config(w, target):
        if target == "model":
            return sl.rows_config(M, *w.shape)
        return sl.tile_config(*w.shape, target=target or 1)  # no target: K in one run (as at 92b29f2)

    def tiles(block_n, block_k, warps, target, block_m=None):  # another tile, K split by tile_config's rule
        return lambda w: sl.tile_config(*w.shape, target=target, block_n=block_n, block_k=block_k, warps=warps) \
            + ((block_m,) if block_m else ())

    variants = {"ours unsplit": None, "ours (model)": "model", "ours split 128": 128, "ours split 512": 512}
    # Sessions 55-57 swept 11 other tiles at up to 32 rows and 5 taller ones at 64-256 (in git at 4a84d54; results
    # in bench/results/gpu-h200-s57.md): the "deep" tiles (K unsplit, every K tile in flight) lost everywhere by
    # 60-100%, narrower or wider column tiles and K tiles of 128 lost at 1-16 rows; 64-row tiles won at 64-256 rows
    # and became the model's (`rows_config`). Kept: the two that came close or won somewhere, timed again.
    tile_variants = {"bn32 w2 t256": tiles(32, 64, 2, 256)}  # 32 rows: 0.855 ms against the model's 0.947
    tall_variants = {"bm64 bn64 t64": tiles(64, 32, 4, 64, block_m=64)}  # 256 rows: 1.960 against 2.007
    print("smolstack: SmolLM2 fp32, every linear product of a step (own weights), ms a step (one graph)", flush=True)
    for M in rows:
        x = {k: torch.randn(M, k, device=device) for k in (576, 1536)}
        outs = [torch.empty(M, w.shape[0], device=device) for w in weights]
        line = {}
        try:
            line["cuBLAS"] = triton.testing.do_bench_cudagraph(
                lambda: [torch.nn.functional.linear(x[w.shape[1]], w) for w in weights])
        except Exception as exc:
            print(f"smolstack: cuBLAS M={M}: {type(exc).__name__}: {exc}"[:300])
        for name, target in list(variants.items()) + list((tile_variants if M <= 32 else tall_variants).items()):
            configs = [target(w) if callable(target) else config(w, target) for w in weights]
            counters = [torch.zeros(max(1, sl.counters_needed(M, w.shape[0], c)), dtype=torch.int32, device=device)
                        for w, c in zip(weights, configs)]

            def run():
                for w, c, n, y in zip(weights, configs, counters, outs):
                    sl._launch(x[w.shape[1]], w, None, y, n, c)
            try:
                run()
                ok = all(not n.any() for n in counters)
                line[name] = triton.testing.do_bench_cudagraph(run)
                err = max(((y - ref).abs().max() / ref.abs().max()).item()
                          for w, y in zip(weights[:4] + weights[-1:], outs[:4] + outs[-1:])
                          for ref in (torch.nn.functional.linear(x[w.shape[1]], w),))
                if not ok or not err < 1e-4:
                    print(f"smolstack: {name} M={M}: counters left zero {ok}, max relative error {err:.2e}")
            except Exception as exc:
                print(f"smolstack: {name} M={M}: {type(exc).__name__}: {exc}"[:300])
        print(f"   M={M:<4d} " + " | ".join(f"{k} {v:.3f}" for k, v in line.items()), flush=True)
    print("   programs a row tile, split (model): " + ", ".join(
        f"{n}x{k}: {triton.cdiv(n, 32) * c[4]} ({c[4]})"
        for (n, k), c in ((s, sl.tile_config(*s)) for s in shapes[:4] + shapes[-1:])), flush=True)


def part_smolgemv(device, layers=30, rows=(16, 2, 8, 1, 4), shapes=None):
    """A step's 121 float32 products as ``smolstack`` times them (own weights, one graph; 16 rows first, in case the
    time box ends it): cuBLAS, our kernel as the model runs it (``rows_config``) and ``bench/gpu_gemv.py``'s
    candidate (K in one run, no tensor cores, no second phase) in each of its ``CONFIGS``; milliseconds a step, and
    the largest relative error of the first layer's products and the vocabulary's against cuBLAS's. The candidate
    would replace the model's kernel at 2-16 rows where it beats it (session 57: 0.70-0.73 ms against cuBLAS's GEMV
    0.604 at one row). ``shapes``: the weights' ``(N, K)`` in place of SmolLM2's (a test's small ones)."""
    import triton.testing

    import gpu_gemv
    from lookahead_kernels import step_linear as sl

    shapes = shapes or smol_step_shapes(layers)
    weights = [torch.randn(n, k, device=device) / k ** 0.5 for n, k in shapes]
    checked = sorted({0, 1, 2, 3, len(weights) - 1} & set(range(len(weights))))
    print("smolgemv: SmolLM2 fp32, every linear product of a step (own weights), ms a step (one graph)", flush=True)
    for M in rows:
        x = {k: torch.randn(M, k, device=device) for k in {k for _, k in shapes}}
        outs = [torch.empty(M, w.shape[0], device=device) for w in weights]
        refs = {i: torch.nn.functional.linear(x[weights[i].shape[1]], weights[i]) for i in checked}
        configs = [sl.rows_config(M, *w.shape) for w in weights]
        counters = [torch.zeros(max(1, sl.counters_needed(M, w.shape[0], c)), dtype=torch.int32, device=device)
                    for w, c in zip(weights, configs)]
        runs = {"cuBLAS": lambda: [torch.mm(x[w.shape[1]], w.t(), out=y) for w, y in zip(weights, outs)],
                "ours (model)": lambda: [sl._launch(x[w.shape[1]], w, None, y, n, c)
                                         for w, c, n, y in zip(weights, configs, counters, outs)]}
        runs.update(gpu_gemv.candidate_runs(x, weights, outs))
        line = {}
        for name, run in runs.items():
            try:
                for y in outs:
                    y.fill_(float("nan"))
                run()
                err = max(((outs[i] - ref).abs().max() / ref.abs().max()).item() for i, ref in refs.items())
                line[name] = f"{triton.testing.do_bench_cudagraph(run):.3f} (err {err:.0e})"
            except Exception as exc:  # said, not fatal: the other candidates go on
                print(f"smolgemv: {name} M={M}: {type(exc).__name__}: {exc}"[:300], flush=True)
        print(f"   M={M:<3d} " + " | ".join(f"{k} {v}" for k, v in line.items()), flush=True)


PARTS = {"smolstack": part_smolstack, "smolgemv": part_smolgemv, "smollinear": part_smollinear,
         "smolstep": part_smolstep, "smoltiles": part_smoltiles, "steps": part_steps, "loop": part_loop,
         "kernels": part_kernels, "attention": part_attention, "verify": part_verify}


def main(argv=None) -> int:
    parts = (argv if argv is not None else sys.argv[1:]) or list(PARTS)
    device = torch.device("cuda")
    for p in parts:
        t0 = time.perf_counter()
        try:
            PARTS[p](device)
        except Exception:
            print(f"{p}: FAILED")
            traceback.print_exc()
        print(f"== {p} took {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
