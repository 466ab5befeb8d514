"""Tokens per second, side by side on one machine: our plain decoding, our automatic lookahead (alone, and with one
``DraftMemory`` a set: each prompt reads the set's earlier prompts and outputs), fixed (15,5,15), transformers'
greedy ``generate`` and transformers' prompt lookup, on the dev prompt sets.

Every prompt is run by every system in turn (so drift in the machine's load hits all of them alike), after one
warm-up prompt per system. Each system's output is compared token for token with our plain greedy output.
Reported per set and system: tokens/s over the whole set (total new tokens / total seconds), the median of the
per-prompt rates, the ratio of the former to our plain decoding, mean compression and identical outputs.
Our times are ``stats.seconds`` (prefill included; the one-time cost measurement of the automatic mode is not);
transformers' are the wall time of its ``generate`` call.

    python bench/bench_speed.py --threads 2                 # both dev sets, every prompt, 128 new tokens
    python bench/bench_speed.py --limit 10 --tag cpu-10

Writes bench/results/speed-<tag>.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from _common import (DEFAULT_SETS, add_output_args, command_line, hf_default_model, machine_info, pyplot,  # noqa: E402
                     read_results, set_name, static_path_kwargs)

from lookahead import DraftMemory, LookaheadConfig, load_default  # noqa: E402
from lookahead.cli import read_prompts  # noqa: E402
from lookahead.controller import cost_key, measure_step_costs  # noqa: E402
from lookahead_kernels import StepLayout  # noqa: E402

SYSTEMS = ["ours-plain", "ours-lookahead", "ours-lookahead-memory", "ours-fixed-15-5-15", "hf-greedy",
           "hf-prompt-lookup"]


def make_runners(model, hf_model, max_new_tokens: int, device=None):
    """system -> (prompt ids -> (sequences on the CPU, seconds, compression)); ``SYSTEMS``, ``ours-plain-eager``
    (``cuda_graphs=False``; the same as ``ours-plain`` off CUDA) and ``ours-device-tree`` (``device_tree="auto"``).
    Ours are timed by ``stats.seconds`` (each step reads its result back, so it ends synchronised); transformers' by
    the wall time of its call, the accelerator of ``device`` (if any) synchronised before and after."""

    def synchronize():
        if device is not None and torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)

    def ours(config, remembering: bool = False, **kwargs):
        def run(ids):
            if remembering:
                kwargs["draft_memory"] = run.memory
            out = model.generate(ids, max_new_tokens=max_new_tokens, lookahead=config, **kwargs)
            run.stats = out.stats  # the last call's statistics (host work per step, say), for who wants them
            return out.sequences.cpu(), out.stats.seconds, out.stats.compression_ratio
        if remembering:  # the caller gives each prompt set a memory of its own: see remember_per_set
            run.memory = DraftMemory()
        return run

    def hf(**kwargs):
        calls = [0]

        def count(*_):
            calls[0] += 1

        def run(ids):
            calls[0] = 0
            handle = hf_model.register_forward_pre_hook(count)
            try:
                synchronize()
                start = time.perf_counter()
                out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                        do_sample=False, pad_token_id=0, **kwargs)
                synchronize()
                seconds = time.perf_counter() - start
            finally:
                handle.remove()
            new = out.shape[1] - ids.shape[1]
            return out.cpu(), seconds, new / max(calls[0] - 1, 1)
        return run

    device_tree = LookaheadConfig(device_tree="auto")
    return {
        "ours-plain": ours(None),
        # The eager loop (on the CPU the default; on CUDA without graphs): what the graphs gain on a GPU.
        "ours-plain-eager": ours(None, cuda_graphs=False),
        "ours-lookahead": ours(LookaheadConfig()),
        # One DraftMemory a prompt set: each prompt's lookahead reads the set's earlier prompts and outputs.
        "ours-lookahead-memory": ours(LookaheadConfig(), remembering=True),
        "ours-fixed-15-5-15": ours(LookaheadConfig(window=15, ngram=5, guess=15)),
        # Trees read on the device, sized from the step costs (lookahead.device_tree; on a CPU they lose).
        "ours-device-tree": ours(device_tree, **static_path_kwargs(device_tree, model.device.type)),
        "hf-greedy": hf(),
        "hf-prompt-lookup": hf(prompt_lookup_num_tokens=10),
    }


def remember_per_set(runners: dict, memories: dict, set_name: str) -> None:
    """Give every remembering runner (``ours-lookahead-memory``) the memory of ``set_name`` (made on first use in
    ``memories``): a set's prompts read only that set's earlier prompts, the warm-up's none."""
    memory = memories.setdefault(set_name, DraftMemory())
    for run in runners.values():
        if hasattr(run, "memory"):
            run.memory = memory


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sets", nargs="+", default=DEFAULT_SETS)
    ap.add_argument("--systems", nargs="+", default=SYSTEMS, choices=SYSTEMS)
    ap.add_argument("--limit", type=int, default=None, help="first N prompts of each set")
    add_output_args(ap, max_new_tokens=128, render=True)
    args = ap.parse_args(argv)
    if args.render:
        result, base = read_results(args.render)
        write_markdown(result, base + ".md")
        plot(result, base + ".png")
        return 0
    from tqdm.auto import tqdm
    torch.set_num_threads(args.threads)
    machine = machine_info("cpu")  # at the start: the revision that runs, whatever is committed meanwhile
    model, tokenizer = load_default()
    hf_model = hf_default_model()
    # Measured now, on this machine as it is, rather than taken from the disk cache.
    model(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long), model.new_cache(1, 8), 0,
          StepLayout(1, 1))  # the first call packs the weights
    costs = measure_step_costs(model)
    model.step_costs_cache = {cost_key(model): costs}
    runners = {name: run for name, run in make_runners(model, hf_model, args.max_new_tokens).items()
               if name in args.systems}
    rows, per_prompt = [], []
    with torch.inference_mode():
        for set_path in args.sets:
            name = set_name(set_path)
            prompts = read_prompts(set_path, tokenizer)[: args.limit]
            for run in runners.values():  # warm-up: packing, caches, allocator
                run(prompts[0])
            remember_per_set(runners, {}, name)  # after the warm-up, which fed the memory its first prompt
            results = {s: [] for s in runners}
            for i, ids in enumerate(tqdm(prompts, desc=name)):
                ref = None
                for system, run in runners.items():
                    seq, seconds, comp = run(ids)
                    if system == "ours-plain":
                        ref = seq
                    new = seq.shape[1] - ids.shape[1]
                    same = ref is not None and seq.shape == ref.shape and bool(seq.eq(ref).all())
                    results[system].append((new, seconds, comp, same))
                    per_prompt.append({"set": name, "prompt": i, "system": system, "new_tokens": new,
                                       "seconds": seconds, "compression": comp, "identical": same})
            plain_rate = None
            for system, res in results.items():
                total_new, total_s = sum(r[0] for r in res), sum(r[1] for r in res)
                rate = total_new / total_s
                if system == "ours-plain":
                    plain_rate = rate
                rows.append({"set": name, "system": system, "tokens_per_s": rate,
                             "median_tokens_per_s": statistics.median(r[0] / r[1] for r in res),
                             "vs_ours_plain": rate / plain_rate if plain_rate else None,
                             "compression": statistics.mean(r[2] for r in res),
                             "identical": sum(r[3] for r in res), "prompts": len(res)})
                print(f"{name:10s} {system:20s} {rate:7.2f} tok/s  x{rows[-1]['vs_ours_plain'] or 0:.2f}  "
                      f"compression {rows[-1]['compression']:.2f}  identical {rows[-1]['identical']}/{len(res)}",
                      flush=True)
    machine["load_average_end"] = machine_info("cpu")["load_average"]
    result = {"device": "cpu", "machine": machine, "command": command_line(__file__, sys.argv[1:]),
              "model": "SmolLM2-135M-Instruct (float32)", "max_new_tokens": args.max_new_tokens,
              "limit": args.limit, "threads": args.threads,
              "step_costs": list(zip(costs.tokens, costs.seconds)), "rows": rows, "per_prompt": per_prompt}
    os.makedirs(args.out_dir, exist_ok=True)
    base = os.path.join(args.out_dir, f"speed-{args.tag}")
    with open(base + ".json", "w") as f:
        json.dump(result, f, indent=1)
    write_markdown(result, base + ".md")
    plot(result, base + ".png")
    print(f"wrote {base}.json, .md, .png")
    return 0


