"""A conversation's second turn with and without a :class:`lookahead.PromptCache`.

MT-Bench's dev questions have two turns. Each question's first turn is decoded (greedy, automatic lookahead) into a
cache; the second turn's prompt is the chat template over the first turn, its answer and the second question. That
prompt is then decoded twice, side by side in one process: with the cache (the first turn's keys and values copied,
only the new tokens prefilled) and without it (the whole prompt prefilled); and a third time plainly (one token a
step, no cache), for lookahead's speed on a second turn, whose prompt holds the first answer for its guesses to
draw on. The order alternates between questions, and every output must be the same. Reported: the prefill's
seconds and the second turn's tokens/s (prefill included) with and without the cache, and the decoding's
tokens/s (prefill excluded) with lookahead and plainly.

    python bench/bench_conversation.py --prompts 16 --tag cpu-avx2

Writes bench/results/conversation-<tag>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from _common import DATA, command_line, machine_info, write_results  # noqa: E402

from lookahead import LookaheadConfig, PromptCache, load_default  # noqa: E402
from lookahead.cli import chat_ids  # noqa: E402

AUTOMATIC = LookaheadConfig()


def second_turn(model, tokenizer, turns: list[str], max_new_tokens: int, cache_first: bool) -> dict:
    """Decode the first turn into a cache, then the second turn with and without it; one row of results."""
    cache = PromptCache()
    history = [{"role": "user", "content": turns[0]}]
    ids = torch.tensor([chat_ids(tokenizer, history)])
    first = model.generate(ids, max_new_tokens=max_new_tokens, prompt_cache=cache)
    answer = tokenizer.decode(first.sequences[0, ids.shape[1]:], skip_special_tokens=True)
    ids = torch.tensor([chat_ids(tokenizer, history + [{"role": "assistant", "content": answer},
                                                       {"role": "user", "content": turns[1]}])])
    runs = {}
    for name in (["cached", "fresh", "plain"] if cache_first else ["plain", "fresh", "cached"]):
        runs[name] = model.generate(ids, max_new_tokens=max_new_tokens, prompt_cache=cache if name == "cached" else None,
                                    lookahead=None if name == "plain" else AUTOMATIC)
    cached, fresh, plain = runs["cached"], runs["fresh"], runs["plain"]
    return {"prompt_tokens": ids.shape[1], "reused_tokens": cached.stats.reused_tokens,
            "new_tokens": cached.stats.new_tokens, "steps": cached.stats.steps,
            "prefill_seconds": cached.stats.prefill_seconds, "fresh_prefill_seconds": fresh.stats.prefill_seconds,
            "seconds": cached.stats.seconds, "fresh_seconds": fresh.stats.seconds,
            "decode_seconds": cached.stats.seconds - cached.stats.prefill_seconds,
            "plain_decode_seconds": plain.stats.seconds - plain.stats.prefill_seconds,
            "identical": bool(torch.equal(cached.sequences, fresh.sequences)
                              and torch.equal(cached.sequences, plain.sequences))}


def summarize(rows: list[dict]) -> dict:
    tokens = sum(r["new_tokens"] for r in rows)
    return {
        "questions": len(rows),
        "identical": sum(r["identical"] for r in rows),
        "prompt_tokens_median": statistics.median(r["prompt_tokens"] for r in rows),
        "reused_fraction": sum(r["reused_tokens"] for r in rows) / sum(r["prompt_tokens"] for r in rows),
        "prefill_seconds_median": statistics.median(r["prefill_seconds"] for r in rows),
        "fresh_prefill_seconds_median": statistics.median(r["fresh_prefill_seconds"] for r in rows),
        "tokens_per_second": tokens / sum(r["seconds"] for r in rows),
        "fresh_tokens_per_second": tokens / sum(r["fresh_seconds"] for r in rows),
        "compression": tokens / sum(r["steps"] for r in rows),
        "decode_tokens_per_second": tokens / sum(r["decode_seconds"] for r in rows),
        "plain_decode_tokens_per_second": tokens / sum(r["plain_decode_seconds"] for r in rows),
    }


def markdown(result: dict) -> str:
    m, s = result["machine"], result["summary"]
    lines = [
        "# A conversation's second turn, with and without a PromptCache", "",
        f"`{result['command']}`", "",
        f"{m['cpu']}, {m['torch_threads']} torch threads, torch {m['torch']}, git {m['git']}, load average "
        f"{m['load_average']}. SmolLM2-135M-Instruct, float32, greedy, automatic lookahead, "
        f"{result['max_new_tokens']} new tokens a turn; MT-Bench's first {s['questions']} dev questions.", "",
        "| | with the cache | without |", "|---|---|---|",
        f"| prefill, median seconds | {s['prefill_seconds_median']:.3f} | {s['fresh_prefill_seconds_median']:.3f} |",
        f"| second turn, tokens/s (prefill included) | {s['tokens_per_second']:.1f} | "
        f"{s['fresh_tokens_per_second']:.1f} |", "",
        f"The second turn's prompts: median {s['prompt_tokens_median']:.0f} tokens, "
        f"{100 * s['reused_fraction']:.0f}% of them reused from the cache. "
        f"{s['identical']}/{s['questions']} outputs identical with and without it, and plainly.", "",
        f"Decoding the second turn (prefill excluded): lookahead {s['decode_tokens_per_second']:.1f} tokens/s "
        f"(compression {s['compression']:.2f}), plain {s['plain_decode_tokens_per_second']:.1f}: "
        f"**{s['decode_tokens_per_second'] / s['plain_decode_tokens_per_second']:.2f}x**.", "",
        "| question | prompt tokens | reused | prefill s (cache / none) | seconds (cache / none) | identical |",
        "|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(result["rows"]):
        lines.append(f"| {i} | {r['prompt_tokens']} | {r['reused_tokens']} | {r['prefill_seconds']:.3f} / "
                     f"{r['fresh_prefill_seconds']:.3f} | {r['seconds']:.2f} / {r['fresh_seconds']:.2f} | "
                     f"{r['identical']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--set", default=os.path.join(DATA, "mt_bench_dev.jsonl"), help="questions with two turns")
    ap.add_argument("--prompts", type=int, default=16, help="first N questions")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tag", default="cpu")
    ap.add_argument("--out-dir", default=os.path.join(HERE, "results"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    with open(args.set) as f:
        questions = [json.loads(line)["turns"] for line in f if line.strip()][: args.prompts]
    model, tokenizer = load_default()
    second_turn(model, tokenizer, questions[0], 8, True)  # warm-up: packing, cost table, caches
    rows = []
    for i, turns in enumerate(questions):
        rows.append(second_turn(model, tokenizer, turns, args.max_new_tokens, cache_first=i % 2 == 0))
        r = rows[-1]
        print(f"{i}: {r['prompt_tokens']} tokens, {r['reused_tokens']} reused; prefill {r['prefill_seconds']:.3f} / "
              f"{r['fresh_prefill_seconds']:.3f} s; identical {r['identical']}", file=sys.stderr)
    result = {"command": command_line(__file__, sys.argv[1:] if argv is None else argv),
              "machine": machine_info("cpu"), "max_new_tokens": args.max_new_tokens, "rows": rows,
              "summary": summarize(rows)}
    write_results(args.out_dir, f"conversation-{args.tag}", result, markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
