"""Decoding speed against prompt length: our plain decoding and automatic lookahead, one prompt at a time.

A long prompt makes every step dearer (each new token attends over all the keys before it) and gives the guesses
more text to copy. Each prompt is a coding question after a context of HumanEval's dev prompts (code), cut to the
token count asked for, in the chat template. Both systems decode it greedily in ``--repeats`` rounds, each
running both back to back, the order alternating; the best time per new token (prefill excluded) is reported for
each, their ratio as the median of the rounds' ratios, and their outputs must be identical. The prompt's prefill
(the time to the first token) is the best of every run's; with ``--hf-prefill`` each round also times
transformers' forward over the same prompt on the same weights (logits of the last row only), beside ours.

    python bench/bench_context.py --threads 2 --lengths 50 500 1000 2000 4000 --hf-prefill --tag cpu

Writes bench/results/context-<tag>.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from _common import (DATA, add_output_args, command_line, hf_default_model, machine_info, pyplot, render,  # noqa: E402
                     write_results)

from lookahead import LookaheadConfig, load_default  # noqa: E402

QUESTION = "Write a Python function that returns the sum of the squares of a list, then explain it."


def prompt_of_length(tokenizer, context_ids: list[int], length: int) -> torch.Tensor:
    """The chat prompt ``[1, ~length]``: as much of the context as fits before the question (none below the
    question's own length)."""
    def build(n):
        text = (tokenizer.decode(context_ids[:n]) + "\n\n" + QUESTION) if n else QUESTION
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             return_tensors="pt", return_dict=True)["input_ids"]

    overhead = build(0).shape[1]
    n = max(0, min(length - overhead, len(context_ids)))
    return build(n)


def hf_prefill_seconds(hf_model, ids: torch.Tensor) -> float:
    """Seconds of transformers' forward over the prompt (what its ``generate`` does first), last row's logits."""
    start = time.perf_counter()
    with torch.inference_mode():
        hf_model(ids, attention_mask=torch.ones_like(ids), logits_to_keep=1)
    return time.perf_counter() - start


def measure(model, ids: torch.Tensor, max_new_tokens: int, repeats: int, hf_model=None) -> dict:
    runs = {"plain": [], "lookahead": []}
    prefill, hf_prefill = [], []
    outputs, compression = {}, {}
    for r in range(repeats):
        for name in (("plain", "lookahead") if r % 2 == 0 else ("lookahead", "plain")):
            out = model.generate(ids, max_new_tokens=max_new_tokens,
                                 lookahead=LookaheadConfig() if name == "lookahead" else None)
            s = out.stats
            runs[name].append((s.seconds - s.prefill_seconds) / max(s.new_tokens, 1))
            prefill.append(s.prefill_seconds)
            outputs[name], compression[name] = out.sequences, s.compression_ratio
        if hf_model is not None:
            hf_prefill.append(hf_prefill_seconds(hf_model, ids))
    plain, la = min(runs["plain"]), min(runs["lookahead"])
    # Each round's two runs back to back: their ratio cancels the machine's drift between rounds, which moved a
    # best-of-2 ratio by 0.94-1.12x at 2000 tokens (session 36).
    ratios = [p / q for p, q in zip(runs["plain"], runs["lookahead"])]
    return {"prompt_tokens": ids.shape[1], "new_tokens": outputs["plain"].shape[1] - ids.shape[1],
            "plain_ms_per_token": 1000 * plain, "lookahead_ms_per_token": 1000 * la,
            "plain_runs_ms": [1000 * t for t in runs["plain"]],
            "lookahead_runs_ms": [1000 * t for t in runs["lookahead"]],
            "speedup": statistics.median(ratios), "speedup_range": [min(ratios), max(ratios)],
            "compression": compression["lookahead"],
            "identical": bool(torch.equal(outputs["plain"], outputs["lookahead"])),
            "prefill_s": min(prefill), **({"hf_prefill_s": min(hf_prefill)} if hf_prefill else {})}


