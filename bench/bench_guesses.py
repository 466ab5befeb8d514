"""Step compression of greedy lookahead with the original one-token pool vs the pool improvements.

Variants (options of LookaheadConfig): ``one-token`` (all off: the original pool), ``two-token``
(``pool_two_token_key``), ``rank-by-hits`` (``pool_rank_by_hits``), ``from-output`` (``pool_from_output``),
``all`` (those three together), ``history`` (``guess_from_history``) and ``all+history``. Each prompt is decoded
plainly once; every lookahead output is compared with it token for token. Compression depends on the model and
prompts, not the machine, so this runs on CPU.

    python bench/bench_guesses.py --limit 8 --max-new-tokens 64           # first 8 prompts of each dev set
    python bench/bench_guesses.py --limit 2 --max-new-tokens 16 --tag smoke

Writes bench/results/guesses-<tag>.{json,md}, rewritten after every prompt so a cut-off run keeps its rows.
Sets, or ranges of one set (``--start``), can run in separate processes (``--sets A --tag t-a``, ``--sets B
--tag t-b``) and be joined with ``--merge guesses-t-a.json guesses-t-b.json --tag t``.

The one-token runs also measure how far any pool could go (``reach``): at every warm step, the longest prefix of
the true continuation that the best n-gram keyed by ``x`` among *everything produced so far* would have given:
every window n-gram of earlier steps plus every n-gram of the committed sequence (prompt and output). A pool that
kept and offered all of them, however keyed or ranked, could accept no more tokens at that step.
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
from lookahead.guesses import common_prefix  # noqa: E402

DATA = os.path.join(os.path.dirname(HERE), "..", "shared", "data")
DEFAULT_SETS = [os.path.join(DATA, "mt_bench_dev.jsonl"), os.path.join(DATA, "humaneval_dev.jsonl")]
DEFAULT_CONFIGS = ["15,5,15", "7,5,7"]
OFF = dict(pool_two_token_key=False, pool_rank_by_hits=False, pool_from_output=False, guess_from_history=False)
VARIANTS = {
    "one-token": {},
    "two-token": {"pool_two_token_key": True},
    "rank-by-hits": {"pool_rank_by_hits": True},
    "from-output": {"pool_from_output": True},
    "all": {"pool_two_token_key": True, "pool_rank_by_hits": True, "pool_from_output": True},
    "history": {"guess_from_history": True},
    "all+history": {"pool_two_token_key": True, "pool_rank_by_hits": True, "pool_from_output": True,
                    "guess_from_history": True},
}


def variant_config(wng: str, options: dict, backend: str) -> LookaheadConfig:
    w, n, g = (int(v) for v in wng.split(","))
    # Options off explicitly, so the baseline stays the original pool whatever the config defaults become.
    return LookaheadConfig(window=w, ngram=n, guess=g, pool_backend=backend, **{**OFF, **options})


def pool_reach(trace, sequence: list[int], ngram: int) -> dict:
    """Accepted candidate tokens vs the most any pool of the n-grams seen so far could have given (see above).

    Counts the steps whose true continuation ``sequence[x+1 : x+N]`` is complete. Returns ``steps``,
    ``accepted`` (tokens the run accepted), ``offered`` (best prefix among the offered candidates; equals
    ``accepted`` for greedy) and ``reach`` (best prefix among all n-grams seen before the step, keyed by ``x``).
    """
    k = ngram - 1
    seen: dict[int, set] = {}
    next_start = 0  # sequence n-grams starting before this index are already in ``seen``
    out = {"steps": 0, "accepted": 0, "offered": 0, "reach": 0}
    for st in trace:
        xi = st.x_index
        while next_start + k <= xi:  # n-grams of the committed sequence up to and including x
            seen.setdefault(sequence[next_start], set()).add(tuple(sequence[next_start + 1: next_start + ngram]))
            next_start += 1
        truth = tuple(sequence[xi + 1: xi + ngram])
        if len(truth) == k:
            offered = max((common_prefix(c, truth) for c in st.candidates), default=0)
            reach = max((common_prefix(c, truth) for c in seen.get(sequence[xi], ())), default=0)
            out["steps"] += 1
            out["accepted"] += st.accepted
            out["offered"] += offered
            out["reach"] += max(reach, offered)
        for g in st.ngrams:
            seen.setdefault(g[0], set()).add(tuple(g[1:]))
    return out


def summarise(result: dict) -> None:
    """Per set/config/variant means, and each variant's mean over sets relative to the one-token pool."""
    for s in result["sets"].values():
        for per_cfg in s["configs"].values():
            for v in per_cfg.values():
                rows = v["rows"]
                v["mean_compression"] = statistics.fmean(r["compression"] for r in rows) if rows else None
                v["identical"] = sum(r["identical"] for r in rows)
                v["prompts"] = len(rows)
                reach = [r["reach"] for r in rows if "reach" in r]
                if reach:
                    v["reach"] = {key: sum(r[key] for r in reach) for key in reach[0]}


