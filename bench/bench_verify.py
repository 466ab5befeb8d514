"""Verification of one lookahead step: microseconds per step, fused Triton kernels vs torch reference vs a loop.

Rows, for greedy and for sampling (B = 1, float32, K = N - 1 tokens per candidate):

* ``triton``: ``lookahead_kernels.verify.verify_greedy`` / ``verify_sample`` (GPU only; sampling includes the
  ``torch.rand`` of its uniforms);
* ``torch reference``: ``verify_greedy_reference`` / ``verify_sample_reference`` (with the uniforms drawn);
* ``python loop``: a per-candidate, per-token loop with ``.item()`` host syncs, in the style of the original
  lookahead implementation (greedy: argmax per token; sampling: accept, zero and renormalise on a full row).

    python bench/bench_verify.py          # on a GPU: every row, timed with triton.testing.do_bench (median)
    python bench/bench_verify.py --cpu    # torch reference and python loop rows on CPU (perf_counter medians)

Writes bench/results/verify-<device-slug>.{json,md}. Inputs are random logits whose candidates are planted to
follow the argmax chain (candidate 0 fully, the others 0..K tokens deep), so walks have realistic lengths.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

from _common import command_line, device_slug, machine_info, write_results  # noqa: E402

from lookahead.sampling import SamplingParams, warp_logits  # noqa: E402
from lookahead_kernels.verify_ref import (draw_verify_uniforms, verify_greedy_reference,  # noqa: E402
                                          verify_sample_reference)

GUESSES = (1, 7, 15)
NGRAMS = (3, 5)
VOCABS = (32000, 128256)


# ---- the original-style loops (baselines) ------------------------------------------------------------------------
def python_loop_greedy(x_logits, cand_logits, candidates):
    """Batch row 0: walk every candidate token by token, syncing on each comparison."""
    G, K = candidates.shape[1:]
    y0 = int(x_logits[0].argmax().item())
    best_len, best_c, best_bonus = 0, -1, y0
    for c in range(G):
        target, length = y0, 0
        for m in range(K):
            if int(candidates[0, c, m].item()) != target:
                break
            length += 1
            target = int(cand_logits[0, c, m].argmax().item())
        if length > best_len:
            best_len, best_c, best_bonus = length, c, target
    tokens = [int(t) for t in candidates[0, best_c, :best_len].tolist()] if best_len else []
    return best_len, best_c, tokens + [best_bonus]


def python_loop_sample(x_probs, cand_probs, candidates, generator):
    """Batch row 0: try candidates one by one, zeroing and renormalising the full row after each rejection."""
    G, K = candidates.shape[1:]
    p = x_probs[0].double().clone()
    live = list(range(G))
    tokens, best = [], -1
    for d in range(K):
        accepted = None
        for c in live:
            t = int(candidates[0, c, d].item())
            u = torch.rand((), generator=generator, device=p.device).item()
            if u < p[t].item():
                accepted = c
                break
            p[t] = 0
            p = p / p.sum()
        if accepted is None:
            tokens.append(int(torch.multinomial(p, 1, generator=generator).item()))
            return len(tokens) - 1, best, tokens
        t = int(candidates[0, accepted, d].item())
        tokens.append(t)
        best = accepted
        live = [c for c in live if int(candidates[0, c, d].item()) == t]
        p = cand_probs[0, accepted, d].double().clone()
        p = p / p.sum()
    tokens.append(int(torch.multinomial(p, 1, generator=generator).item()))
    return K, best, tokens


# ---- inputs ------------------------------------------------------------------------------------------------------
def make_inputs(G, K, V, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, V, generator=gen) * 4
    c = torch.randn(1, G, K, V, generator=gen) * 4
    cand = torch.randint(0, V, (1, G, K), generator=gen)
    y0, pred = x.argmax(-1), c.argmax(-1)
    for g in range(G):
        depth = K if g == 0 else int(torch.randint(0, K + 1, (1,), generator=gen))
        for m in range(depth):
            cand[0, g, m] = y0[0] if m == 0 else pred[0, g, m - 1]
    x, c, cand = x.to(device), c.to(device), cand.to(device)
    params = SamplingParams(temperature=1.0)
    return x, c, cand, warp_logits(x, params), warp_logits(c, params)


# ---- timing ------------------------------------------------------------------------------------------------------
def time_cpu(fn, min_reps=5, budget_s=0.5):
    fn()  # warm-up
    times = []
    start = time.perf_counter()
    while len(times) < min_reps or (time.perf_counter() - start < budget_s and len(times) < 1000):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6, len(times)


def time_gpu(fn):
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3, None


# ---- main --------------------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="run the torch reference and python loop rows on CPU")
    ap.add_argument("--out-dir", default=os.path.join(HERE, "results"))
    args = ap.parse_args(argv)
    on_gpu = torch.cuda.is_available() and not args.cpu
    if not on_gpu and not args.cpu:
        print("bench_verify: the Triton kernel rows need a CUDA GPU; none here. "
              "Run with --cpu for the torch reference and python loop rows on CPU.")
        return 0
    device = "cuda" if on_gpu else "cpu"
    timer = time_gpu if on_gpu else time_cpu
    if not on_gpu:
        torch.set_num_threads(1)  # steadier medians; these rows are single-stream work anyway
    if on_gpu:
        from lookahead_kernels.verify import verify_greedy, verify_sample

    rows = []
    for V in VOCABS:
        for N in NGRAMS:
            for G in GUESSES:
                K = N - 1
                x, c, cand, xp, cp = make_inputs(G, K, V, device)
                gen = torch.Generator(device=device).manual_seed(0)
                cases = {
                    ("greedy", "torch reference"): lambda: verify_greedy_reference(x, c, cand),
                    ("greedy", "python loop"): lambda: python_loop_greedy(x, c, cand),
                    ("sample", "torch reference"): lambda: verify_sample_reference(
                        xp, cp, cand, uniforms=draw_verify_uniforms(1, G, K, device, gen)),
                    ("sample", "python loop"): lambda: python_loop_sample(xp, cp, cand, gen),
                }
                if on_gpu:
                    cases[("greedy", "triton")] = lambda: verify_greedy(x, c, cand)
                    cases[("sample", "triton")] = lambda: verify_sample(xp, cp, cand, generator=gen)
                    ref, got = verify_greedy_reference(x, c, cand), verify_greedy(x, c, cand)
                    if not all(torch.equal(a, b) for a, b in zip(ref, got)):
                        raise RuntimeError(f"verify_greedy differs from its reference at V={V} N={N} G={G}")
                for (mode, method), fn in sorted(cases.items()):
                    us, reps = timer(fn)
                    rows.append({"mode": mode, "method": method, "vocab": V, "ngram": N, "guess": G, "K": K,
                                 "us": round(us, 2), "reps": reps})
                    print(f"{mode:6s} {method:16s} V={V:6d} N={N} G={G:2d}: {us:10.1f} us", flush=True)

    info = machine_info(device)  # at the end: its load average is the one the CPU rows ran under
    result = {"machine": info, "command": command_line(__file__, sys.argv[1:] if argv is None else argv),
              "timer": ("triton.testing.do_bench median" if on_gpu else "time.perf_counter median (CPU)"),
              "batch": 1, "dtype": "float32", "rows": rows}
    markdown = render_markdown(result)
    write_results(args.out_dir, f"verify-{device_slug(info)}", result, markdown)
    print(markdown)
    return 0


def render_markdown(result: dict) -> str:
    m = result["machine"]
    where = m.get("gpu") or f"CPU ({m['cpu']}, {m['cpu_count']} cores)"
    cpu_load = "gpu" not in m and m.get("load_average") is not None
    methods = sorted({r["method"] for r in result["rows"]})
    lines = ["# Verification of one lookahead step: microseconds per step", "",
             f"Device: {where}; torch {m['torch']}, triton {m['triton']}, CUDA {m['cuda']}, Python {m['python']}; "
             f"git {m['git']}." + (f" CPU load average at the end: {m['load_average']} ({m['torch_threads']} "
                                   "torch thread)." if cpu_load else ""), f"Command: `{result['command']}`. Timer: {result['timer']}. "
             f"B = {result['batch']}, {result['dtype']}, K = N - 1 tokens per candidate.", ""]
    if "triton" not in methods:
        lines += ["Triton kernel rows need a GPU and are absent here. Sampling rows include drawing the "
                  "random numbers.", ""]
    lines += ["| mode | vocab | N | G | " + " | ".join(f"{x} µs" for x in methods) + " |",
              "|---|---:|---:|---:|" + "---:|" * len(methods)]
    index = {(r["mode"], r["vocab"], r["ngram"], r["guess"], r["method"]): r["us"] for r in result["rows"]}
    keys = sorted({(r["mode"], r["vocab"], r["ngram"], r["guess"]) for r in result["rows"]})
    for mode, V, N, G in keys:
        vals = [index.get((mode, V, N, G, x)) for x in methods]
        lines.append(f"| {mode} | {V} | {N} | {G} | " + " | ".join("" if v is None else f"{v:.1f}" for v in vals)
                     + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