def markdown(result: dict) -> str:
    m = result["machine"]
    paired = all("speedup_range" in r for r in result["rows"])  # results before session 36: ratio of the bests
    prefill = all("prefill_s" in r for r in result["rows"])  # since session 38
    hf = all("hf_prefill_s" in r for r in result["rows"])
    ratio = (f"vs plain: the median of the {result['repeats']} rounds' ratios (each round runs both back to back), "
             f"the lowest and highest in brackets" if paired else "vs plain: the ratio of the bests")
    lines = [f"# Decoding speed against prompt length ({m.get('cpu', 'cpu')}, {result['threads']} threads)", "",
             f"`{result['command']}` at git {m.get('git', '?')}, torch {m.get('torch', '?')}; "
             f"{result['max_new_tokens']} new tokens a prompt, greedy, prefill excluded; ms/token: the best of "
             f"{result['repeats']} runs a system; {ratio}; load average at the start {m.get('load_average')}."
             + (" Prefill: the best of every run's seconds to the first token." if prefill else "")
             + (" Transformers' prefill: its forward over the same prompt on the same weights (float32, logits of the "
                "last row), the best of one a round." if hf else ""), "",
             "| prompt tokens | plain ms/token | lookahead ms/token | lookahead vs plain | compression | identical |"
             + (" prefill s |" if prefill else "") + (" transformers' prefill s |" if hf else ""),
             "|---|---|---|---|---|---|" + ("---|" if prefill else "") + ("---|" if hf else "")]
    for r in result["rows"]:
        spread = " ({:.2f}-{:.2f})".format(*r["speedup_range"]) if paired else ""
        lines.append(f"| {r['prompt_tokens']} | {r['plain_ms_per_token']:.2f} | {r['lookahead_ms_per_token']:.2f} | "
                     f"{r['speedup']:.2f}x{spread} | {r['compression']:.2f} | {r['identical']} |"
                     + (f" {r['prefill_s']:.2f} |" if prefill else "") + (f" {r['hf_prefill_s']:.2f} |" if hf else ""))
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    rows = result["rows"]
    x = [r["prompt_tokens"] for r in rows]
    prefill = all("prefill_s" in r for r in rows)
    fig, axes = plt.subplots(1, 2 if prefill else 1, figsize=(11 if prefill else 6, 4), squeeze=False)
    ax = axes[0][0]
    ax.plot(x, [r["plain_ms_per_token"] for r in rows], "o-", label="plain decoding")
    ax.plot(x, [r["lookahead_ms_per_token"] for r in rows], "s-", label="automatic lookahead")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("ms per new token (lower is better)")
    ax.set_title(f"SmolLM2-135M, {result['machine'].get('cpu', 'cpu')}, {result['threads']} threads", fontsize=9)
    if prefill:  # the time to the first token beside it
        right = axes[0][1]
        right.plot(x, [r["prefill_s"] for r in rows], "o-", label="ours")
        if all("hf_prefill_s" in r for r in rows):
            right.plot(x, [r["hf_prefill_s"] for r in rows], "^-", label="transformers")
        right.set_xlabel("prompt tokens")
        right.set_ylabel("prefill seconds (lower is better)")
        right.set_title("the prompt's prefill: time to the first token", fontsize=9)
    for a in axes[0]:
        a.set_ylim(bottom=0)
        a.grid(alpha=0.3)
        a.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[50, 500, 1000, 2000, 4000],
                    help="prompt lengths in tokens (about)")
    ap.add_argument("--context", default=os.path.join(DATA, "humaneval_dev.jsonl"),
                    help="a JSONL set whose 'prompt' fields, joined, are the context")
    ap.add_argument("--repeats", type=int, default=4, help="rounds, each running both systems (order alternating)")
    ap.add_argument("--hf-prefill", action="store_true",
                    help="also time transformers' forward over each prompt once a round (its prefill)")
    add_output_args(ap, max_new_tokens=128, render=True)
    args = ap.parse_args(argv)
    if args.render:
        render(args.render, markdown, plot)
        return 0
    if any(n < 1 for n in args.lengths) or args.repeats < 1 or args.max_new_tokens < 1:
        ap.error("--lengths, --repeats and --max-new-tokens must be positive")
    torch.set_num_threads(args.threads)
    model, tokenizer = load_default()
    hf_model = hf_default_model() if args.hf_prefill else None
    with open(args.context) as f:
        text = "".join(json.loads(line)["prompt"] for line in f if line.strip())
    context_ids = tokenizer(text)["input_ids"]
    limit = model.config.max_position_embeddings - args.max_new_tokens - 64
    if max(args.lengths) > limit:
        ap.error(f"--lengths must stay below {limit} tokens for this model and --max-new-tokens")
    measure(model, prompt_of_length(tokenizer, context_ids, 50), 16, 1)  # warm-up: packing, cost table
    rows = []
    for length in args.lengths:
        rows.append(measure(model, prompt_of_length(tokenizer, context_ids, length), args.max_new_tokens,
                            args.repeats, hf_model))
        r = rows[-1]
        hf_part = f", transformers' {r['hf_prefill_s']:.2f} s" if "hf_prefill_s" in r else ""
        print(f"{r['prompt_tokens']} tokens: plain {r['plain_ms_per_token']:.2f} ms/token, lookahead "
              f"{r['lookahead_ms_per_token']:.2f} ({r['speedup']:.2f}x, compression {r['compression']:.2f}), "
              f"identical {r['identical']}; prefill {r['prefill_s']:.2f} s{hf_part}", file=sys.stderr, flush=True)
    result = {"command": command_line(__file__, sys.argv[1:] if argv is None else argv),
              "machine": machine_info("cpu"), "threads": args.threads, "max_new_tokens": args.max_new_tokens,
              "repeats": args.repeats, "rows": rows}
    base = write_results(args.out_dir, f"context-{args.tag}", result, markdown(result))
    plot(result, base + ".png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
