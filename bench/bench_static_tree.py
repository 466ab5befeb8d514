"""A static successor tree kept on the device, predicted: the tokens a step it would give, and the speed-up that
buys on a step-cost table when the tree costs the host nothing. A design aid, not a measurement.

Why: a batch's lookahead step builds each row's tree on the host (suffix matches, pool rows, successor tables, a
best-first walk), and at 16 rows that host work, about 0.3 ms a step on this CPU, is what keeps the GPU's batches
from paying (``bench/MEASUREMENTS.md``, sessions 64-66). A tree whose shape is fixed and whose tokens are read from
a successor table on the device (node ``i``'s token: the ``rank[i]``-th successor of its parent's token) needs
no host work at all: the gather, the forward, the verification and the table's update can all run in the step's
graph. This bench asks what such a tree would accept, before anything is built.

How: each prompt is decoded greedily (our plain decoding), and one forward over prompt and output gives every
position's top ``k`` next tokens: what the model predicts there in its true context. A simulated decode then walks
the output: at each step the tree is read off the tables of the tops recorded so far (``Recorded``: per token and per
pair of tokens, the latest tops win; a node reads its (grandparent, parent) pair's where that pair was recorded, else
its parent's; with ``seed``, every prompt position's are recorded before the first step, the token that followed it
first, as the implementation's prefill does), the longest tree path that the true output continues is accepted, and the
tops of the step's fed token and accepted nodes are recorded. The implementation also records every rejected node's
tops under its token (since session 70), which the simulation cannot know (they are the model's predictions in the
contexts the tree guessed, which this one forward never computes), and since session 71 starts each row's table from
every token's top successors (``lookahead.device_tree.token_prior``), which the simulation leaves out: its
tokens a step are a lower bound of the implementation's, which ``--measure`` gives. The tree for a budget of ``V``
nodes holds the ``V`` rank paths most likely to be accepted, each rank's rate of being the next token fitted on the
other prompt set (cross-validated), as ``lookahead.device_tree.StaticTree.best`` makes them; the rates of both sets
pooled are the library's ``RANK_RATES`` (printed, and kept in the JSON as ``pooled_rank_rates``).

The predicted speed-up at ``B`` rows is ``tokens a step x t(B) / t(B (1 + V))`` on the step-cost table, with the
host work of a step taken as plain decoding's (the point of keeping the tree on the device) and nothing for the
table's gather and update.

    python bench/bench_static_tree.py                      # the H200's bfloat16 table, 48 prompts a set
    python bench/bench_static_tree.py --measure            # and the tokens a step lookahead.device_tree takes

``--measure`` decodes every prompt again with ``LookaheadConfig(device_tree=V)`` (``--measure-rows`` rows at once,
a finished row's place going to the next prompt, on the static step path as a GPU runs it) and reports its tokens
a row-step beside the simulation's with the prompt's tops recorded first (the implementation seeds its tables from
the prompt's rows and records the same tops after each step), and whether every output equals plain decoding's.

Writes bench/results/static-tree-<tag>.{json,md}.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from _common import (DEFAULT_SETS, command_line, machine_info, parse_step_costs, render, set_name,  # noqa: E402
                     write_results)

from lookahead import LookaheadConfig, load_default  # noqa: E402
from lookahead.cli import read_prompts  # noqa: E402
from lookahead.controller import StepCosts  # noqa: E402
from lookahead.device_tree import StaticTree  # noqa: E402

# SmolLM2 bfloat16 on the H200 with CUDA graphs (session 57, bench/results/batch-nvidia-h200-bfloat16.json).
H200_BF16_STEP_COSTS = ((1, 1.227e-3), (16, 1.299e-3), (64, 1.339e-3), (128, 1.463e-3), (256, 1.792e-3),
                        (1024, 3.599e-3))


def decoded_rows(model, prompts: list[torch.Tensor], max_new_tokens: int, k: int) -> list[dict]:
    """Per prompt: ``seq`` (prompt and greedy output, a list), ``prompt_len`` and ``tops`` (per position of
    ``seq``, the ``k`` most likely next tokens in its true context, most likely first)."""
    rows = []
    for ids in prompts:
        seq = model.generate(ids[None], max_new_tokens=max_new_tokens, lookahead=None).sequences[0]
        with torch.no_grad():
            logits = model(seq[None]).logits[0]
        rows.append({"seq": seq.tolist(), "prompt_len": int(ids.shape[-1]),
                     "tops": logits.topk(k, dim=-1).indices.tolist()})
    return rows


def _first_recorded(row: dict, seed: bool) -> int:
    # Without a seed the table starts with the prefill's last row only, as a decode's first step finds it.
    return 0 if seed else row["prompt_len"] - 1


class Recorded:
    """One row's tables as ``lookahead.device_tree.DeviceSuccessors`` keeps them, as dicts: per token and per
    pair of tokens, the tops recorded at its latest position. A prompt position records the token that followed
    it first, then its tops (a decoded position's next token is its top, greedily); a lookup takes the pair's
    entry where there is one, else the token's. (The library's pairs share a direct-mapped table of 16384 slots a
    row; with 512 slots these dev sets lost under 0.02 tokens a step, so the exact dict stands in for it.)"""

    def __init__(self, row: dict, seed: bool):
        self.seq, self.tops = row["seq"], row["tops"]
        self.tokens: dict[int, list[int]] = {}
        self.pairs: dict[tuple[int, int], list[int]] = {}
        for i in range(_first_recorded(row, seed), row["prompt_len"]):
            following = self.seq[i + 1]
            self.record(i, ([following] + [t for t in self.tops[i] if t != following])[: len(self.tops[i])])

    def record(self, i: int, entry: list[int] | None = None) -> None:
        """Position ``i``'s tops (or ``entry``) under its token and under its pair."""
        entry = self.tops[i] if entry is None else entry
        self.tokens[self.seq[i]] = entry
        if i:
            self.pairs[(self.seq[i - 1], self.seq[i])] = entry

    def successors(self, i: int) -> list[int] | None:
        """What the tables say follows position ``i``'s token in its context (``None``: nothing recorded)."""
        entry = self.pairs.get((self.seq[i - 1], self.seq[i])) if i else None
        return entry if entry is not None else self.tokens.get(self.seq[i])


