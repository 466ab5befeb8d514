"""Cost of one CPU forward against the number of tokens fed, and plain decoding against transformers.

1. The curve: one forward of T tokens (a causal block, logits for every row) after a context of ``--context``
   committed tokens, for T in ``--T``, with the linear layers on plain ``F.linear`` ("torch"), on oneDNN-packed
   weights ("onednn") and on our small-M GEMM ("packed", the default; ``--variants`` picks among them). Each time is the minimum over ``--reps`` rounds, the
   variants and T interleaved within a round, so load from other processes shifts them alike.
2. Plain decoding (one token per forward, ``model.generate(ids, lookahead=None)``) with either linear path,
   and transformers' greedy ``generate`` on the same weights, on the first ``--prompts`` prompts of each dev
   set, ``--max-new-tokens`` tokens; tokens/s is new tokens over wall-clock seconds (prefill included), and
   every output is compared token for token with transformers'.

    python bench/bench_forward.py --threads 2                  # both parts, writes bench/results/forward-cpu.*
    python bench/bench_forward.py --threads 2 --no-decode      # the curve only
    python bench/bench_forward.py --repo /path/to/old/checkout --no-decode --tag base --label "base 1328d69"
    python bench/bench_forward.py --threads 2 --before bench/results/forward-base.json   # adds that curve

``--repo`` imports ``lookahead`` from another checkout (e.g. a ``git worktree`` of an older revision; a model
without ``set_cpu_linear`` is timed as it is, as variant "base"). ``--before`` adds such a run's curve to the
table and plot. Writes ``bench/results/forward-<tag>.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import _common  # noqa: E402

DEFAULT_SETS = _common.DEFAULT_SETS
DEFAULT_T = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128]


def warm_up(model, tok, context, cache):
    """One untimed single-token forward: packs the weights after a switch of linear path."""
    import torch
    from lookahead_kernels import StepLayout

    with torch.inference_mode():
        model(tok, torch.tensor([[context]]), cache, context, StepLayout.prefill(1))


def curve(model, variants, Ts, context, reps):
    """{variant: {T: seconds}} (minimum over rounds) and the medians alongside."""
    import torch
    from lookahead_kernels import StepLayout

    cache = model.new_cache(1, context + max(Ts) + 1)
    # The context's keys/values: any finite values cost the same; a prefill makes them realistic.
    ids = torch.randint(0, model.config.vocab_size, (1, context + max(Ts)), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        model(ids[:, :context], torch.arange(context)[None], cache, 0, StepLayout.prefill(context),
              torch.tensor([context - 1]))
    samples = {v: {T: [] for T in Ts} for v in variants}
    with torch.inference_mode():
        for r in range(reps + 1):  # round 0 warms up (and packs the weights)
            for v in variants:
                if v != "base":
                    model.set_cpu_linear(v)
                    warm_up(model, ids[:, context:context + 1], context, cache)  # switching may repack
                for T in Ts:
                    tok, pos = ids[:, context:context + T], torch.arange(context, context + T)[None]
                    t0 = time.perf_counter()
                    model(tok, pos, cache, context, StepLayout.prefill(T))
                    if r:
                        samples[v][T].append(time.perf_counter() - t0)
            print(f"round {r}/{reps}: " + "  ".join(
                f"{v} t(1)={min(samples[v][Ts[0]] or [float('nan')]) * 1e3:.1f}ms" for v in variants), file=sys.stderr)
    if variants != ["base"]:
        model.set_cpu_linear("packed")
    # t(T)/t(1) within each round (its T = 1 run seconds apart), then the median over rounds: the minima above
    # come from different moments, and t(1), bound by memory, moves with the host's bandwidth more than t(16).
    ratios = {v: {T: statistics.median(a / b for a, b in zip(d[T], d[Ts[0]])) for T in Ts} for v, d in samples.items()}
    return ({v: {T: min(s) for T, s in d.items()} for v, d in samples.items()},
            {v: {T: statistics.median(s) for T, s in d.items()} for v, d in samples.items()}, ratios)


def decode(model, tokenizer, sets, prompts_per_set, max_new_tokens, variants):
    import torch

    from lookahead.cli import read_prompts

    hf = _common.hf_default_model()
    rows = []
    for set_path in sets:
        name = os.path.splitext(os.path.basename(set_path))[0]
        for i, ids in enumerate(read_prompts(set_path, tokenizer)[:prompts_per_set]):
            row = {"set": name, "index": i, "prompt_tokens": ids.shape[1]}
            outs = {}
            for v in variants:
                model.set_cpu_linear(v)
                model.generate(ids[:, :8], max_new_tokens=1, lookahead=None)  # untimed: packs after a switch
                t0 = time.perf_counter()
                out = model.generate(ids, max_new_tokens=max_new_tokens, lookahead=None)
                secs = time.perf_counter() - t0
                new = out.sequences.shape[1] - ids.shape[1]
                outs[v] = out.sequences[0, ids.shape[1]:].tolist()
                row[f"ours_{v}_tokens_per_s"] = new / secs
                row[f"ours_{v}_new_tokens"] = new
            with torch.inference_mode():
                t0 = time.perf_counter()
                seq = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                  do_sample=False, pad_token_id=tokenizer.eos_token_id)
                secs = time.perf_counter() - t0
            hf_new = seq[0, ids.shape[1]:].tolist()
            row["hf_tokens_per_s"] = len(hf_new) / secs
            row["hf_new_tokens"] = len(hf_new)
            for v in variants:
                row[f"ours_{v}_identical_to_hf"] = outs[v] == hf_new
            print(f"{name}[{i}]: " + "  ".join(f"{k}={row[k]:.1f}" for k in row if k.endswith("per_s"))
                  + f"  identical={[row[f'ours_{v}_identical_to_hf'] for v in variants]}", file=sys.stderr)
            rows.append(row)
    model.set_cpu_linear("packed")
    return rows


def markdown(result: dict) -> str:
    info = result["machine"]
    lines = [f"# CPU forward: cost against tokens fed, and plain decoding", "",
             f"`{result['command']}`", "",
             f"{info['cpu']}, {result['threads']} torch threads, torch {info['torch']}, git {info['git']}, "
             f"load average before/after {info['load_average']} / {result['load_average_after']}. "
             f"SmolLM2-135M-Instruct, float32. Forward: T new tokens in one causal block after a context of "
             f"{result['context']} tokens, logits for all T rows; minimum of {result['reps']} interleaved rounds "
             f"(medians in the JSON).", ""]
    curves = dict(result["curve_min"])
    labels = {"torch": "F.linear", "onednn": "oneDNN packed (before)", "packed": "small GEMM (after)",
              "base": "base"}
    for name, before in result.get("before", {}).items():
        curves[name] = before
        labels[name] = name
    Ts = result["T"]
    head = "| T | " + " | ".join(f"{labels.get(v, v)} ms | t(T)/t(1)" for v in curves) + " |"
    lines += ["## t(T)", "", head, "|" + "---|" * (1 + 2 * len(curves))]
    for T in Ts:
        cells = []
        for v, c in curves.items():
            t, t1 = c.get(str(T), c.get(T)), c.get(str(Ts[0]), c.get(Ts[0]))
            cells.append("-" if t is None else f"{t * 1e3:.1f} | {t / t1:.2f}")
        lines.append(f"| {T} | " + " | ".join(cells) + " |")
    if result.get("ratio_median"):
        paired = result["ratio_median"]
        lines += ["", "## t(T)/t(1) within a round", "",
                  "Each round's t(T) over the same round's t(1), the median over rounds (the table above divides "
                  "minima taken at different moments).", "",
                  "| T | " + " | ".join(labels.get(v, v) for v in paired) + " |", "|---|" + "---|" * len(paired)]
        for T in Ts:
            lines.append(f"| {T} | " + " | ".join(f"{paired[v].get(str(T), paired[v].get(T)):.2f}" for v in paired)
                         + " |")
    rows = result.get("decode", [])
    if rows:
        variants = result["decode_variants"]
        lines += ["", "## Plain decoding, tokens/s", "",
                  f"First {result['prompts_per_set']} prompts of each dev set, {result['max_new_tokens']} new tokens, "
                  "one token per forward; wall-clock with the prefill. *identical*: the same tokens as transformers.",
                  "", "| prompt | " + " | ".join(f"ours ({labels[v]})" for v in variants)
                  + " | transformers greedy | identical |", "|---|" + "---|" * (len(variants) + 2)]
        for r in rows:
            lines.append(f"| {r['set']}[{r['index']}] | " + " | ".join(f"{r[f'ours_{v}_tokens_per_s']:.1f}"
                                                                        for v in variants)
                         + f" | {r['hf_tokens_per_s']:.1f} | "
                         + " ".join("yes" if r[f"ours_{v}_identical_to_hf"] else "no" for v in variants) + " |")
        mean = {v: statistics.mean(r[f"ours_{v}_tokens_per_s"] for r in rows) for v in variants}
        hf = statistics.mean(r["hf_tokens_per_s"] for r in rows)
        lines.append("| **mean** | " + " | ".join(f"**{mean[v]:.1f}** ({mean[v] / hf:.2f}x)" for v in variants)
                     + f" | **{hf:.1f}** | " + " ".join(
                         f"{sum(r[f'ours_{v}_identical_to_hf'] for r in rows)}/{len(rows)}" for v in variants) + " |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> None:
    plt = _common.pyplot()
    if plt is None:
        return
    curves = dict(result["curve_min"])
    curves.update(result.get("before", {}))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    for v, c in curves.items():
        Ts = sorted(int(T) for T in c)
        t = [c.get(str(T), c.get(T)) * 1e3 for T in Ts]
        ax1.plot(Ts, t, marker="o", label=v)
        ax2.plot(Ts, [x / t[0] for x in t], marker="o", label=v)
    ax1.set_xlabel("tokens fed T")
    ax1.set_ylabel("forward ms")
    ax2.set_xlabel("tokens fed T")
    ax2.set_ylabel("t(T) / t(1)")
    ax2.axhline(1.3, color="gray", lw=0.8, ls="--")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(f"SmolLM2-135M fp32 forward on CPU ({result['threads']} threads, context {result['context']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--T", type=int, nargs="+", default=DEFAULT_T)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--no-decode", action="store_true", help="only the t(T) curve")
    ap.add_argument("--sets", nargs="+", default=DEFAULT_SETS)
    ap.add_argument("--prompts", type=int, default=3, help="prompts per set for the decoding comparison")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--variants", nargs="+", default=["torch", "onednn", "packed"],
                    help="linear paths to time (those the model knows; an older checkout may lack some)")
    ap.add_argument("--repo", help="import lookahead from this checkout instead")
    ap.add_argument("--before", nargs="*", default=[], help="results JSON of other runs whose curves to add")
    ap.add_argument("--label", help="name of this run's curve when another run adds it with --before")
    ap.add_argument("--tag", default="cpu")
    ap.add_argument("--out-dir", default=os.path.join(HERE, "results"))
    args = ap.parse_args(argv)
    if args.threads < 1 or args.context < 1 or args.reps < 1 or min(args.T) < 1:
        ap.error("--threads, --context, --reps and every --T must be >= 1")
    sys.path.insert(0, os.path.abspath(args.repo) if args.repo else _common.ROOT)

    import torch

    import lookahead

    torch.set_num_threads(args.threads)
    info = _common.machine_info("cpu", root=args.repo)  # the revision whose code runs
    model, tokenizer = lookahead.load_default()
    model.eval()
    if hasattr(model, "set_cpu_linear"):
        from lookahead import cpu_linear
        known = getattr(cpu_linear, "CPU_LINEAR_MODES", ("packed", "torch"))
        variants = [v for v in args.variants if v in known]
        if "packed" in variants and hasattr(cpu_linear, "gemm_available") and not cpu_linear.gemm_available():
            print(f"note: the CPU GEMM is unavailable ({cpu_linear.gemm_error()}); 'packed' runs on oneDNN",
                  file=sys.stderr)
    else:
        variants = ["base"]
    cmin, cmed, cratio = curve(model, variants, sorted(args.T), args.context, args.reps)
    result = {"command": _common.command_line(__file__, sys.argv[1:] if argv is None else argv),
              "machine": info, "threads": args.threads, "context": args.context, "reps": args.reps,
              "T": sorted(args.T), "repo": args.repo, "label": args.label, "curve_min": cmin, "curve_median": cmed,
              "ratio_median": cratio}
    for path in args.before:
        with open(path) as f:
            other = json.load(f)
        for v, c in other["curve_min"].items():
            name = other.get("label") or f"{v} @ {other['machine']['git']}"
            result.setdefault("before", {})[name] = c
    if not args.no_decode and variants != ["base"]:
        result["decode_variants"] = variants
        result["prompts_per_set"] = args.prompts
        result["max_new_tokens"] = args.max_new_tokens
        result["decode"] = decode(model, tokenizer, args.sets, args.prompts, args.max_new_tokens, variants)
    try:
        result["load_average_after"] = [round(v, 2) for v in os.getloadavg()]
    except OSError:
        result["load_average_after"] = None
    md = markdown(result)
    print(md)
    base = _common.write_results(args.out_dir, f"forward-{args.tag}", result, md)
    plot(result, base + ".png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
