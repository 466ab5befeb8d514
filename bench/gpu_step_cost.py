"""Step latency ``t(T)`` of our model at Llama-2-7B and Llama-3-8B shape (random weights, bf16) on a GPU.

For each model, context ``L`` (committed rows) and step size ``T``: one forward of a step of ``T`` tokens laid
out as the automatic mode would (:func:`lookahead.config.shape_for_budget`: a tree alone below 64 tokens, a
window of 3 levels beside a tree from 64 on; ``T = 1`` is a plain step), logits for every row. Timed

* ``eager``: the forward as ``generate`` runs it today (``cache_len`` a Python int), CUDA events per call;
* ``graph``: the same forward captured in a CUDA graph (``cache_len`` a device tensor, as a static-buffer runner
  holds it) and replayed; the launch overhead of the eager loop is gone here.

Also plain decoding against the bandwidth limit: tokens/s = 1 / t(1) against (bytes of weights + keys and values
read per token) / (measured device-to-device copy bandwidth).

    python bench/gpu_step_cost.py --out-dir $OUT/work            # GPU: both models, T and contexts below
    python bench/gpu_step_cost.py --dry-run --out-dir /tmp/x      # tiny models on the CPU: plumbing only

Writes ``step-cost-<device>.{json,md}`` after every row, and a plot of ``t(T) / t(1)`` (``.png``) at the end;
``--render JSON`` draws them again from a results file.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _common import pyplot, render as render_files  # noqa: E402
from gpu_util import (DRY_MODELS, ResultFile, add_device_args, capture_graph, copy_bandwidth_gbs, header,  # noqa: E402
                      kv_bytes_per_token, parse_dtype, pick_device, random_model, synchronize, time_ms,
                      weight_bytes_per_token)

STEP_SIZES = [1, 16, 32, 64, 120, 200, 256]
CONTEXTS = [1024, 4096, 16384]
MODELS = ["llama2-7b", "llama3-8b"]


def step_layout(T: int, device):
    """The layout of a ``T``-token step as the automatic mode shapes it (random bushy tree)."""
    from bench_attention import bench_tree

    from lookahead.config import shape_for_budget
    from lookahead_kernels import StepLayout

    if T == 1:
        return StepLayout(1, 1)
    shape = shape_for_budget(T)
    tree = bench_tree(shape.tree_budget).to(device) if shape.tree_budget else None
    layout = StepLayout(shape.window, shape.levels, tree)
    assert layout.T == T, (T, layout)
    return layout


def measure(model, context: int, T: int, reps: int, graphs: bool, device) -> dict:
    """Eager and graph-replayed milliseconds of one ``T``-token step at ``context`` committed rows."""
    layout = step_layout(T, device)
    cache = model.new_cache(1, context + T)
    # Random keys and values: the kernels read every committed row whatever it holds, but never test on zeros.
    gen = torch.Generator(device=device).manual_seed(context + T)
    for buf in (cache.k, cache.v):
        buf.normal_(0.0, 1.0, generator=gen)
    ids = torch.randint(0, model.config.vocab_size, (1, T), device=device, generator=gen)
    positions = (context + layout.position_offsets(device))[None] if layout.tree is None or not layout.tree.batched \
        else context + layout.position_offsets(device)
    rows = torch.arange(T, device=device)
    row = {"context": context, "T": T, "layout": f"W={layout.window} N-1={layout.levels} tree={layout.tree_size}"}
    with torch.inference_mode():
        row["eager_ms"] = time_ms(lambda: model(ids, positions, cache, context, layout, rows), device, reps)
        if graphs:
            lens = torch.full((1,), context, dtype=torch.long, device=device)
            try:
                graph, _ = capture_graph(lambda: model(ids, positions, cache, lens, layout, rows), device)
                row["graph_ms"] = time_ms(graph.replay, device, reps=max(reps, 20))
                del graph
            except Exception as exc:  # capture can fail (a host sync, an allocation): keep the eager figure
                row["graph_ms"] = None
                row["graph_error"] = f"{type(exc).__name__}: {exc}"[:400]
    del cache
    return row


def _ms(row: dict) -> float:
    """A step row's time: its graph replay where one was captured, else the eager call."""
    return row.get("graph_ms") or row["eager_ms"]


def _one_token_ms(rows: list) -> dict:
    """``t(1)`` per ``(model, context)`` among the step rows, for the ratios the table and the plot give."""
    return {(r["model"], r["context"]): _ms(r) for r in rows if r.get("T") == 1}


