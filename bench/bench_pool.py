"""Microseconds per decoding step spent in the n-gram pool: insert W n-grams, then look up one key.

Backends: Python reference and C++ (CPU; both serve a GPU too, the draft being built on the host). Defaults:
W=15 n-grams of N=5 per step, G=15, vocab 49152 and 128256. Medians over the timed steps after warm-up steps.

Token stream: ids drawn from a Zipf-like law (P(rank r) ~ r^-1.1, ranks mapped to random ids), as text is.
Step t inserts the n-grams starting at stream positions t .. t+W-1 (like the window's columns), each later
token of an n-gram replaced by a fresh Zipf draw with probability 0.3 (the noise of Jacobi guesses), so keys
repeat, continuations are sometimes already present and sometimes evict; then it looks up key stream[t+1].

Both are timed with perf_counter around ``insert`` and ``lookup(int)``. (Earlier results also have rows for a
CUDA pool, since removed: bench/MEASUREMENTS.md.)

    python bench/bench_pool.py                    # writes bench/results/pool-<device>.{json,md}
    python bench/bench_pool.py --steps 200 --vocab 49152
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

from _common import command_line, device_label, device_slug, machine_info, write_results  # noqa: E402

from lookahead.pool import NGramPool  # noqa: E402
from lookahead.pools import CppNGramPool  # noqa: E402


def zipf_tokens(count: int, vocab: int, gen: torch.Generator, exponent: float = 1.1) -> torch.Tensor:
    weights = torch.arange(1, vocab + 1, dtype=torch.float64).pow(-exponent)
    ranks = torch.multinomial(weights, count, replacement=True, generator=gen)
    return torch.randperm(vocab, generator=gen)[ranks]


def make_steps(vocab: int, steps: int, window: int, ngram: int, gen: torch.Generator):
    """Per step: (ngrams int64 [window, ngram], key int)."""
    stream = zipf_tokens(steps + window + ngram, vocab, gen)
    cols = stream.unfold(0, ngram, 1)  # [positions, ngram]
    out = []
    for t in range(steps):
        ngrams = cols[t:t + window].clone()
        noise = torch.rand(window, ngram - 1, generator=gen) < 0.3
        ngrams[:, 1:][noise] = zipf_tokens(int(noise.sum()), vocab, gen)
        out.append((ngrams, int(stream[t + 1])))
    return out


def time_steps(pool, steps, warmup: int) -> dict:
    ins, look = [], []
    for i, (ngrams, key) in enumerate(steps):
        t0 = time.perf_counter_ns()
        pool.insert(ngrams)
        t1 = time.perf_counter_ns()
        pool.lookup(key)
        t2 = time.perf_counter_ns()
        if i >= warmup:
            ins.append((t1 - t0) / 1e3)
            look.append((t2 - t1) / 1e3)
    return summarize(ins, look)


def summarize(ins: list[float], look: list[float]) -> dict:
    total = [a + b for a, b in zip(ins, look)]
    return {"insert_us": statistics.median(ins), "lookup_us": statistics.median(look),
            "step_us": statistics.median(total), "timed_steps": len(total)}


def render_markdown(result: dict) -> str:
    m = result["machine"]
    lines = [
        "# N-gram pool: microseconds per step",
        "",
        f"Per step: insert {result['window']} n-grams of N={result['ngram']}, then one lookup; G={result['guess']}. "
        f"Medians over {result['steps']} steps after {result['warmup']} warm-up steps.",
        "",
        f"Device: {device_label(m)} ({m['cpu']}, {m['cpu_count']} CPUs); torch {m['torch']}, CUDA {m['cuda']}, "
        f"Python {m['python']}; git {m['git']}.",
        f"Command: `{result['command']}`",
        "",
        "| backend | vocab | insert µs | lookup µs | step µs | make pool ms |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(f"| {r['backend']} | {r['vocab']} | {r['insert_us']:.1f} | {r['lookup_us']:.1f} | "
                     f"{r['step_us']:.1f} | {r['make_ms']:.2f} |")
    lines += ["", *(f"- {note}" for note in result["notes"])]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, nargs="+", default=[49152, 128256])
    ap.add_argument("--window", type=int, default=15)
    ap.add_argument("--ngram", type=int, default=5)
    ap.add_argument("--guess", type=int, default=15)
    ap.add_argument("--steps", type=int, default=1000, help="timed steps")
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", default=os.path.join(HERE, "results"))
    args = ap.parse_args(argv)

    # The pools run on the host, but a GPU machine's results are filed under its GPU, beside its other runs.
    info = machine_info("cuda" if torch.cuda.is_available() else "cpu")
    result = {
        "machine": info,
        "command": command_line(__file__, argv if argv is not None else sys.argv[1:]),
        "window": args.window, "ngram": args.ngram, "guess": args.guess, "steps": args.steps,
        "warmup": args.warmup, "rows": [], "notes": [],
    }
    backends = [("python", lambda v: NGramPool(args.ngram, args.guess)),
                ("cpp", lambda v: CppNGramPool(args.ngram, args.guess, v))]
    result["notes"].append("make pool ms: median of 5 constructions (C++: allocating the fixed tables; "
                           "the first construction, which builds or loads the extension, is not counted).")

    for vocab in args.vocab:
        gen = torch.Generator().manual_seed(args.seed)
        steps = make_steps(vocab, args.warmup + args.steps, args.window, args.ngram, gen)
        for name, make in backends:
            make(vocab)  # builds/loads the extension outside the timings
            make_ms = []
            for _ in range(5):
                t0 = time.perf_counter_ns()
                pool = make(vocab)
                make_ms.append((time.perf_counter_ns() - t0) / 1e6)
            row = {"backend": name, "vocab": vocab, **time_steps(pool, steps, args.warmup),
                   "make_ms": statistics.median(make_ms), "stored": len(pool)}
            result["rows"].append(row)
            print(f"{name:6s} vocab {vocab:6d}: insert {row['insert_us']:8.1f} us  lookup {row['lookup_us']:7.1f} us"
                  f"  step {row['step_us']:8.1f} us  make {row['make_ms']:.2f} ms  ({row['stored']} stored)")

    write_results(args.out_dir, f"pool-{device_slug(info)}", result, render_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