def rank_rates(rows: list[dict], k: int, seed: bool) -> list[float]:
    """For each rank ``r < k``: how often the next token was the ``r``-th successor recorded for the current one,
    among the steps of one-token decoding where the current token had successors recorded."""
    hits, seen = [0] * k, 0
    for row in rows:
        seq, tables = row["seq"], Recorded(row, seed)
        for i in range(row["prompt_len"], len(seq) - 1):
            entry = tables.successors(i)
            if entry is not None:
                seen += 1
                if seq[i + 1] in entry:
                    hits[entry.index(seq[i + 1])] += 1
            tables.record(i)
    return [h / max(seen, 1) for h in hits]


def simulate(rows: list[dict], tree: list[tuple[int, ...]], seed: bool) -> tuple[int, int]:
    """``(tokens, steps)`` of decoding ``rows``' outputs with ``tree`` read off each row's tables."""
    children: dict[tuple, list[tuple[int, ...]]] = {}
    for path in tree:
        children.setdefault(path[:-1], []).append(path)
    tokens = steps = 0
    for row in rows:
        seq, tables = row["seq"], Recorded(row, seed)
        i = row["prompt_len"]  # seq[i] is x: the prefill's token
        while i < len(seq) - 1:
            accepted, node = 0, ()
            while i + accepted + 1 < len(seq):
                entry, wanted = tables.successors(i + accepted), seq[i + accepted + 1]
                step = None if entry is None else next(
                    (c for c in children.get(node, ()) if c[-1] < len(entry) and entry[c[-1]] == wanted), None)
                if step is None:
                    break
                node, accepted = step, accepted + 1
            emitted = min(accepted + 1, len(seq) - 1 - i)
            for j in range(i, i + emitted):  # x's and the accepted nodes' tops: their true contexts
                tables.record(j)
            tokens, steps, i = tokens + emitted, steps + 1, i + emitted
    return tokens, steps


