"""Tokens a row-step of device trees, greedy and sampled: the tables ``lookahead.controller.device_tree_size``
weighs against a device's step costs (``DEVICE_TREE_TOKENS``, ``DEVICE_TREE_TOKENS_SAMPLED``).

The tokens a step do not depend on the device, so a CPU measures them, on the static step path a GPU runs (without
graphs): each set's first ``--prompts`` prompts through ``--rows`` rows at once (a finished row's place going to the
next prompt), ``LookaheadConfig(device_tree=V)`` for each budget ``V``, under each decoding of ``--decodings``:
``greedy`` (every output compared with plain greedy decoding's) or ``T:K:P`` (sampling at temperature ``T``, top-k
``K``, top-p ``P``; ``1.0:50:1.0`` is transformers' default sampling; one seeded generator a run, ``--draws`` runs
with other seeds, averaged). Tokens a
row-step: new tokens over the rows' steps. The sets' average, and the speed-up each predicts on a step-cost table
(``tokens a step x t(B) / t(B (1 + V))``, the host work hidden as the overlapped steps hide it, the tree's two
launches not counted), with the size ``device_tree_size``'s rule takes from those averages at each batch size.

    python bench/bench_device_tree_tokens.py --decodings 1.0:50:1.0 0.7:50:0.9    # the library's sampled table

Writes bench/results/device-tree-tokens-<tag>.{json,md}.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from statistics import mean

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from _common import (add_prompt_set_args, command_line, machine_info, parse_step_costs, render,  # noqa: E402
                     set_name, write_results)
from bench_static_tree import H200_BF16_STEP_COSTS  # noqa: E402

from lookahead import LookaheadConfig, load_default  # noqa: E402
from lookahead.cli import read_prompts  # noqa: E402
from lookahead.controller import BATCH_MARGIN, StepCosts, device_tree_size  # noqa: E402


def decoding(text: str) -> dict:
    """``greedy`` -> ``{}``; ``T:K:P`` -> generate's sampling keywords."""
    if text == "greedy":
        return {}
    try:
        t, k, p = text.split(":")
        return dict(do_sample=True, temperature=float(t), top_k=int(k), top_p=float(p))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"a decoding is 'greedy' or T:K:P (e.g. 1.0:50:1.0), got {text!r}") from exc


def tokens_a_step(model, prompts: list[torch.Tensor], budget: int, rows: int, max_new_tokens: int,
                  sampling: dict, seed: int) -> tuple[float, torch.Tensor]:
    """Tokens a row-step of ``device_tree=budget`` over ``prompts``, and the call's sequences."""
    kwargs = dict(sampling, generator=torch.Generator().manual_seed(seed)) if sampling else {}
    out = model.generate(prompts, max_new_tokens=max_new_tokens, lookahead=LookaheadConfig(device_tree=budget),
                         max_batch_size=rows, cuda_graphs=False, _static_steps=True, **kwargs)
    return out.stats.new_tokens / sum(r.steps for r in out.stats.rows), out.sequences


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_prompt_set_args(ap, prompts=24, max_new_tokens=128)
    ap.add_argument("--rows", type=int, default=16, help="rows decoded at once (refilled)")
    ap.add_argument("--budgets", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--decodings", nargs="+", default=["greedy"], help="'greedy' or T:K:P sampling settings")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--step-costs", default="h200-bf16", help="'h200-bf16' (default) or T:seconds pairs")
    ap.add_argument("--draws", type=int, default=1,
                    help="runs of each sampled decoding and size, each its own seed; averaged (greedy: one)")
    args = ap.parse_args(argv)
    if args.draws < 1:
        ap.error(f"--draws must be at least 1, got {args.draws}")
    if args.render:
        render(args.render, markdown, lambda result, path: None)
        return 0
    for text in args.decodings:
        try:
            decoding(text)
        except argparse.ArgumentTypeError as exc:
            ap.error(str(exc))
    pairs = parse_step_costs(args.step_costs, {"h200-bf16": H200_BF16_STEP_COSTS})
    torch.set_num_threads(args.threads)
    machine = machine_info("cpu")  # at the start: the revision that runs, whatever is committed meanwhile
    model, tokenizer = load_default()
    rows = []
    for path in args.sets:
        prompts = [ids[0] for ids in read_prompts(path, tokenizer)[: args.prompts]]
        plain = None
        for text in args.decodings:
            sampling = decoding(text)
            if not sampling and plain is None:
                plain = model.generate(prompts, max_new_tokens=args.max_new_tokens, lookahead=None,
                                       max_batch_size=args.rows).sequences
            for budget in args.budgets:
                for draw in range(args.draws if sampling else 1):
                    started = time.perf_counter()
                    per_step, sequences = tokens_a_step(model, prompts, budget, args.rows, args.max_new_tokens,
                                                        sampling, seed=budget + 1000 * draw)
                    row = {"set": set_name(path), "prompts": len(prompts), "decoding": text, "budget": budget,
                           "draw": draw, "tokens_per_step": per_step, "seconds": time.perf_counter() - started}
                    if not sampling:
                        row["identical"] = sum(a.equal(b) for a, b in zip(sequences, plain))
                    rows.append(row)
                    print(f"{row['set']:10s} {text:12s} V={budget:<3d} draw {draw} {per_step:.3f} tokens a row-step "
                          f"({row['seconds']:.0f} s)", flush=True)
    result = {"device": "cpu", "machine": machine, "model": "SmolLM2-135M-Instruct (float32)",
              "command": command_line(__file__, sys.argv[1:] if argv is None else argv),
              "prompts": args.prompts, "max_new_tokens": args.max_new_tokens, "rows_at_once": args.rows,
              "draws": args.draws, "step_costs": pairs, "batch_sizes": args.batch_sizes, "rows": rows,
              "averages": averages(rows)}
    write_results(args.out_dir, f"device-tree-tokens-{args.tag}", result, markdown(result))
    return 0


