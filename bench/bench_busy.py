"""Decoding on a CPU busy with other work: tokens/s by thread count, with and without other processes spinning.

A decoding step runs every layer's parallel regions on all of torch's threads, and each region waits for its
slowest thread: when other processes hold the cores, a step waits on threads the scheduler has not run yet. This
bench decodes the first prompts of each set plainly and with automatic lookahead, at each ``--thread-counts``,
idle and beside ``--busy`` processes that spin on a core each (started by the bench, stopped at its end), the
thread counts alternating round by round; it reports the median tokens/s of the rounds.

    python bench/bench_busy.py --thread-counts 2 1 --busy 2 --rounds 3

Writes bench/results/busy-<tag>.{json,md}.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from _common import add_run_args, command_line, first_prompts, machine_info, write_results  # noqa: E402

from lookahead import load_default  # noqa: E402

MODES = {"plain": dict(lookahead=None), "lookahead": {}}


def _spin() -> None:
    while True:
        pass


def _decode_rounds(model, prompts, thread_counts, rounds, max_new_tokens) -> dict:
    """``{(threads, mode): [tokens/s of each round]}``, thread counts alternating within each round."""
    speeds: dict = {}
    for _ in range(rounds):
        for threads in thread_counts:
            torch.set_num_threads(threads)
            for mode, kwargs in MODES.items():
                new = seconds = 0.0
                for _, ids in prompts:
                    out = model.generate(ids, max_new_tokens=max_new_tokens, **kwargs)
                    new += out.stats.new_tokens
                    seconds += out.stats.seconds
                speeds.setdefault((threads, mode), []).append(new / seconds)
    return speeds


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_args(ap, prompts=2, max_new_tokens=64, threads=False)  # its thread counts are --thread-counts
    ap.add_argument("--thread-counts", type=int, nargs="+", default=[2, 1])
    ap.add_argument("--busy", type=int, default=2, help="spinning processes beside the busy runs")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    if min(args.thread_counts) < 1 or args.busy < 0 or args.rounds < 1:
        ap.error("--thread-counts must be >= 1, --busy >= 0 and --rounds >= 1")
    machine = machine_info("cpu")
    model, tokenizer = load_default()
    prompts = first_prompts(args.sets, tokenizer, args.prompts)
    for threads in args.thread_counts:  # warm-up: packed weights, step costs of each thread count
        torch.set_num_threads(threads)
        for kwargs in MODES.values():
            model.generate(prompts[0][1], max_new_tokens=8, **kwargs)
    rows = []
    for busy in (0, args.busy):
        spinners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(busy)]
        for s in spinners:
            s.start()
        try:
            speeds = _decode_rounds(model, prompts, args.thread_counts, args.rounds, args.max_new_tokens)
        finally:
            for s in spinners:
                s.terminate()
        for (threads, mode), rates in speeds.items():
            rows.append({"busy": busy, "threads": threads, "mode": mode, "tokens_per_s": statistics.median(rates),
                         "rounds": rates})
            print(f"busy {busy} threads {threads} {mode:9s} {statistics.median(rates):7.1f} tokens/s "
                  f"(rounds {', '.join(f'{r:.1f}' for r in rates)})", flush=True)
    result = {"device": "cpu", "machine": machine, "command": command_line(__file__, sys.argv[1:] if argv is None
                                                                           else argv),
              "model": "SmolLM2-135M-Instruct (float32)", "prompts": len(prompts),
              "max_new_tokens": args.max_new_tokens, "busy": args.busy, "rows": rows}
    write_results(args.out_dir, f"busy-{args.tag}", result, markdown(result))
    return 0


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = [f"# Decoding on a busy CPU ({result['model']})", "",
             f"{m['device']} ({m['cpu']}), torch {m['torch']}, git {m['git']}; greedy, {result['prompts']} prompts "
             f"(the first of each set), {result['max_new_tokens']} new tokens each; tokens/s over them (`stats`), "
             f"the median of the rounds. Busy: that many other processes spinning on a core each.", "",
             f"Command: `{result['command']}`", "",
             "| other busy processes | threads | mode | tokens/s (median) | rounds |", "|---:|---:|---|---:|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['busy']} | {r['threads']} | {r['mode']} | {r['tokens_per_s']:.1f} | "
                     f"{', '.join(f'{x:.1f}' for x in r['rounds'])} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