def measured(model, prompts: list[torch.Tensor], rows: list[dict], budget: int, max_new_tokens: int,
             batch_size: int) -> tuple[float, int]:
    """``(tokens a row-step, outputs equal to plain decoding's)`` of ``LookaheadConfig(device_tree=budget)``."""
    out = model.generate(prompts, max_new_tokens=max_new_tokens, lookahead=LookaheadConfig(device_tree=budget),
                         max_batch_size=batch_size, cuda_graphs=False, _static_steps=True)
    L = max(p.numel() for p in prompts)
    identical = sum(out.sequences[b, L - p.numel(): L + row.new_tokens].tolist() == r["seq"]
                    for b, (p, r, row) in enumerate(zip(prompts, rows, out.stats.rows)))
    return out.stats.new_tokens / sum(row.steps for row in out.stats.rows), identical


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=48, help="first prompts of each set")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--budgets", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16, 32])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--k", type=int, default=8, help="successors kept a token")
    ap.add_argument("--step-costs", default="h200-bf16", help="'h200-bf16' (default) or T:seconds pairs")
    ap.add_argument("--sets", nargs="+", default=DEFAULT_SETS)
    ap.add_argument("--measure", action="store_true",
                    help="also decode with LookaheadConfig(device_tree=V) and report its tokens a step")
    ap.add_argument("--measure-rows", type=int, default=16, help="rows at once with --measure")
    ap.add_argument("--tag", default="h200-bf16")
    ap.add_argument("--out-dir", default=os.path.join(HERE, "results"))
    ap.add_argument("--render", metavar="JSON", help="only re-write the markdown of a results file")
    args = ap.parse_args(argv)
    if args.render:
        render(args.render, markdown, lambda result, path: None)
        return 0
    if len(args.sets) != 2:
        raise SystemExit("--sets: two prompt sets (each tree's ranks are fitted on the other set)")
    pairs = parse_step_costs(args.step_costs, {"h200-bf16": H200_BF16_STEP_COSTS})
    costs = StepCosts.from_pairs(pairs)
    torch.set_num_threads(args.threads)
    machine = machine_info("cpu")  # at the start: the revision that runs, whatever is committed meanwhile
    model, tokenizer = load_default()
    decoded, prompt_sets = [], []
    for path in args.sets:
        prompt_sets.append([ids[0] for ids in read_prompts(path, tokenizer)[: args.prompts]])
        decoded.append(decoded_rows(model, prompt_sets[-1], args.max_new_tokens, args.k))
        print(f"decoded {set_name(path)}: {len(decoded[-1])} prompts", flush=True)
    # The library's RANK_RATES: both sets pooled, tables seeded (as lookahead.device_tree keeps them).
    pooled = rank_rates(decoded[0] + decoded[1], args.k, True)
    print("rank rates, both sets, seeded:", ", ".join(f"{r:.3f}" for r in pooled), flush=True)
    rows = []
    for seed in (False, True):
        for s, path in enumerate(args.sets):
            rates = rank_rates(decoded[1 - s], args.k, seed)
            for budget in args.budgets:
                tree = StaticTree.best(budget, rates).paths  # the library's trees, on these rates
                tokens, steps = simulate(decoded[s], tree, seed)
                per_step = tokens / steps
                rows.append({"set": set_name(path), "prompts": len(decoded[s]), "seed": seed, "budget": budget,
                             "depth": max(map(len, tree)), "tokens_per_step": per_step,
                             "rank_rates": rates, "tree": [list(p) for p in tree],
                             "predicted_speedup": {str(B): per_step * costs(B) / costs(B * (1 + budget))
                                                   for B in args.batch_sizes}})
                if args.measure and seed:  # the implementation's tables start from the prompt's rows, as these
                    rows[-1]["measured_tokens_per_step"], rows[-1]["measured_identical"] = measured(
                        model, prompt_sets[s], decoded[s], budget, args.max_new_tokens, args.measure_rows)
                speedups = ", ".join(f"{B} rows {v:.2f}x" for B, v in rows[-1]["predicted_speedup"].items())
                real = f" (measured {rows[-1]['measured_tokens_per_step']:.2f})" \
                    if "measured_tokens_per_step" in rows[-1] else ""
                print(f"{set_name(path):10s} seed={seed!s:5s} V={budget:<3d} {per_step:.2f} tokens a step{real}; "
                      f"{speedups}", flush=True)
    result = {"device": "cpu", "machine": machine,
              "command": command_line(__file__, sys.argv[1:] if argv is None else argv),
              "model": "SmolLM2-135M-Instruct (float32)", "step_costs": pairs, "prompts": args.prompts,
              "max_new_tokens": args.max_new_tokens, "k": args.k, "batch_sizes": args.batch_sizes,
              "measure_rows": args.measure_rows if args.measure else None, "pooled_rank_rates": pooled,
              "rows": rows}
    write_results(args.out_dir, f"static-tree-{args.tag}", result, markdown(result))
    return 0