def write_markdown(result: dict, path: str) -> None:
    m = result["machine"]
    subset = "every prompt" if result["limit"] is None else f"first {result['limit']} prompts"
    costs = ", ".join(f"t({t}) = {s * 1e3:.1f} ms" for t, s in result["step_costs"])
    lines = [f"# Tokens per second side by side ({result['model']})", "",
             f"Greedy, {result['max_new_tokens']} new tokens, {subset} of each set, {result['threads']} threads. "
             f"Device: {m['device']} ({m['cpu']}), torch {m['torch']}, git {m['git']}, load average at the end "
             f"{m.get('load_average')}.", "", f"Cost model of the automatic mode: {costs}.", "",
             f"Command: `{result['command']}`", "",
             "| set | system | tokens/s (set) | median tokens/s | vs ours-plain | compression | identical to ours-plain |",
             "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['set']} | {r['system']} | {r['tokens_per_s']:.2f} | {r['median_tokens_per_s']:.2f} | "
                     f"{r['vs_ours_plain']:.2f}x | {r['compression']:.2f} | {r['identical']}/{r['prompts']} |")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def plot(result: dict, path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    sets = list(dict.fromkeys(r["set"] for r in result["rows"]))
    systems = list(dict.fromkeys(r["system"] for r in result["rows"]))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / len(systems)
    for k, system in enumerate(systems):
        vals = [next(r["tokens_per_s"] for r in result["rows"] if r["set"] == s and r["system"] == system)
                for s in sets]
        ax.bar([i + k * width for i in range(len(sets))], vals, width, label=system)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(sets))], sets)
    ax.set_ylabel("tokens per second")
    ax.set_title(f"{result['model']}, {result['threads']} threads, {result['machine']['cpu']}")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