def render(result: dict) -> str:
    m = result["machine"]
    lines = [f"# Step latency t(T), random weights, {result.get('dtype')}", "",
             f"Device: {result['device']}; torch {m['torch']}, triton {m['triton']}, CUDA {m['cuda']}; git {m['git']}.",
             f"Command: `{result['command']}`",
             f"Copy bandwidth (read + write): {result.get('copy_gbs', 0):.0f} GB/s.", "",
             "| model | context | T | layout | eager ms | graph ms | t(T)/t(1) (graph, else eager) |",
             "|---|---:|---:|---|---:|---:|---:|"]
    base = _one_token_ms(result["rows"])
    for r in result["rows"]:
        if "T" not in r:
            continue
        t1 = base.get((r["model"], r["context"]))
        ratio = f"{_ms(r) / t1:.2f}" if t1 else "—"
        graph = f"{r['graph_ms']:.3f}" if r.get("graph_ms") else ("failed" if "graph_error" in r else "—")
        lines.append(f"| {r['model']} | {r['context']} | {r['T']} | {r['layout']} | {r['eager_ms']:.3f} | {graph} "
                     f"| {ratio} |")
    plain = [r for r in result["rows"] if r.get("kind") == "plain-vs-bandwidth"]
    if plain:
        lines += ["", "Plain decoding against the bandwidth limit (bytes of weights + KV read per token / copy "
                  "bandwidth):", "",
                  "| model | context | MB per token | limit tokens/s | ours tokens/s (graph) | ours tokens/s (eager) "
                  "| % of limit (graph) |", "|---|---:|---:|---:|---:|---:|---:|"]
        for r in plain:
            g = f"{r['graph_tokens_per_s']:.1f}" if r.get("graph_tokens_per_s") else "—"
            pct = f"{100 * r['graph_tokens_per_s'] / r['limit_tokens_per_s']:.0f}" if r.get("graph_tokens_per_s") \
                else "—"
            lines.append(f"| {r['model']} | {r['context']} | {r['bytes_per_token'] / 1e6:.0f} | "
                         f"{r['limit_tokens_per_s']:.1f} | {g} | {r['eager_tokens_per_s']:.1f} | {pct} |")
    for r in result["rows"]:
        if r.get("graph_error"):
            lines.append(f"- {r['model']} context {r['context']} T={r['T']}: graph capture failed: {r['graph_error']}")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> None:
    """One panel a model: ``t(T) / t(1)`` against ``T``, a line a context (graph replays, else eager), with issue
    11's bound on ``t(120) / t(1)`` (1.35)."""
    plt = pyplot()
    rows = [r for r in result["rows"] if "T" in r]
    if plt is None or not rows:
        return
    base = _one_token_ms(rows)
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False, sharey=True)
    for ax, model in zip(axes[0], models):
        for context in dict.fromkeys(r["context"] for r in rows if r["model"] == model):
            t1 = base.get((model, context))
            pts = [r for r in rows if r["model"] == model and r["context"] == context]
            if t1:
                ax.plot([r["T"] for r in pts], [_ms(r) / t1 for r in pts], marker="o", label=f"context {context}")
        ax.axhline(1.35, color="gray", linestyle=":", linewidth=1)
        ax.axvline(120, color="gray", linestyle=":", linewidth=1)
        ax.set_title(model, fontsize=9)
        ax.set_xlabel("tokens a step, T")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("t(T) / t(1)")
    m = result["machine"]
    fig.suptitle(f"One step of T tokens against one of 1: {result['device']}, {result.get('dtype')}, "
                 f"git {m.get('git')} (dotted: t(120) / t(1) = 1.35)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--render", metavar="JSON", help="only re-write the markdown and plot of a results file")
    ap.add_argument("--models", nargs="+", default=MODELS)
    ap.add_argument("--T", type=int, nargs="+", help=f"step sizes (default {STEP_SIZES}; dry run 1 16 64 120)")
    ap.add_argument("--contexts", type=int, nargs="+", help=f"committed rows (default {CONTEXTS}; dry run 64 200)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--reps", type=int, help="timed calls per row (default 10; dry run 2)")
    ap.add_argument("--no-graphs", action="store_true", help="eager timings only")
    add_device_args(ap, "tiny models, short contexts, on the CPU")
    args = ap.parse_args(argv)
    if args.render:
        render_files(args.render, render, plot)
        return 0
    device = pick_device(args.dry_run, args.device)
    dtype = parse_dtype(args.dtype)
    models = [DRY_MODELS.get(m, m) for m in args.models] if args.dry_run else args.models
    contexts = args.contexts or ([64, 200] if args.dry_run else CONTEXTS)
    steps = args.T or ([1, 16, 64, 120] if args.dry_run else STEP_SIZES)
    reps = args.reps or (2 if args.dry_run else 10)
    if args.dry_run and device.type == "cpu":
        dtype = torch.float32  # bf16 matmuls on a CPU are slow and beside the point of a dry run
    graphs = device.type == "cuda" and not args.no_graphs
    head = header(device, sys.argv[1:] if argv is None else argv, __file__)
    head.update(dtype=str(dtype).replace("torch.", ""), dry_run=args.dry_run)
    out = ResultFile(args.out_dir, f"step-cost-{head['device_slug']}" + ("-dry-run" if args.dry_run else ""), head,
                     render, plot)
    out.result["copy_gbs"] = bw = copy_bandwidth_gbs(device)
    print(f"{head['device']}: copy bandwidth {bw:.0f} GB/s", flush=True)
    if args.dry_run:
        out.note("dry run: tiny models on the CPU; checks the plumbing only, the times mean nothing")
    for name in models:
        model = random_model(name, dtype, device)
        synchronize(device)
        wbytes = weight_bytes_per_token(model)
        print(f"{name}: {wbytes / 1e9:.2f} GB of weights read per token", flush=True)
        for context in contexts:
            for T in steps:
                row = dict(model=name, **measure(model, context, T, reps, graphs, device))
                out.add(row)
                print(f"{name} context {context:6d} T {T:4d}: eager {row['eager_ms']:.3f} ms  graph "
                      f"{row.get('graph_ms')}", flush=True)
                if T == 1:
                    nbytes = wbytes + kv_bytes_per_token(model, context)
                    out.add({"kind": "plain-vs-bandwidth", "model": name, "context": context,
                             "bytes_per_token": nbytes, "limit_tokens_per_s": bw * 1e9 / nbytes,
                             "eager_tokens_per_s": 1e3 / row["eager_ms"],
                             "graph_tokens_per_s": 1e3 / row["graph_ms"] if row.get("graph_ms") else None})
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    out.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
