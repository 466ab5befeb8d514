"""Lookahead under transformers' repetition penalty and no_repeat_ngram_size: compression and tokens/s against plain
decoding.

The embedded SmolLM2 on the first prompts of each dev set (chat template, greedy): per setting (a penalty, or an
n-gram size never repeated), each prompt is decoded plainly and with automatic lookahead under that setting, side by
side in one process (order alternating between prompts); every pair must be identical. Reported per setting: the
median compression (and per set) and the median of lookahead's tokens/s over plain's.

    python bench/bench_repetition.py --prompts 4 --tag cpu-avx2
    python bench/bench_repetition.py --penalties 1.0 --no-repeat-ngram-sizes 3 4 --tag no-repeat-cpu-avx2

Writes bench/results/repetition-<tag>.{json,md}.
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
    add_run_args(ap, prompts=4, max_new_tokens=128)
    ap.add_argument("--penalties", type=float, nargs="*", default=[1.0, 1.05, 1.1, 1.2])
    ap.add_argument("--no-repeat-ngram-sizes", type=int, nargs="*", default=[],
                    help="no_repeat_ngram_size settings (each without a penalty)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_default()
    prompts = first_prompts(args.sets, tokenizer, args.prompts)
    model.generate(prompts[0][1], max_new_tokens=16)  # builds and measures what a first call would
    rows = []
    settings = [{"repetition_penalty": p} for p in args.penalties] + \
        [{"no_repeat_ngram_size": n} for n in args.no_repeat_ngram_sizes]
    for setting in settings:
        label = ", ".join(f"{k}={v}" for k, v in setting.items())
        per = []
        for i, (name, ids) in enumerate(prompts):
            runs = {}
            for mode in (["plain", "lookahead"] if i % 2 == 0 else ["lookahead", "plain"]):
                la = None if mode == "plain" else LookaheadConfig()
                runs[mode] = model.generate(ids, max_new_tokens=args.max_new_tokens, lookahead=la, **setting)
            if not torch.equal(runs["plain"].sequences, runs["lookahead"].sequences):
                raise SystemExit(f"{label}, {name} prompt {i}: lookahead's output differs from plain's")
            per.append({"set": name, "compression": runs["lookahead"].stats.compression_ratio,
                        "ratio": runs["lookahead"].stats.tokens_per_second / runs["plain"].stats.tokens_per_second})
        row = {"setting": label, "penalty": setting.get("repetition_penalty", 1.0),
               "no_repeat_ngram_size": setting.get("no_repeat_ngram_size", 0), "compression": statistics.median(r["compression"] for r in per),
               "speedup": statistics.median(r["ratio"] for r in per), "identical": len(per), "prompts": len(per)}
        for name in dict.fromkeys(r["set"] for r in per):
            row[f"compression_{name}"] = statistics.mean(r["compression"] for r in per if r["set"] == name)
        rows.append(row)
        print(f"{label}: compression {row['compression']:.2f}, lookahead/plain {row['speedup']:.2f}x",
              flush=True)
    result = {"machine": machine_info("cpu"), "command": command_line(__file__, argv or sys.argv[1:]),
              "max_new_tokens": args.max_new_tokens, "rows": rows}
    names = [k for k in rows[0] if k.startswith("compression_")]
    lines = [f"# Lookahead under a repetition penalty or no_repeat_ngram_size ({result['machine']['cpu']})", "",
             f"`{result['command']}` at {result['machine']['git']}: SmolLM2-135M-Instruct, greedy, "
             f"{args.max_new_tokens} new tokens, automatic lookahead against plain decoding under the same setting, "
             f"{len(prompts)} prompts ({args.prompts} per dev set); every output identical.", "",
             "| setting | median compression | " + " | ".join(f"mean compression, {n[12:]}" for n in names)
             + " | median lookahead/plain tokens/s |",
             "|---|---|" + "---|" * len(names) + "---|"]
    for r in rows:
        lines.append(f"| {r['setting']} | {r['compression']:.2f} | "
                     + " | ".join(f"{r[n]:.2f}" for n in names) + f" | {r['speedup']:.2f}x |")
    write_results(args.out_dir, f"repetition-{args.tag}", result, "\n".join(lines) + "\n")
    return result


if __name__ == "__main__":
    main()
