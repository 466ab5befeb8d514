"""Lookahead's speed-up on another device, predicted from that device's step costs: a design aid, not a measurement.

Greedy float32 tokens do not depend on the device, and the automatic planner's choices depend on the device only
through its cost table ``t(T)``. So decoding here on the static step path (padded trees from the step menu, as a
GPU runs them) with the device's table takes the steps that device would take; each step is then costed at
``t(B * T)`` from the table, plus host work per lookahead step (``--host-ms`` + ``--host-ms-per-row`` x rows) and
per ask that ended in a plain step (``--ask-ms``: the proposals were made, then declined), and plain decoding at
``t(B)`` a step. What this leaves out: whatever the table misses (sizes between its points are
interpolated linearly, as the planner does), a device's host speed, and everything that differs between this
machine's and the device's logits (in float32 a near tie may break apart; outputs are compared, and should match).

The planner runs as on the device: the table stands in for the measured one, so the gain calibration learns as
there, and its host cost fit is given the host work each step is costed at (``--host-ms``, ``--host-ms-per-row``),
not what this CPU takes beside its own forward: that ran cold, several times a GPU host's (``bench_host.py``), and
kept a batch's trees from paying in this bench's session 42-43 runs, which it costed at the figures given.

    python bench/bench_predict.py                                  # session 5's H100 table, 1 row, 16 prompts a set
    python bench/bench_predict.py --batch-sizes 16 --prompts 32 --max-new-tokens 64
    python bench/bench_predict.py --step-costs 1:2e-3,16:2.2e-3,64:2.4e-3,128:2.9e-3,256:3.9e-3 --tag flat

Writes bench/results/predict-<tag>.{json,md}.
"""

from __future__ import annotations

import argparse
import os
import sys
from unittest import mock

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from _common import DEFAULT_SETS, command_line, machine_info, parse_step_costs, set_name, write_results  # noqa: E402

from lookahead import DraftMemory, LookaheadConfig, load_default  # noqa: E402
from lookahead.cli import read_prompts  # noqa: E402
from lookahead.controller import HostCost, StepCosts, cost_key  # noqa: E402
from lookahead.runner import StepRunner  # noqa: E402

# SmolLM2 float32 on an H100 with CUDA graphs (bench/results/gpu-h100.md, git 5047120): the planner's GPU menu.
# Beyond the last point the planner, and this bench's costing, extrapolate linearly.
H100_STEP_COSTS = ((1, 2.15e-3), (16, 3.29e-3), (64, 3.51e-3), (128, 3.82e-3), (256, 5.05e-3))


def fed_tokens(fed: list):
    """Within the block every :meth:`StepRunner.run` appends the tokens its step feeds (rows x step size) to
    ``fed``."""
    real = StepRunner.run

    def run(runner, shape, tokens, *args, **kwargs):
        fed.append(tokens.shape[0] * tokens.shape[1])
        return real(runner, shape, tokens, *args, **kwargs)

    return mock.patch.object(StepRunner, "run", run)


def counted_asks(asks: list):
    """Within the block every proposal a lookahead step asks for (``lookahead.generate``'s ``propose_rows``: one
    ask a step, whether its planner then takes a tree or a plain step) appends 1 to ``asks``."""
    import lookahead.generate as generate

    real = generate.propose_rows

    def propose_rows(*args, **kwargs):
        asks.append(1)
        return real(*args, **kwargs)

    return mock.patch.object(generate, "propose_rows", propose_rows)


