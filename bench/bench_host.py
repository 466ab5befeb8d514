"""Host work per lookahead step: the C++ draft builder against its Python reference, at the step sizes a GPU takes.

Where the forward is cheap (SmolLM2 replays a 128-token step in ~4 ms on an H100) the host's work between steps
bounds the speed: candidates, the best-first tree, the step's inputs, KV compaction and learning. This runs the
static (padded, graph-shaped) step path on this machine with fixed tree budgets, once with each builder, and
reports ``stats.host_seconds`` per step (the step's time outside the forward pass, verification and read-back),
the forward's share beside it, and whether both builders give the same tokens (they must build the same trees).

    python bench/bench_host.py --threads 2                     # 3 prompts a set, budgets 16 64 128 256
    python bench/bench_host.py --prompts 5 --budgets 64 256 --tag cpu-5

Writes bench/results/host-<tag>.{json,md}.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from _common import DEFAULT_SETS, command_line, machine_info, set_name, write_results  # noqa: E402

from lookahead import LookaheadConfig, load_default  # noqa: E402
from lookahead.cli import read_prompts  # noqa: E402

BUILDERS = {"C++": True, "Python": False}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=3, help="first prompts of each set")
    ap.add_argument("--budgets", type=int, nargs="+", default=[16, 64, 128, 256],
                    help="max_step_tokens of the fixed configurations")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--sets", nargs="+", default=DEFAULT_SETS)
    ap.add_argument("--tag", default="cpu")
    ap.add_argument("--out-dir", default=os.path.join(HERE, "results"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    machine = machine_info("cpu")
    model, tokenizer = load_default()
    rows = []
    for set_path in args.sets:
        name = set_name(set_path)
        prompts = read_prompts(set_path, tokenizer)[: args.prompts]
        for budget in args.budgets:
            config = LookaheadConfig(max_step_tokens=budget)
            model.generate(prompts[0], max_new_tokens=8, lookahead=config, cuda_graphs=False, _static_steps=True)
            runs = {b: [] for b in BUILDERS}
            for ids in prompts:  # both builders on a prompt before the next: drift hits them alike
                for builder, native in BUILDERS.items():
                    out = model.generate(ids, max_new_tokens=args.max_new_tokens, lookahead=config,
                                         cuda_graphs=False, _static_steps=True, _native_draft=native)
                    runs[builder].append(out)
            for builder, outs in runs.items():
                steps = sum(o.stats.steps for o in outs)
                host = sum(o.stats.host_seconds for o in outs)
                decode = sum(o.stats.seconds - o.stats.prefill_seconds for o in outs)
                rows.append({
                    "set": name, "budget": budget, "builder": builder, "steps": steps,
                    "host_ms_per_step": host / steps * 1e3,
                    "other_ms_per_step": (decode - host) / steps * 1e3,
                    "host_share": host / decode,
                    "median_prompt_host_ms_per_step": statistics.median(
                        o.stats.host_seconds / o.stats.steps * 1e3 for o in outs),
                    "compression": sum(o.stats.new_tokens for o in outs) / steps,
                    "identical": sum(torch.equal(o.sequences, r.sequences) for o, r in zip(outs, runs["C++"])),
                    "prompts": len(outs)})
                r = rows[-1]
                print(f"{name:10s} budget {budget:4d} {builder:7s} host {r['host_ms_per_step']:7.2f} ms/step, rest "
                      f"{r['other_ms_per_step']:7.1f} ms/step, compression {r['compression']:.2f}, identical "
                      f"{r['identical']}/{r['prompts']}", flush=True)
    machine["load_average_end"] = machine_info("cpu")["load_average"]
    result = {"device": "cpu", "machine": machine, "command": command_line(__file__, sys.argv[1:] if argv is None
                                                                           else argv),
              "model": "SmolLM2-135M-Instruct (float32)", "threads": args.threads, "prompts": args.prompts,
              "max_new_tokens": args.max_new_tokens, "rows": rows}
    print("wrote", write_results(args.out_dir, f"host-{args.tag}", result, markdown(result)))
    return 0


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = [f"# Host work per lookahead step: C++ draft builder vs its Python reference ({result['model']})", "",
             f"Static (padded, graph-shaped) steps run eagerly on {m['device']} ({m['cpu']}), {result['threads']} "
             f"threads, torch {m['torch']}, git {m['git']}; first {result['prompts']} prompts of each set, "
             f"{result['max_new_tokens']} new tokens, greedy, `LookaheadConfig(max_step_tokens=budget)`. Host: "
             "`stats.host_seconds`, the step's time outside the forward pass, verification and read-back (candidates, "
             "trees, step inputs, KV compaction, learning); rest: the step's other time (here the CPU forward).", "",
             f"Command: `{result['command']}`", "",
             "| set | budget | builder | host ms / step | rest ms / step | host share | compression "
             "| identical to C++ |",
             "|---|---:|---|---:|---:|---:|---:|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['set']} | {r['budget']} | {r['builder']} | {r['host_ms_per_step']:.2f} | "
                     f"{r['other_ms_per_step']:.1f} | {100 * r['host_share']:.1f}% | {r['compression']:.2f} | "
                     f"{r['identical']}/{r['prompts']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