def averages(rows: list[dict]) -> dict:
    """Per decoding, ``[[V, the mean tokens a row-step over its sets and draws], ...]``: a table as
    ``DEVICE_TREE_TOKENS`` is."""
    out = {}
    for text in dict.fromkeys(r["decoding"] for r in rows):
        budgets = dict.fromkeys(r["budget"] for r in rows if r["decoding"] == text)
        out[text] = [[v, mean(r["tokens_per_step"] for r in rows if r["decoding"] == text and r["budget"] == v)]
                     for v in budgets]
    return out


def markdown(result: dict) -> str:
    m = result["machine"]
    costs = StepCosts.from_pairs(result["step_costs"])
    sizes = result["batch_sizes"]
    sets = list(dict.fromkeys(r["set"] for r in result["rows"]))
    lines = [f"# Tokens a row-step of device trees, greedy and sampled ({result['model']})", "",
             f"`LookaheadConfig(device_tree=V)` on the static step path (no graphs), on {m['device']} ({m['cpu']}), "
             f"torch {m['torch']}, git {m['git']}: the first {result['prompts']} prompts of each set, "
             f"{result['rows_at_once']} rows at once (refilled), {result['max_new_tokens']} new tokens. A decoding "
             "`T:K:P` samples at temperature T, top-k K, top-p P. The tokens a step do not depend on the device; "
             "the speed-ups are predicted on the step costs (tokens, seconds) "
             + ", ".join(f"({t}, {c:g})" for t, c in result["step_costs"]) + " (tokens a step x t(B) / "
             "t(B (1 + V)), the host work hidden, the tree's launches not counted): not a measurement of speed.", "",
             f"Command: `{result['command']}`", "",
             "| decoding | V | " + " | ".join(sets) + " | mean | each draw's mean | identical | "
             + " | ".join(f"{B} rows" for B in sizes) + " |",
             "|---|---:|" + "---:|" * (len(sets) + 3) + "---:|" * len(sizes)]
    for text, table in result["averages"].items():
        for v, average in table:
            runs = [r for r in result["rows"] if r["decoding"] == text and r["budget"] == v]
            same = [r["identical"] for r in runs if "identical" in r]
            total = sum(r["prompts"] for r in runs if "identical" in r)
            cells = [f"{mean(r['tokens_per_step'] for r in runs if r['set'] == s):.3f}"
                     if any(r["set"] == s for r in runs) else "" for s in sets]
            draws = sorted({r.get("draw", 0) for r in runs})
            each = " / ".join(f"{mean(r['tokens_per_step'] for r in runs if r.get('draw', 0) == d):.3f}"
                              for d in draws) if len(draws) > 1 else ""
            lines.append(f"| {text} | {v} | " + " | ".join(cells) + f" | {average:.3f} | {each} | "
                         + (f"{sum(same)}/{total}" if same else "") + " | "
                         + " | ".join(f"{average * costs(B) / costs(B * (1 + v)):.2f}x" for B in sizes) + " |")
    lines += ["", f"The size `device_tree_size`'s rule takes on these averages (plain steps, 0, unless a tree beats "
              f"them by {BATCH_MARGIN:.2f}x):", "", "| decoding | " + " | ".join(f"{B} rows" for B in sizes) + " |",
              "|---|" + "---:|" * len(sizes)]
    for text, table in result["averages"].items():
        chosen = [device_tree_size(costs, B, tokens=tuple(map(tuple, table))) for B in sizes]
        lines.append(f"| {text} | " + " | ".join(map(str, chosen)) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
