"""Attention of one lookahead step at 7B/8B shape in bf16 on a GPU: our kernel against SDPA with a dense mask and
compiled FlexAttention, T = 120, committed contexts 1k to 32k (FlexAttention only at ``--flex-contexts``, default
4k and 16k: each shape costs a compile of seconds).

Steps: ``(15, 5, 15)`` (window 15, 4 levels, 15 linear guesses of 4: T = 120) and ``(15, 5, tree 60)`` (the
same window beside a random tree of 60 nodes: T = 120). Rows are measured most-wanted first (7B shape, 4k
context: the issue's target) and written after each, so a time box keeps what was done. The per-row work is
``bench_attention.run_config`` (do_bench_cudagraph medians; errors against ``attention_torch``).

    python bench/gpu_kernels.py --out-dir $OUT/work
    python bench/gpu_kernels.py --dry-run --out-dir /tmp/x    # tiny shapes, Triton interpreter on the CPU

Writes ``kernels-<device>.{json,md}``.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from gpu_util import (ResultFile, add_device_args, header, interpret_kernels_on_cpu, parse_dtype,  # noqa: E402
                      pick_device)

MODELS = [("llama2-7b", 32, 32, 128), ("llama3-8b", 32, 8, 128)]
STEPS = [(15, 5, 15), (15, 5, 60, "tree")]
CONTEXTS = [4096, 1024, 16384, 32768]  # 4k first: the target row
FLEX_CONTEXTS = [4096, 16384]
DRY = dict(models=[("tiny-mha", 2, 2, 64), ("tiny-gqa", 4, 2, 64)], steps=[(3, 3, 2), (3, 3, 7, "tree")],
           contexts=[16, 70])


def order(models, steps, contexts):
    """(model, step, context) with the 7B / (15, 5, 15) / first-context row first, then by context."""
    return [(m, s, c) for c in contexts for m in models for s in steps]


def render(result: dict) -> str:
    from bench_attention import step_name

    m = result["machine"]
    lines = [f"# Step attention at 7B/8B shape, {result.get('dtype')}", "",
             f"Device: {result['device']}; torch {m['torch']}, triton {m['triton']}; git {m['git']}.",
             f"Command: `{result['command']}`", f"Copy bandwidth: {result.get('copy_gbs', 0):.0f} GB/s.", "",
             "µs of device time per call: each call captured in a CUDA graph and replayed "
             "(`triton.testing.do_bench_cudagraph` median), as a decoding step replayed from a graph pays it. "
             "`ours launched`: our kernel called from Python (`do_bench` median: the host's launch cost, which "
             "graphs remove). × sdpa: SDPA with a prebuilt dense mask over ours; × flex: compiled flex_attention "
             "with a prebuilt block mask over ours.", "",
             "| model | step | T | context | splits | ours µs | ours launched µs | sdpa µs | sdpa+mask µs | flex µs | "
             "flex+mask µs | ours GB/s | × sdpa | × flex | err ours | err flex |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def us(v):
        return "—" if v is None else f"{v * 1e3:.1f}"

    for r in result["rows"]:
        t = r["ms"]
        ours = t.get("ours")
        gbs = f"{r['bytes'] / (ours * 1e-3) / 1e9:.0f}" if ours else "—"
        xs = f"{t['sdpa'] / ours:.2f}" if ours and t.get("sdpa") else "—"
        xf = f"{t['flex'] / ours:.2f}" if ours and t.get("flex") else "—"
        ef = r.get("rel_err_flex_vs_torch")
        lines.append(f"| {r['model']} | {step_name(r['W_N_G'])} | {r['T']} | {r['cache_len']} | {r.get('num_splits')} "
                     f"| {us(ours)} | {us(t.get('ours launched'))} | {us(t.get('sdpa'))} | {us(t.get('sdpa+mask'))} | {us(t.get('flex'))} | "
                     f"{us(t.get('flex+mask'))} | {gbs} | {xs} | {xf} | {r.get('rel_err_vs_torch', 0):.1e} | "
                     f"{'—' if ef is None else f'{ef:.1e}'} |")
    for r in result["rows"]:
        if r.get("launched"):
            lines.append(f"- {r['model']} {step_name(r['W_N_G'])} context {r['cache_len']}: "
                         f"{', '.join(r['launched'])} could not be captured in a graph: timed as launched")
        for what, msg in r.get("errors", {}).items():
            if "not timed at this context" in msg:
                continue
            if what == "flex gqa":
                lines.append(f"- {r['model']} {step_name(r['W_N_G'])} context {r['cache_len']}: flex with enable_gqa "
                             f"failed to compile, timed with K/V heads repeated instead ({msg[:120]})")
                continue
            lines.append(f"- {r['model']} {r['W_N_G']} context {r['cache_len']}: {what} failed: {msg}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=CONTEXTS)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--flex-contexts", type=int, nargs="*", default=FLEX_CONTEXTS,
                    help="contexts at which FlexAttention is timed too (each shape is a compile of seconds)")
    add_device_args(ap, "tiny shapes on the CPU under Triton's interpreter")
    args = ap.parse_args(argv)
    device = pick_device(args.dry_run, args.device)
    interpret_kernels_on_cpu(device)  # before the kernels are defined
    from torch.nn.attention.flex_attention import flex_attention

    from bench_attention import copy_bandwidth_gbs, cpu_timer, cuda_timer, run_config, step_name

    dtype = parse_dtype(args.dtype)
    models, steps, contexts = MODELS, STEPS, args.contexts
    if args.dry_run:
        models, steps, contexts = DRY["models"], DRY["steps"], DRY["contexts"]
    timer = cuda_timer if device.type == "cuda" else cpu_timer
    if device.type == "cuda":
        import torch._dynamo as dynamo  # one compiled flex kernel per shape: allow more than the default 8

        for knob in ("recompile_limit", "cache_size_limit"):
            if hasattr(dynamo.config, knob):
                setattr(dynamo.config, knob, 64)
        flex_fn = torch.compile(flex_attention, dynamic=False)
    else:
        flex_fn = flex_attention  # eager on the CPU: compiling is slow and beside the point of a dry run

    def no_flex(*a, **k):
        raise RuntimeError("not timed at this context (--flex-contexts)")

    flex_contexts = set(contexts if args.dry_run else args.flex_contexts)
    head = header(device, sys.argv[1:] if argv is None else argv, __file__)
    head.update(dtype=str(dtype).replace("torch.", ""), dry_run=args.dry_run)
    out = ResultFile(args.out_dir, f"kernels-{head['device_slug']}" + ("-dry-run" if args.dry_run else ""), head,
                     render)
    out.result["copy_gbs"] = copy_bandwidth_gbs(device, timer)
    if args.dry_run:
        out.note("dry run: tiny shapes, Triton interpreter on the CPU; checks the plumbing only")
    for model, step, context in order(models, steps, contexts):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # flex's eager-mode warning on the CPU
            try:
                row = run_config(model, step, context, device, dtype, timer,
                                 flex_fn if context in flex_contexts else no_flex)
            except Exception as exc:  # one shape failing (memory, compile) must not lose the others
                out.note(f"{model[0]} {step_name(step)} context {context}: {type(exc).__name__}: {exc}"[:400])
                continue
        out.add(row)
        t = row["ms"]
        print(f"{row['model']:10s} {step_name(step)} context {context:6d}: ours {t['ours'] * 1e3:.1f} us  "
              f"sdpa {t['sdpa'] * 1e3:.1f} us  flex {t['flex'] * 1e3 if 'flex' in t else float('nan'):.1f} us  "
              f"err {row['rel_err_vs_torch']:.1e}", flush=True)
        if row["rel_err_vs_torch"] > 2e-2:
            out.note(f"WARNING: {row['model']} {step_name(step)} context {context}: ours differs from "
                     f"attention_torch by {row['rel_err_vs_torch']:.2e}")
    out.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
