"""Compression of the draft tree against tokens fed per step, source by source, on the dev prompt sets.

For each prompt set, each system (a tuple of tree sources) and each step budget (``max_step_tokens``), every
prompt is decoded greedily with lookahead and compared token for token with our plain greedy output.
Compression = new tokens / forward passes after the prefill; ``fed/step`` = ``stats.fed_tokens / stats.steps``.
Compression depends on the model and the prompts, not on the machine, so this runs on a CPU.

Peer row: transformers' prompt lookup (``generate(prompt_lookup_num_tokens=10)``, greedy) on the same weights;
its forward passes are counted with a forward hook on the transformers model.

    python bench/bench_tree.py --limit 10 --tag cpu-10          # the scaling plot on 10 prompts per set
    python bench/bench_tree.py --budgets 16 120 --systems all --peers hf-prompt-lookup --tag cpu-full

Writes bench/results/tree-<tag>.{json,md,png}.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from _common import (DEFAULT_SETS, command_line, hf_default_model, machine_info, pyplot, read_results,  # noqa: E402
                     set_name)

from lookahead import LookaheadConfig, load_default  # noqa: E402
from lookahead.cli import read_prompts  # noqa: E402

SYSTEMS = {"pool": ("pool",), "suffix": ("suffix",), "successors": ("successors",),
           "all": ("pool", "suffix", "successors")}
DEFAULT_BUDGETS = [8, 16, 32, 64, 120, 200]


def hf_prompt_lookup(hf_model, prompts, max_new_tokens: int, plain_outputs) -> dict:
    """transformers' prompt lookup on ``prompts``: mean compression and outputs identical to ours."""
    calls = [0]
    handle = hf_model.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    comps, same = [], 0
    try:
        for ids, plain in zip(prompts, plain_outputs):
            calls[0] = 0
            out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                    do_sample=False, prompt_lookup_num_tokens=10, pad_token_id=0)
            new = out.shape[1] - ids.shape[1]
            comps.append(new / max(calls[0] - 1, 1))  # the first call is the prefill (it also yields a token)
            same += int(out[0, : plain.shape[1]].equal(plain[0]) and out.shape[1] == plain.shape[1])
    finally:
        handle.remove()
    return {"compression": statistics.mean(comps), "identical": same, "prompts": len(prompts),
            "per_prompt": comps}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sets", nargs="+", default=DEFAULT_SETS, help="prompt files (JSONL)")
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=list(SYSTEMS))
    ap.add_argument("--budgets", nargs="+", type=int, default=DEFAULT_BUDGETS, help="max_step_tokens values")
    ap.add_argument("--peers", nargs="*", default=["hf-prompt-lookup"], choices=["hf-prompt-lookup"])
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--start", type=int, default=0, help="first prompt of each set")
    ap.add_argument("--limit", type=int, default=None, help="prompts per set")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tag", default="cpu")
    ap.add_argument("--out-dir", default=os.path.join(HERE, "results"))
    ap.add_argument("--render", metavar="JSON", help="only re-write the markdown and plot of a results file")
    ap.add_argument("--linear", metavar="JSON", help="with --render: add the rows of a bench_compression.py run of "
                    "the original linear lookahead (W,N,G configurations; their budget is W*(N-1) + G*(N-1))")
    args = ap.parse_args(argv)
    if args.render:
        result, base = read_results(args.render)
        if args.linear:
            result["rows"] = [r for r in result["rows"] if not r["system"].startswith("linear")]
            result["rows"] += linear_rows(args.linear)
            result["linear_source"] = os.path.relpath(args.linear, os.path.dirname(HERE))
            with open(args.render, "w") as f:
                json.dump(result, f, indent=1)
        write_markdown(result, base + ".md")
        plot(result, base + ".png")
        return 0
    from tqdm.auto import tqdm

    torch.set_num_threads(args.threads)
    machine = machine_info("cpu")  # at the start: the revision that runs, whatever is committed meanwhile
    model, tokenizer = load_default()
    hf_model = None
    if args.peers:
        hf_model = hf_default_model()
    rows = []
    for set_path in args.sets:
        prompts = read_prompts(set_path, tokenizer)
        stop = None if args.limit is None else args.start + args.limit
        prompts = prompts[args.start: stop]
        name = set_name(set_path)
        plain = [model.generate(ids, max_new_tokens=args.max_new_tokens, lookahead=None).sequences
                 for ids in tqdm(prompts, desc=f"{name} plain", leave=False)]
        for system in args.systems:
            for budget in args.budgets:
                cfg = LookaheadConfig(max_step_tokens=budget, sources=SYSTEMS[system])
                comps, same, fed, steps = [], 0, 0, 0
                by_source = collections.Counter()
                for ids, ref in zip(tqdm(prompts, desc=f"{name} {system} T={budget}", leave=False), plain):
                    out = model.generate(ids, max_new_tokens=args.max_new_tokens, lookahead=cfg, trace=True)
                    comps.append(out.stats.compression_ratio)
                    same += int(out.sequences.equal(ref))
                    fed, steps = fed + out.stats.fed_tokens, steps + out.stats.steps
                    for tr in out.stats.trace:
                        for node in tr.path:
                            by_source.update(tr.sources[node])
                row = {"set": name, "system": system, "budget": budget, "compression": statistics.mean(comps),
                       "identical": same, "prompts": len(prompts), "fed_per_step": fed / steps,
                       "accepted_by_source": dict(by_source), "per_prompt": comps}
                rows.append(row)
                print(f"{name:10s} {system:10s} T={budget:3d} compression {row['compression']:.3f} "
                      f"fed/step {row['fed_per_step']:.1f} identical {same}/{len(prompts)}", flush=True)
        if hf_model is not None:
            peer = hf_prompt_lookup(hf_model, prompts, args.max_new_tokens, plain)
            rows.append({"set": name, "system": "hf-prompt-lookup", "budget": None, **peer})
            print(f"{name:10s} hf-prompt-lookup compression {peer['compression']:.3f} "
                  f"identical {peer['identical']}/{len(prompts)}", flush=True)
    machine["load_average_end"] = machine_info("cpu")["load_average"]
    result = {"device": "cpu", "machine": machine, "command": command_line(__file__, sys.argv[1:]),
              "model": "SmolLM2-135M-Instruct (float32)", "max_new_tokens": args.max_new_tokens,
              "start": args.start, "limit": args.limit, "rows": rows}
    os.makedirs(args.out_dir, exist_ok=True)
    base = os.path.join(args.out_dir, f"tree-{args.tag}")
    with open(base + ".json", "w") as f:
        json.dump(result, f, indent=1)
    write_markdown(result, base + ".md")
    plot(result, base + ".png")
    print(f"wrote {base}.json, .md, .png")
    return 0


