"""How far a suffix match's continuation can be trusted, by the match's length and the depth into it.

Each dev prompt is decoded greedily (lookahead on: the output is plain greedy's). Then, at every position of the
output as a step's ``x``, the suffix index (``lookahead.suffix.SuffixIndex``, the builder's settings) is asked for
its continuations, and each is compared with what the model went on to write. A continuation's token at depth
``d`` is *tested* when the ``d - 1`` before it were the model's, and *accepted* when it is the model's too: the
conditional acceptance the draft builder estimates per key (``lookahead.draft.AcceptanceStats``). This depends on
the model and the prompts, not on the machine, so it runs on a CPU.

Why: the builder once learned one rate per depth for every suffix match, and a one-token match (a newline, a
comma) was trusted like an eight-token one. This table is the evidence for keying the rate by match length.

    python bench/bench_suffix.py --prompts 16 --tag cpu-16

Writes bench/results/suffix-<tag>.{json,md,png}.
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

from _common import (add_prompt_set_args, command_line, machine_info, pyplot, render, set_name,  # noqa: E402
                     write_results)

from lookahead import LookaheadConfig, load_default  # noqa: E402
from lookahead.cli import read_prompts  # noqa: E402
from lookahead.draft import SUFFIX_CANDIDATES  # noqa: E402
from lookahead.suffix import SuffixIndex  # noqa: E402

MAX_DEPTH = 8  # the builder's deepest depth key: deeper nodes share its rate
MAX_MATCH = SuffixIndex().max_match  # the longest match measured: longer ones count as this


def tally(sequence: list[int], prompt_len: int) -> tuple[collections.Counter, collections.Counter]:
    """Tested and accepted counts per ``(match length, depth)`` over every step position of one output."""
    tested, accepted = collections.Counter(), collections.Counter()
    index = SuffixIndex()
    for p in range(prompt_len - 1, len(sequence) - 1):
        for cont, match in index.matches(sequence[: p + 1], SUFFIX_CANDIDATES):
            agree = 0  # leading tokens of the continuation that the model wrote next
            while agree < len(cont) and p + 1 + agree < len(sequence) and cont[agree] == sequence[p + 1 + agree]:
                agree += 1
            for d in range(1, len(cont) + 1):
                if p + d >= len(sequence) or agree < d - 1:
                    break
                key = (match, min(d, MAX_DEPTH))
                tested[key] += 1
                accepted[key] += agree >= d
    return tested, accepted


def markdown(result: dict) -> str:
    lines = ["# Suffix matches: conditional acceptance by match length and depth", "",
             f"`{result['command']}` at {result['machine']['git']} (SmolLM2-135M, float32, "
             f"{result['machine']['cpu']}): {result['max_new_tokens']} greedy "
             f"tokens per prompt. Each cell: accepted / tested, given the tokens before it were accepted; depth "
             f"{MAX_DEPTH} counts every deeper token too. The builder learns one rate per class of match length "
             "(1, 2-3, 4-7, 8+) and depth.", ""]
    for s in result["sets"]:
        lines += [f"## {s['set']} ({s['prompts']} prompts)", "",
                  "| match | " + " | ".join(f"d{d}" for d in range(1, MAX_DEPTH + 1)) + " |",
                  "|---|" + "---|" * MAX_DEPTH]
        cells = {(c["match"], c["depth"]): c for c in s["cells"]}
        for m in range(1, MAX_MATCH + 1):
            row = [f"{cells[(m, d)]['accepted'] / cells[(m, d)]['tested']:.2f} ({cells[(m, d)]['tested']})"
                   if (m, d) in cells else "" for d in range(1, MAX_DEPTH + 1)]
            lines.append(f"| {m}{'+' if m == MAX_MATCH else ''} | " + " | ".join(row) + " |")
        pooled = []
        for d in range(1, MAX_DEPTH + 1):
            t = sum(c["tested"] for c in s["cells"] if c["depth"] == d)
            a = sum(c["accepted"] for c in s["cells"] if c["depth"] == d)
            pooled.append(f"{a / t:.2f} ({t})" if t else "")
        lines += ["| any (one rate per depth) | " + " | ".join(pooled) + " |", ""]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for s, style in zip(result["sets"], ("-o", "--s")):
        cells = {(c["match"], c["depth"]): c for c in s["cells"]}
        matches = [m for m in range(1, MAX_MATCH + 1) if (m, 1) in cells]
        ax.plot(matches, [cells[(m, 1)]["accepted"] / cells[(m, 1)]["tested"] for m in matches], style,
                label=s["set"])
    ax.set_xlabel("suffix match length (tokens; the last: 8 or more)")
    ax.set_ylabel("first continuation token accepted")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("Longer suffix matches predict the next token better")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_prompt_set_args(ap, prompts=16, max_new_tokens=160)
    args = ap.parse_args(argv)
    if args.render:
        render(args.render, markdown, plot)
        return 0
    from tqdm.auto import tqdm

    torch.set_num_threads(args.threads)
    machine = machine_info("cpu")
    model, tokenizer = load_default()
    sets = []
    for set_path in args.sets:
        tested, accepted = collections.Counter(), collections.Counter()
        prompts = read_prompts(set_path, tokenizer)[: args.prompts]
        for ids in tqdm(prompts, desc=set_name(set_path)):
            out = model.generate(ids, max_new_tokens=args.max_new_tokens, lookahead=LookaheadConfig())
            t, a = tally(out.sequences[0].tolist(), ids.shape[1])
            tested.update(t)
            accepted.update(a)
        sets.append({"set": set_name(set_path), "prompts": len(prompts),
                     "cells": [{"match": m, "depth": d, "tested": tested[(m, d)], "accepted": accepted[(m, d)]}
                               for m, d in sorted(tested)]})
    result = {"machine": machine, "command": command_line(__file__, sys.argv[1:] if argv is None else argv),
              "max_new_tokens": args.max_new_tokens, "sets": sets}
    base = write_results(args.out_dir, f"suffix-{args.tag}", result, markdown(result))
    plot(result, base + ".png")
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
