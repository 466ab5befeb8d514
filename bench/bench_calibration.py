"""How far the draft tree's expected tokens come true, by the size of the tree the planner kept.

The automatic mode keeps, each step, the tree size that maximises ``(1 + E) / t(T)``, where ``E`` is the sum of
the kept nodes' estimated chances of being reached (``lookahead.draft``: acceptance learned per source and depth
during the call, from priors). Each dev prompt is decoded at batch 1 with ``trace=True``; every step's trace holds
``E`` (``StepTrace.expected``) and the accepted path. Per tree size: the steps, the mean expected and the mean
accepted tokens. A tree whose accepted tokens fall short of ``t(T + 1) / t(1) - 1`` lost to a plain step.

    python bench/bench_calibration.py --prompts 8 --tag cpu-8

Writes bench/results/calibration-<tag>.{json,md}.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from _common import add_prompt_set_args, command_line, machine_info, render, set_name, write_results  # noqa: E402

from lookahead import LookaheadConfig, load_default  # noqa: E402
from lookahead.cli import read_prompts  # noqa: E402

SIZE_CLASSES = ((1, 1), (2, 2), (3, 3), (4, 4), (5, 7), (8, 15), (16, 10**9))


def size_class(n: int) -> str:
    for lo, hi in SIZE_CLASSES:
        if lo <= n <= hi:
            return str(lo) if lo == hi else f"{lo}+" if hi > 10**8 else f"{lo}-{hi}"
    return "0"


def markdown(result: dict) -> str:
    lines = ["# Draft tree: expected against accepted tokens, by tree size (batch 1)", "",
             f"`{result['command']}` at {result['machine']['git']} (SmolLM2-135M, float32, "
             f"{result['machine']['cpu']}, {result['threads']} threads): automatic lookahead, "
             f"{result['max_new_tokens']} new tokens a prompt. Expected: the sum of the kept nodes' estimated "
             "chances of being reached, which the planner weighed against the step's cost; accepted: the tree "
             "tokens the verifier took (the bonus token not counted).", ""]
    for s in result["sets"]:
        lines += [f"## {s['set']} ({s['prompts']} prompts: {s['steps']} steps, {s['new_tokens']} tokens, "
                  f"compression {s['new_tokens'] / s['steps']:.2f})", "",
                  "| tree nodes | steps | expected a step | accepted a step | accepted / expected |",
                  "|---|---|---|---|---|"]
        for r in s["rows"]:
            ratio = r["accepted"] / r["expected"] if r["expected"] else float("nan")
            lines.append(f"| {r['size']} | {r['steps']} | {r['expected'] / r['steps']:.2f} | "
                         f"{r['accepted'] / r['steps']:.2f} | {ratio:.2f} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_prompt_set_args(ap, prompts=8, max_new_tokens=128)
    args = ap.parse_args(argv)
    if args.render:
        render(args.render, markdown, lambda result, path: None)  # no plot: a table says it
        return 0
    from tqdm.auto import tqdm

    torch.set_num_threads(args.threads)
    machine = machine_info("cpu")
    model, tokenizer = load_default()
    sets = []
    for set_path in args.sets:
        by_size = collections.defaultdict(lambda: [0, 0.0, 0])  # steps, expected, accepted
        steps = new_tokens = 0
        prompts = read_prompts(set_path, tokenizer)[: args.prompts]
        for ids in tqdm(prompts, desc=set_name(set_path)):
            out = model.generate(ids, max_new_tokens=args.max_new_tokens, lookahead=LookaheadConfig(), trace=True)
            steps += out.stats.steps
            new_tokens += out.stats.new_tokens
            for step in out.stats.trace:
                row = by_size[size_class(len(step.tokens))]
                row[0] += 1
                row[1] += step.expected
                row[2] += step.accepted
        order = ["0"] + [size_class(lo) for lo, _ in SIZE_CLASSES]
        sets.append({"set": set_name(set_path), "prompts": len(prompts), "steps": steps, "new_tokens": new_tokens,
                     "rows": [{"size": k, "steps": by_size[k][0], "expected": by_size[k][1],
                               "accepted": by_size[k][2]} for k in order if by_size[k][0]]})
    result = {"machine": machine, "command": command_line(__file__, sys.argv[1:] if argv is None else argv),
              "threads": args.threads, "max_new_tokens": args.max_new_tokens, "sets": sets}
    write_results(args.out_dir, f"calibration-{args.tag}", result, markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