def linear_rows(path: str) -> list[dict]:
    """Rows of the original linear lookahead from a ``bench_compression.py`` results file."""
    with open(path) as f:
        old = json.load(f)
    label = f"linear ({old['machine'].get('git', '?')})"
    rows = []
    for set_key, per_set in old["sets"].items():
        for key, c in per_set["configs"].items():
            w, n, g = (int(v) for v in key.split(","))
            budget = (w + g) * (n - 1)
            # The original step fed W*(N-1) tokens plus (N-1) per candidate found, at most the budget.
            rows.append({"set": set_name(set_key), "system": label, "budget": budget, "config": key,
                         "fed_per_step": None, "compression": c["mean_compression"], "identical": c["identical"],
                         "prompts": c["prompts"]})
    return rows


def write_markdown(result: dict, path: str) -> None:
    m = result["machine"]
    subset = "" if result["limit"] is None else f", {result['limit']} per set"
    linear = f" Linear rows: the original lookahead before the tree, `{result['linear_source']}`." \
        if result.get("linear_source") else ""
    lines = [f"# Draft tree: compression against tokens fed per step ({result['model']})", "",
             f"Greedy, {result['max_new_tokens']} new tokens; prompts from {result['start']}{subset}. "
             f"Device: {m['device']} ({m['cpu']}), torch {m['torch']}, git {m['git']}.", "",
             f"Command: `{result['command']}`.{linear}", "",
             "| set | system | max_step_tokens | fed / step | compression | identical to plain | accepted by source |",
             "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        fed = f"≤ {r['budget']} ({r['config']})" if r.get("fed_per_step") is None and r.get("config") else \
            "" if r.get("fed_per_step") is None else f"{r['fed_per_step']:.1f}"
        src = ", ".join(f"{k} {v}" for k, v in sorted(r.get("accepted_by_source", {}).items()))
        lines.append(f"| {r['set']} | {r['system']} | {r['budget'] if r['budget'] is not None else ''} | {fed} | "
                     f"{r['compression']:.3f} | {r['identical']}/{r['prompts']} | {src} |")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def plot(result: dict, path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    sets = sorted({r["set"] for r in result["rows"]})
    fig, axes = plt.subplots(1, len(sets), figsize=(6 * len(sets), 4.5), squeeze=False)
    for ax, s in zip(axes[0], sets):
        rows = [r for r in result["rows"] if r["set"] == s]
        for system in dict.fromkeys(r["system"] for r in rows if r["budget"] is not None):
            # Rows without a measured step size (the original linear runs) are placed at their budget.
            pts = sorted((r["fed_per_step"] or r["budget"], r["compression"]) for r in rows if r["system"] == system)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=system)
        for r in rows:
            if r["budget"] is None:
                ax.axhline(r["compression"], ls="--", color="gray", label=r["system"])
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens fed per step (mean)")
        ax.set_ylabel("compression (tokens per forward pass)")
        ax.set_title(s)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
