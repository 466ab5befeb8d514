"""Step compression of greedy lookahead decoding on the dev prompt sets, for several (W, N, G).

Compression = new tokens / forward passes after the prefill (plain decoding: 1.0). It depends on the model
and prompts, not on the machine, so this runs on CPU. Each prompt is also decoded plainly once and the outputs
compared token for token.

    python bench/bench_compression.py      # both dev sets: (15,5,15) on every prompt, three smaller configs
                                           # on the first 12 prompts of each set; 128 new tokens
    python bench/bench_compression.py --limit 5 --configs 7,5,7 --subset-configs

Writes bench/results/compression-<tag>.{json,md} (and a .png bar chart when matplotlib is present).
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
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from lookahead import LookaheadConfig, load_default  # noqa: E402
from lookahead.cli import machine_info, read_prompts  # noqa: E402

from _common import pyplot, read_results  # noqa: E402

DATA = os.path.join(os.path.dirname(HERE), "..", "shared", "data")
DEFAULT_SETS = [os.path.join(DATA, "mt_bench_dev.jsonl"), os.path.join(DATA, "humaneval_dev.jsonl")]
DEFAULT_CONFIGS = ["15,5,15"]
DEFAULT_SUBSET_CONFIGS = ["10,5,10", "7,5,7", "5,3,5"]


def parse_config(text: str) -> LookaheadConfig:
    w, n, g = (int(v) for v in text.split(","))
    return LookaheadConfig(window=w, ngram=n, guess=g)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sets", nargs="+", default=DEFAULT_SETS, help="prompt files (JSONL)")
    ap.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, help="W,N,G triples run on every prompt")
    ap.add_argument("--subset-configs", nargs="*", default=DEFAULT_SUBSET_CONFIGS,
                    help="W,N,G triples run on the first --subset-limit prompts of each set only")
    ap.add_argument("--subset-limit", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--limit", type=int, default=None, help="first N prompts of each set")
    ap.add_argument("--pool-backend", default="auto")
    ap.add_argument("--temperature", type=float, default=None,
                    help="sample at this temperature (seeded) instead of greedy decoding")
    ap.add_argument("--seed", type=int, default=0, help="seed of the sampling generator")
    ap.add_argument("--tag", default="cpu", help="file name tag under bench/results/")
    ap.add_argument("--out-dir", default=os.path.join(HERE, "results"))
    ap.add_argument("--render", metavar="JSON", help="only re-write the markdown table and plot of a results file")
    args = ap.parse_args(argv)
    if args.render:
        result, base = read_results(args.render)
        write(result, base)
        plot(result, base + ".png")
        return 0
    from tqdm.auto import tqdm

    def configs_of(texts, limit):
        return [(LookaheadConfig(window=c.window, ngram=c.ngram, guess=c.guess, pool_backend=args.pool_backend),
                 limit) for c in map(parse_config, texts)]

    configs = configs_of(args.configs, None) + configs_of(args.subset_configs, args.subset_limit)
    os.makedirs(args.out_dir, exist_ok=True)
    base = os.path.join(args.out_dir, f"compression-{args.tag}")
    model, tokenizer = load_default()

    def sampling() -> dict:
        """Keyword arguments of generate: greedy, or seeded sampling (a fresh generator per call)."""
        if args.temperature is None:
            return {}
        return {"do_sample": True, "temperature": args.temperature, "top_k": 0,
                "generator": torch.Generator().manual_seed(args.seed)}

    result = {"machine": machine_info("cpu"), "command": "python " + " ".join([os.path.relpath(__file__)] + (argv or sys.argv[1:])),
              "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "sets": {}}
    started = time.perf_counter()
    for path in args.sets:
        name = os.path.splitext(os.path.basename(path))[0]
        every = read_prompts(path, tokenizer)
        prompts = every[: args.limit]
        per_set = {"prompts": len(prompts), "set_size": len(every), "configs": {}}
        plain = [model.generate(p, max_new_tokens=args.max_new_tokens, **sampling())
                 for p in tqdm(prompts, desc=f"{name} plain", unit="prompt", file=sys.stderr)]
        per_set["plain_tokens_per_second"] = (sum(o.stats.new_tokens for o in plain)
                                              / sum(o.stats.seconds for o in plain))
        for cfg, limit in configs:
            key = f"{cfg.window},{cfg.ngram},{cfg.guess}"
            rows = []
            subset = prompts[:limit]
            for p, ref in zip(tqdm(subset, desc=f"{name} ({key})", unit="prompt", file=sys.stderr), plain):
                out = model.generate(p, max_new_tokens=args.max_new_tokens, lookahead=cfg, **sampling())
                rows.append({"compression": out.stats.compression_ratio, "new_tokens": out.stats.new_tokens,
                             "steps": out.stats.steps, "seconds": out.stats.seconds,
                             "identical": bool(torch.equal(out.sequences, ref.sequences))})
            per_set["configs"][key] = {
                "prompts": len(subset),
                "mean_compression": statistics.fmean(r["compression"] for r in rows),
                "median_compression": statistics.median(r["compression"] for r in rows),
                "tokens_per_second": sum(r["new_tokens"] for r in rows) / sum(r["seconds"] for r in rows),
                "identical": sum(r["identical"] for r in rows),
                "rows": rows,
            }
            result["sets"][name] = per_set
            result["wall_seconds"] = time.perf_counter() - started
            write(result, base)  # after every configuration, so a cut-off run keeps what it measured
    plot(result, base + ".png")
    print(render_markdown(result))
    return 0


def write(result: dict, base: str) -> None:
    with open(base + ".json", "w") as f:
        json.dump(result, f, indent=1)
    with open(base + ".md", "w") as f:
        f.write(render_markdown(result))


def render_markdown(result: dict) -> str:
    m = result["machine"]
    temp = result.get("temperature")
    mode = "greedy" if temp is None else f"sampling at temperature {temp}"
    lines = [f"# Step compression, {mode}, {result['max_new_tokens']} new tokens, SmolLM2-135M-Instruct (float32)",
             "",
             f"Machine: {m['platform']}, {m['cpu_count']} CPUs, torch {m['torch']}, git {m['git']}. "
             f"Command: `{result['command']}`.",
             "Compression = new tokens / forward passes after the prefill (plain decoding = 1.00). "
             "Tokens/s are CPU figures from the same run (one torch thread, other jobs sharing the 2 cores: compare "
             "within a row only); a subset means the first prompts of the set.", "",
             *(["With sampling, 'identical' compares seeded runs that draw different random numbers, so it is not "
                "a check; the sampling distribution is tested in tests/test_sampling_e2e.py.", ""] if temp is not None
               else []),
             "| set | prompts | (W,N,G) | mean compression | median | identical to plain | tokens/s lookahead | tokens/s plain |",
             "|---|---|---|---|---|---|---|---|"]
    for name, s in result["sets"].items():
        for key, c in s["configs"].items():
            size = s.get("set_size", s["prompts"])
            which = f"all {size}" if c["prompts"] == size else f"first {c['prompts']} of {size}"
            lines.append(f"| {name} | {which} | ({key}) | {c['mean_compression']:.3f} | "
                         f"{c['median_compression']:.3f} | {c['identical']}/{c['prompts']} | "
                         f"{c['tokens_per_second']:.1f} | {s['plain_tokens_per_second']:.1f} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    sets = list(result["sets"])
    keys = [k for k in next(iter(result["sets"].values()))["configs"]
            if all(k in s["configs"] for s in result["sets"].values())]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.8 / len(sets)
    for j, name in enumerate(sets):
        vals = [result["sets"][name]["configs"][k]["mean_compression"] for k in keys]
        ax.bar([i + j * width for i in range(len(keys))], vals, width, label=name)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks([i + width * (len(sets) - 1) / 2 for i in range(len(keys))], [f"({k})" for k in keys])
    ax.set_xlabel("(W, N, G)")
    ax.set_ylabel("mean step compression")
    ax.set_ylim(bottom=0)
    temp = result.get("temperature")
    mode = "greedy" if temp is None else f"sampling, T={temp}"
    ax.set_title(f"Lookahead decoding, SmolLM2-135M-Instruct, {mode}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
