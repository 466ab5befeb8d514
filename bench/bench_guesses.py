"""Step compression of greedy lookahead with the original one-token pool vs the pool improvements.

Variants (options of LookaheadConfig): ``one-token`` (all off: the original pool), ``two-token``
(``pool_two_token_key``), ``rank-by-hits`` (``pool_rank_by_hits``), ``from-output`` (``pool_from_output``) and
``all`` (the three together). Each prompt is decoded plainly once; every lookahead output is compared with it
token for token. Compression depends on the model and prompts, not the machine, so this runs on CPU.

    python bench/bench_guesses.py --limit 8 --max-new-tokens 64           # first 8 prompts of each dev set
    python bench/bench_guesses.py --limit 2 --max-new-tokens 16 --tag smoke

Writes bench/results/guesses-<tag>.{json,md}, rewritten after every prompt so a cut-off run keeps its rows.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from lookahead import LookaheadConfig, load_default  # noqa: E402
from lookahead.cli import machine_info, read_prompts  # noqa: E402

DATA = os.path.join(os.path.dirname(HERE), "..", "shared", "data")
DEFAULT_SETS = [os.path.join(DATA, "mt_bench_dev.jsonl"), os.path.join(DATA, "humaneval_dev.jsonl")]
DEFAULT_CONFIGS = ["15,5,15", "7,5,7"]
OFF = dict(pool_two_token_key=False, pool_rank_by_hits=False, pool_from_output=False)
VARIANTS = {
    "one-token": {},
    "two-token": {"pool_two_token_key": True},
    "rank-by-hits": {"pool_rank_by_hits": True},
    "from-output": {"pool_from_output": True},
    "all": {"pool_two_token_key": True, "pool_rank_by_hits": True, "pool_from_output": True},
}


def variant_config(wng: str, options: dict, backend: str) -> LookaheadConfig:
    w, n, g = (int(v) for v in wng.split(","))
    # Options off explicitly, so the baseline stays the original pool whatever the config defaults become.
    return LookaheadConfig(window=w, ngram=n, guess=g, pool_backend=backend, **{**OFF, **options})


def summarise(result: dict) -> None:
    """Per set/config/variant means, and each variant's mean over sets relative to the one-token pool."""
    for s in result["sets"].values():
        for per_cfg in s["configs"].values():
            for v in per_cfg.values():
                rows = v["rows"]
                v["mean_compression"] = statistics.fmean(r["compression"] for r in rows) if rows else None
                v["identical"] = sum(r["identical"] for r in rows)
                v["prompts"] = len(rows)


def render_markdown(result: dict) -> str:
    m = result["machine"]
    lines = [f"# Pool improvements: step compression, greedy, {result['max_new_tokens']} new tokens, "
             "SmolLM2-135M-Instruct (float32)", "",
             f"Machine: {m['platform']}, {m['cpu_count']} CPUs, torch {m['torch']}, git {m['git']}. "
             f"Command: `{result['command']}`. Wall time {result.get('wall_seconds', 0):.0f} s.",
             f"Subset: the first {result['limit']} prompts of each set (first turn), at most "
             f"{result['max_new_tokens']} new tokens each.",
             "Compression = new tokens / forward passes after the prefill (plain decoding = 1.00); "
             "mean over prompts. `vs one-token`: relative to the original pool in the same set and (W,N,G).", ""]
    sets = list(result["sets"])
    head = "| (W,N,G) | variant | " + " | ".join(f"{s} compression | vs one-token | identical" for s in sets) \
        + " | mean over sets | vs one-token |"
    lines += [head, "|" + "---|" * (2 + 3 * len(sets) + 2)]
    configs = result["configs"]
    for key in configs:
        for name in result["variants"]:
            cells, means, bases = [], [], []
            for s in sets:
                per = result["sets"][s]["configs"].get(key, {})
                v, b = per.get(name), per.get("one-token")
                if not v or v["mean_compression"] is None:
                    cells.append("- | - | -")
                    continue
                rel = v["mean_compression"] / b["mean_compression"] - 1
                cells.append(f"{v['mean_compression']:.3f} | {rel:+.1%} | {v['identical']}/{v['prompts']}")
                means.append(v["mean_compression"])
                bases.append(b["mean_compression"])
            if means:
                mean, base = statistics.fmean(means), statistics.fmean(bases)
                tail = f"{mean:.3f} | {mean / base - 1:+.1%}"
            else:
                tail = "- | -"
            lines.append(f"| ({key}) | {name} | " + " | ".join(cells) + f" | {tail} |")
    return "\n".join(lines) + "\n"


def write(result: dict, base: str) -> None:
    summarise(result)
    with open(base + ".json", "w") as f:
        json.dump(result, f, indent=1)
    with open(base + ".md", "w") as f:
        f.write(render_markdown(result))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sets", nargs="+", default=DEFAULT_SETS, help="prompt files (JSONL)")
    ap.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, help="W,N,G triples")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--limit", type=int, default=8, help="first K prompts of each set")
    ap.add_argument("--pool-backend", default="auto")
    ap.add_argument("--tag", default="cpu", help="file name tag under bench/results/")
    ap.add_argument("--out-dir", default=os.path.join(HERE, "results"))
    args = ap.parse_args(argv)
    for c in args.configs:  # fail on a bad triple before loading the model
        variant_config(c, {}, args.pool_backend)

    model, tokenizer = load_default()
    os.makedirs(args.out_dir, exist_ok=True)
    base = os.path.join(args.out_dir, f"guesses-{args.tag}")
    result = {"machine": machine_info("cpu"),
              "command": "python " + " ".join([os.path.relpath(__file__)] + (argv or sys.argv[1:])),
              "max_new_tokens": args.max_new_tokens, "limit": args.limit, "configs": args.configs,
              "variants": args.variants, "options": {v: VARIANTS[v] for v in args.variants}, "sets": {}}
    started = time.perf_counter()
    for path in args.sets:
        name = os.path.splitext(os.path.basename(path))[0]
        prompts = read_prompts(path, tokenizer)[: args.limit]
        per_set = result["sets"][name] = {"prompts": len(prompts), "configs": {
            c: {v: {"rows": []} for v in args.variants} for c in args.configs}}
        for i, p in enumerate(prompts):
            ref = model.generate(p, max_new_tokens=args.max_new_tokens)
            for c in args.configs:
                for v in args.variants:
                    cfg = variant_config(c, VARIANTS[v], args.pool_backend)
                    out = model.generate(p, max_new_tokens=args.max_new_tokens, lookahead=cfg)
                    per_set["configs"][c][v]["rows"].append({
                        "prompt": i, "compression": out.stats.compression_ratio, "new_tokens": out.stats.new_tokens,
                        "steps": out.stats.steps, "seconds": out.stats.seconds,
                        "identical": bool(torch.equal(out.sequences, ref.sequences))})
            result["wall_seconds"] = time.perf_counter() - started
            write(result, base)
            print(f"{name} prompt {i + 1}/{len(prompts)} done, {result['wall_seconds']:.0f} s", file=sys.stderr,
                  flush=True)
    result["wall_seconds"] = time.perf_counter() - started
    write(result, base)
    print(render_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