def render_markdown(result: dict) -> str:
    m = result["machine"]
    lines = [f"# Pool improvements: step compression, greedy, {result['max_new_tokens']} new tokens, "
             "SmolLM2-135M-Instruct (float32)", "",
             f"Machine: {m['platform']}, {m['cpu_count']} CPUs, torch {m['torch']}, git {m['git']}. "
             f"Command: `{result['command']}`. Wall time {result.get('wall_seconds', 0):.0f} s"
             + (" (the longest of the joined runs)." if result.get("merged_from") else "."),
             f"Prompts: {_describe_prompts(result)} (first turn), at most "
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
                if not v or v["mean_compression"] is None or not b:
                    cells.append("- | - | -")
                    continue
                # Relative to the one-token pool on the same prompts (a variant may cover fewer).
                done = {r["prompt"] for r in v["rows"]}
                base = statistics.fmean(r["compression"] for r in b["rows"] if r["prompt"] in done)
                rel = v["mean_compression"] / base - 1
                cells.append(f"{v['mean_compression']:.3f} | {rel:+.1%} | {v['identical']}/{v['prompts']}")
                means.append(v["mean_compression"])
                bases.append(base)
            if means:
                mean, base = statistics.fmean(means), statistics.fmean(bases)
                tail = f"{mean:.3f} | {mean / base - 1:+.1%}"
            else:
                tail = "- | -"
            lines.append(f"| ({key}) | {name} | " + " | ".join(cells) + f" | {tail} |")
    reach_lines = []
    for s in sets:
        for key, per in result["sets"][s]["configs"].items():
            r = per.get("one-token", {}).get("reach")
            if r and r["steps"]:
                acc, reach = r["accepted"] / r["steps"], r["reach"] / r["steps"]
                reach_lines.append(f"| {s} | ({key}) | {r['steps']} | {acc:.3f} | {reach:.3f} | "
                                   f"{r['accepted'] / max(r['reach'], 1):.1%} | {(1 + reach) / (1 + acc) - 1:+.1%} |")
    if reach_lines:
        lines += ["", "## How far any pool could go (one-token runs)", "",
                  "At every step with a complete true continuation: candidate tokens accepted, and the most that the "
                  "best n-gram keyed by `x` among everything produced before the step (all earlier window n-grams, "
                  "the prompt's and the output's n-grams) would have given. No pool of those n-grams, however keyed, "
                  "ranked or sized, accepts more. `ceiling`: the compression such a pool could add, to first order "
                  "(each step emits its accepted tokens plus one: `(1 + reach) / (1 + accepted) - 1`).", "",
                  "| set | (W,N,G) | steps | accepted tokens / step | reach / step | accepted / reach | ceiling |",
                  "|---|---|---|---|---|---|---|"] + reach_lines
    return "\n".join(lines) + "\n"


def _describe_prompts(result: dict) -> str:
    """Which prompts of each set the rows cover, e.g. ``mt_bench_dev 0-19`` (0-based indices in the file)."""
    out = []
    for name, s in result["sets"].items():
        rows = next(iter(next(iter(s["configs"].values())).values()))["rows"]
        idx = sorted(r["prompt"] for r in rows)
        ranges, lo = [], None
        for i, v in enumerate(idx):
            lo = v if lo is None else lo
            if i + 1 == len(idx) or idx[i + 1] != v + 1:
                ranges.append(f"{lo}-{v}" if v > lo else f"{lo}")
                lo = None
        out.append(f"{name} {', '.join(ranges) or 'none'}")
    return "; ".join(out)


def merge(paths: list[str]) -> dict:
    """Join results of the same command run on different sets or prompt ranges (split across processes)."""
    parts = []
    for path in paths:
        with open(path) as f:
            parts.append(json.load(f))
    result = json.loads(json.dumps(parts[0]))
    for path, part in zip(paths[1:], parts[1:]):
        if part["max_new_tokens"] != result["max_new_tokens"]:
            raise ValueError(f"{path}: max_new_tokens differs between the merged runs ({part['max_new_tokens']} vs "
                             f"{result['max_new_tokens']})")
        result["configs"] += [c for c in part["configs"] if c not in result["configs"]]
        result["variants"] += [v for v in part["variants"] if v not in result["variants"]]
        result["options"] = {**result.get("options", {}), **part.get("options", {})}
        for name, s in part["sets"].items():
            mine = result["sets"].setdefault(name, {"prompts": 0, "configs": {c: {} for c in result["configs"]}})
            for c, per in s["configs"].items():
                for v, entry in per.items():
                    rows = mine["configs"].setdefault(c, {}).setdefault(v, {"rows": []})["rows"]
                    have = {r["prompt"] for r in rows}
                    rows += [r for r in entry["rows"] if r["prompt"] not in have]
                    rows.sort(key=lambda r: r["prompt"])
            mine["prompts"] = max(len(e["rows"]) for per in mine["configs"].values() for e in per.values())
    result["command"] = " ; ".join(p["command"] for p in parts)
    result["merged_from"] = [{"command": p["command"], "git": p["machine"]["git"]} for p in parts]
    result["wall_seconds"] = max(p.get("wall_seconds", 0) for p in parts)
    return result


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
    ap.add_argument("--limit", type=int, default=8, help="K prompts of each set, from --start")
    ap.add_argument("--start", type=int, default=0, help="index of the first prompt taken from each set")
    ap.add_argument("--pool-backend", default="auto")
    ap.add_argument("--tag", default="cpu", help="file name tag under bench/results/")
    ap.add_argument("--out-dir", default=os.path.join(HERE, "results"))
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="join these result files into guesses-<tag>")
    args = ap.parse_args(argv)
    if args.merge:
        result = merge(args.merge)
        write(result, os.path.join(args.out_dir, f"guesses-{args.tag}"))
        print(render_markdown(result))
        return 0
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
        prompts = read_prompts(path, tokenizer)[args.start: args.start + args.limit]
        per_set = result["sets"][name] = {"prompts": len(prompts), "configs": {
            c: {v: {"rows": []} for v in args.variants} for c in args.configs}}
        for i, p in enumerate(prompts):
            ref = model.generate(p, max_new_tokens=args.max_new_tokens)
            for c in args.configs:
                for v in args.variants:
                    cfg = variant_config(c, VARIANTS[v], args.pool_backend)
                    out = model.generate(p, max_new_tokens=args.max_new_tokens, lookahead=cfg,
                                         trace=v == "one-token")
                    row = {
                        "prompt": args.start + i, "compression": out.stats.compression_ratio,
                        "new_tokens": out.stats.new_tokens,
                        "steps": out.stats.steps, "seconds": out.stats.seconds,
                        "identical": bool(torch.equal(out.sequences, ref.sequences))}
                    if out.stats.trace is not None:
                        row["reach"] = pool_reach(out.stats.trace, out.sequences[0].tolist(), cfg.ngram)
                    per_set["configs"][c][v]["rows"].append(row)
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