def markdown(result: dict) -> str:
    m = result["machine"]
    sizes = result["batch_sizes"]
    lines = [f"# A static successor tree on the device, predicted ({result['model']})", "",
             "**A prediction, not a measurement**: greedy outputs decoded on this CPU, every position's top "
             f"{result['k']} next tokens from one forward over prompt and output, then each step's tree of V nodes "
             "read off the tops recorded so far (`bench/bench_static_tree.py`'s docstring says how). Speed-ups: "
             "tokens a step x t(B) / t(B (1 + V)) on the step-cost table, the host work taken as plain decoding's.",
             "", f"Decoded on {m['device']} ({m['cpu']}), torch {m['torch']}, git {m['git']}; first "
             f"{result['prompts']} prompts a set (fewer where a set has fewer: `prompts`), "
             f"{result['max_new_tokens']} new tokens. Step costs (tokens, seconds): {list(result['step_costs'])}.",
             "", f"Command: `{result['command']}`", ""]
    if result.get("measure_rows"):
        lines += [f"Measured: `LookaheadConfig(device_tree=V)` decoding the same prompts, {result['measure_rows']} "
                  "rows at once (refilled), its tokens a row-step and its outputs equal to plain decoding's "
                  "(`identical`).", ""]
        lines += ["Speed-ups in parentheses: the same formula with the measured tokens a step (what the "
                  "implementation's tables give, the rejected nodes' predictions included since session 70).", ""]
    costs = StepCosts.from_pairs(result["step_costs"])
    lines += ["| set | prompts | prompt tops recorded first | V | depth | tokens a step | measured | identical | "
              + " | ".join(f"{B} rows" for B in sizes) + " |",
              "|---|---:|---|---:|---:|---:|---:|---:|" + "---:|" * len(sizes)]
    for r in result["rows"]:
        real = f"{r['measured_tokens_per_step']:.2f}" if "measured_tokens_per_step" in r else ""
        same = f"{r['measured_identical']}/{r['prompts']}" if "measured_identical" in r else ""
        speedups = []
        for B in sizes:
            cell = f"{r['predicted_speedup'][str(B)]:.2f}x"
            if real:
                cell += f" ({r['measured_tokens_per_step'] * costs(B) / costs(B * (1 + r['budget'])):.2f}x)"
            speedups.append(cell)
        lines.append(f"| {r['set']} | {r.get('prompts', '')} | {'yes' if r['seed'] else 'no'} | {r['budget']} | "
                     f"{r['depth']} | {r['tokens_per_step']:.2f} | {real} | {same} | " + " | ".join(speedups) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