def costed_host(host_ms: float, host_ms_per_row: float):
    """Within the block the planner's host cost fit observes the host work the bench costs a step at."""
    real = HostCost.observe

    def observe(fit, rows, nodes, seconds):
        return real(fit, rows, nodes, 1e-3 * (host_ms + host_ms_per_row * rows))

    return mock.patch.object(HostCost, "observe", observe)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=16, help="first prompts of each set")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1])
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--step-costs", default="h100", help="'h100' (default) or T:seconds pairs")
    ap.add_argument("--host-ms", type=float, default=0.15, help="host work a lookahead step adds (ms)")
    ap.add_argument("--host-ms-per-row", type=float, default=0.02, help="and per row of the batch (ms)")
    ap.add_argument("--ask-ms", type=float, default=0.0,
                    help="host work of an ask whose step went plain (the rows' proposals and the planner's no, ms; "
                         "the H200's host at 4a84d54: about 0.09 at one row)")
    ap.add_argument("--prefill-ms", type=float, default=0.0,
                    help="each prompt's prefill (ms), paid by both modes (the H200's eager prefills: about 28)")
    ap.add_argument("--refill", action="store_true",
                    help="every prompt in one call with max_batch_size=B (a finished row's place goes to the next "
                         "prompt) instead of batches of B prompts one after another")
    ap.add_argument("--memory", action="store_true",
                    help="one DraftMemory a set: each call's lookahead reads the earlier calls' text (their plain "
                         "calls add nothing, so both modes decode the same prompts in the same order)")
    ap.add_argument("--sets", nargs="+", default=DEFAULT_SETS)
    ap.add_argument("--tag", default="h100")
    ap.add_argument("--out-dir", default=os.path.join(HERE, "results"))
    args = ap.parse_args(argv)
    pairs = parse_step_costs(args.step_costs, {"h100": H100_STEP_COSTS})
    costs = StepCosts.from_pairs(pairs)
    torch.set_num_threads(args.threads)
    machine = machine_info("cpu")
    model, tokenizer = load_default()
    model.step_costs_cache = {cost_key(model): costs}  # as if measured here: the planner learns as on a device
    config = LookaheadConfig()
    rows = []
    for set_path in args.sets:
        name = set_name(set_path)
        prompts = [ids[0] for ids in read_prompts(set_path, tokenizer)[: args.prompts]]
        for B in args.batch_sizes:
            memory = DraftMemory() if args.memory else None
            plain_s = lookahead_s = 0.0
            tokens = row_steps = identical = declined = 0
            sizes: dict[int, int] = {}
            groups = [prompts] if args.refill else [prompts[i: i + B] for i in range(0, len(prompts), B)]
            for batch in groups:
                prompt = batch if len(batch) > 1 else batch[0]
                kwargs = dict(max_new_tokens=args.max_new_tokens, cuda_graphs=False, _static_steps=True,
                              max_batch_size=B)
                plain_fed, fed, asks = [], [], []
                with fed_tokens(plain_fed):
                    plain = model.generate(prompt, lookahead=None, **kwargs)
                with fed_tokens(fed), counted_asks(asks), costed_host(args.host_ms, args.host_ms_per_row):
                    out = model.generate(prompt, lookahead=config, draft_memory=memory, **kwargs)
                rows_now = min(len(batch), B)
                declined_now = len(asks) - sum(t > rows_now for t in fed)  # asks whose step went plain
                declined += declined_now
                lookahead_s += 1e-3 * args.ask_ms * declined_now
                prefills = 1e-3 * args.prefill_ms * len(batch)
                plain_s += prefills + sum(costs(t) for t in plain_fed)
                lookahead_s += prefills
                host = 1e-3 * (args.host_ms + args.host_ms_per_row * rows_now)
                lookahead_s += sum(costs(t) + (host if t > rows_now else 0.0) for t in fed)
                for t in fed:
                    sizes[t] = sizes.get(t, 0) + 1
                tokens += out.stats.new_tokens
                row_steps += sum(r.steps for r in out.stats.rows) if out.stats.rows else out.stats.steps
                identical += sum(torch.equal(a, b) for a, b in zip(out.sequences, plain.sequences))
            rows.append({"set": name, "batch_size": B, "predicted_speedup": plain_s / lookahead_s,
                         "tokens_per_row_step": tokens / row_steps, "identical": identical, "prompts": len(prompts),
                         "plain_seconds": plain_s, "lookahead_seconds": lookahead_s, "declined_asks": declined,
                         "steps_by_tokens_fed": dict(sorted(sizes.items()))})
            r = rows[-1]
            print(f"{name:10s} B={B:<3d} predicted {r['predicted_speedup']:.2f}x plain, "
                  f"{r['tokens_per_row_step']:.2f} tokens a row-step, identical {identical}/{len(prompts)}",
                  flush=True)
    result = {"device": "cpu", "machine": machine, "command": command_line(__file__, sys.argv[1:] if argv is None
                                                                           else argv),
              "model": "SmolLM2-135M-Instruct (float32)", "step_costs": pairs,
              "host_ms": args.host_ms, "host_ms_per_row": args.host_ms_per_row, "ask_ms": args.ask_ms,
              "prefill_ms": args.prefill_ms,
              "prompts": args.prompts,
              "max_new_tokens": args.max_new_tokens, "refill": args.refill, "memory": args.memory, "rows": rows}
    write_results(args.out_dir, f"predict-{args.tag}", result, markdown(result))
    return 0


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = [f"# Lookahead's speed-up predicted from a step-cost table ({result['model']})", "",
             "**A prediction, not a measurement**: greedy decoding on this CPU through the static (padded) step path "
             "with the planner given the table below; each step costed at the table's t(rows x tokens) plus "
             f"{result['host_ms']} ms + {result['host_ms_per_row']} ms a row of host work per lookahead step, plain "
             "decoding at t(rows); the planner's host cost fit learns that host work"
             + (f"; each ask that ended in a plain step {result['ask_ms']} ms more" if result.get("ask_ms") else "")
             + (f"; each prompt's prefill {result['prefill_ms']} ms in both modes" if result.get("prefill_ms") else "")
             + ".", "",
             f"Decoded on {m['device']} ({m['cpu']}), torch {m['torch']}, git {m['git']}; the planner learning "
             f"as on a device; first {result['prompts']} prompts a set, {result['max_new_tokens']} new tokens"
             + ("; every prompt of a set in one call of at most `rows` rows at once, a finished row's place going to "
                "the next prompt (`max_batch_size`)" if result.get("refill") else "; batches of `rows` prompts one "
                "after another")
             + ("; one draft memory a set and batch size, filled by the lookahead calls in prompt order"
                if result.get("memory") else "") + ". "
             f"Step costs (tokens, seconds): {list(result['step_costs'])}.", "",
             f"Command: `{result['command']}`", "",
             "| set | rows | predicted vs plain | tokens a row-step | identical | steps by tokens fed "
             "| declined asks |", "|---|---:|---:|---:|---:|---|---:|"]
    for r in result["rows"]:
        sizes = ", ".join(f"{t}: {n}" for t, n in r["steps_by_tokens_fed"].items())
        lines.append(f"| {r['set']} | {r['batch_size']} | {r['predicted_speedup']:.2f}x | "
                     f"{r['tokens_per_row_step']:.2f} | {r['identical']}/{r['prompts']} | {sizes} | "
                     f"{r.get('declined_asks', '')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
