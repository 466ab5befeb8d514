"""Sampled lookahead on a CPU with and without transformers' typical_p: tokens/s of lookahead and plain decoding.

typical_p (like the epsilon and eta cutoffs) is warped with torch, not by the C++ sampled walk, so every sampled
step on a CPU warps whole rows: this measures what that costs plain decoding and whether lookahead still keeps up.
The embedded SmolLM2 on the first prompts of each dev set (chat template, temperature 0.8, a seed per prompt): per
setting, each prompt decoded plainly and with automatic lookahead, side by side in one process (order alternating
between prompts). Reported per setting: the median tokens/s of each, and the median of lookahead's over plain's.

    python bench/bench_cutoffs.py --prompts 2 --tag cpu-avx2

Writes bench/results/cutoffs-<tag>.{json,md}.
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

from _common import add_run_args, command_line, first_prompts, machine_info, write_results  # noqa: E402

from lookahead import LookaheadConfig, load_default  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(ap, prompts=2, max_new_tokens=64)
    ap.add_argument("--typical-p", type=float, default=0.9)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_default()
    prompts = [ids for _, ids in first_prompts(args.sets, tokenizer, args.prompts)]
    model.generate(prompts[0], max_new_tokens=16)  # builds and measures what a first call would
    rows = []
    for setting in ({}, {"typical_p": args.typical_p}):
        per = []
        for i, ids in enumerate(prompts):
            speed = {}
            for mode in (["plain", "lookahead"] if i % 2 == 0 else ["lookahead", "plain"]):
                out = model.generate(ids, max_new_tokens=args.max_new_tokens,
                                     lookahead=None if mode == "plain" else LookaheadConfig(), do_sample=True,
                                     temperature=0.8, generator=torch.Generator().manual_seed(i), **setting)
                speed[mode] = out.stats.tokens_per_second
            per.append(speed)
        row = {"setting": ", ".join(f"{k}={v}" for k, v in setting.items()) or "none",
               "plain_tokens_per_s": statistics.median(s["plain"] for s in per),
               "lookahead_tokens_per_s": statistics.median(s["lookahead"] for s in per),
               "speedup": statistics.median(s["lookahead"] / s["plain"] for s in per), "prompts": len(per)}
        rows.append(row)
        print(f"{row['setting']}: plain {row['plain_tokens_per_s']:.1f}, lookahead {row['lookahead_tokens_per_s']:.1f} "
              f"tokens/s, lookahead/plain {row['speedup']:.2f}x", flush=True)
    result = {"machine": machine_info("cpu"), "command": command_line(__file__, argv or sys.argv[1:]),
              "max_new_tokens": args.max_new_tokens, "rows": rows}
    lines = [f"# Sampled decoding with and without typical_p ({result['machine']['cpu']})", "",
             f"`{result['command']}` at {result['machine']['git']}: SmolLM2-135M-Instruct, temperature 0.8, "
             f"{args.max_new_tokens} new tokens, automatic lookahead against plain decoding, {len(prompts)} prompts "
             f"({args.prompts} per dev set), medians.", "",
             "| setting | plain tokens/s | lookahead tokens/s | lookahead/plain |", "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['setting']} | {r['plain_tokens_per_s']:.1f} | {r['lookahead_tokens_per_s']:.1f} | "
                     f"{r['speedup']:.2f}x |")
    write_results(args.out_dir, f"cutoffs-{args.tag}", result, "\n".join(lines) + "\n")
    return result


if __name__ == "__main__":
    main()
