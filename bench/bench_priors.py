"""Where the draft builder's acceptance priors come from: each key's rate on held-out dev prompts.

Every proposed node carries an estimate of its chance to be accepted once its parent is, learned per key during a
call (``lookahead.draft.AcceptanceStats``) from a prior. A call of 128 tokens tests a few dozen nodes, so the
priors are most of what its planner weighs. This measures, per key, how often a node of that key was the model's
next token where its parent was (every node the builder proposes, not only those a planner kept: those are the
ones it must weigh).

Each prompt is decoded plainly (greedy); its logits are scored once over the whole sequence; then a fresh
:class:`~lookahead.draft.DraftBuilder` (suffix index and successor table, the CPU's automatic sources) replays the
decoding position by position: it proposes up to ``--budget`` nodes after ``x``, every node whose parent lies on
the true continuation counts as a trial of each of its keys, and the successor table then takes ``x``'s logits
as a decoding step would. Nothing is learned during the replay, so every proposal is scored at the priors. (A
lookahead call also records the successors of the tree's nodes; the replay records the true path's only.)

    python bench/bench_priors.py --skip 16 --prompts 34 --tag cpu-heldout   # prompts 16-49 of each set

Writes bench/results/priors-<tag>.{json,md}: per key the trials, the rate and the prior, and per group (source,
first token or later, alone or agreed) the mean prior against the rate.
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

from _common import add_run_args, command_line, machine_info, set_name, write_results  # noqa: E402

from lookahead import LookaheadConfig, load_default  # noqa: E402
from lookahead.cli import read_prompts  # noqa: E402
from lookahead.config import StepShape  # noqa: E402
from lookahead.draft import AcceptanceStats, DraftBuilder, code_key  # noqa: E402


def replay(model, prompt: torch.Tensor, max_new_tokens: int, budget: int, trials: collections.Counter,
           hits: collections.Counter) -> int:
    """Adds one prompt's trials and hits per key code; returns the tokens decoded."""
    out = model.generate(prompt, max_new_tokens=max_new_tokens, lookahead=None)
    sequence = out.sequences[0]
    with torch.inference_mode():
        logits = model(sequence[None]).logits[0]
    builder = DraftBuilder(LookaheadConfig(), model.config.vocab_size, shape=StepShape(1, 1, budget),
                           sources=("suffix", "successors"))
    builder.start(prompt[0])
    tokens = sequence.tolist()
    first = prompt.shape[1] + 1  # the first decoding step's x is the prefill's token
    for p in range(first, len(tokens)):
        truth = tokens[p:]
        proposal = builder.propose(tokens[:p], budget)
        parents, offsets = proposal.parents.tolist(), proposal.code_offsets.tolist()
        codes = proposal.codes.tolist()
        depth, on_path = [], []
        for i, token in enumerate(proposal.tokens.tolist()):
            q = parents[i]
            d = 0 if q < 0 else depth[q] + 1
            depth.append(d)
            tested = q < 0 or on_path[q]
            on_path.append(tested and d < len(truth) and truth[d] == token)
            if tested:
                for c in codes[offsets[i]: offsets[i + 1]]:
                    trials[c] += 1
                    hits[c] += on_path[i]
        builder.successors.update(sequence[p - 1: p], logits[p - 1: p])
    return len(tokens) - prompt.shape[1]


def group(key: tuple) -> tuple:
    """(source, class, first token or later, alone or agreed): a match class for suffix keys, a probability
    bucket for successors."""
    agreed = key[-1] == "agreed"
    key = key[:-1] if agreed else key
    detail = key[1] if key[0] != "pool" else "-"
    return key[0], detail, "first" if key[-1] == 1 else "later", "agreed" if agreed else "alone"


def markdown(result: dict) -> str:
    lines = ["# Draft acceptance per key on held-out prompts, against the priors", "",
             f"`{result['command']}` at {result['machine']['git']} (SmolLM2-135M, float32, greedy): prompts "
             f"{result['skip']}-{result['skip'] + result['prompts'] - 1} of each set, {result['max_new_tokens']} "
             f"tokens each ({result['new_tokens']} in all), up to {result['budget']} nodes proposed a position. A "
             "trial: a proposed node whose parent was the model's token (or x); its rate: how often it was the "
             "model's next token. Successor classes are probability buckets (upper bounds 0.05, 0.1, 0.2, 0.3, "
             "0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1); suffix classes the shortest match of the class.", "",
             "| source | class | token | proposed | trials | rate | mean prior |", "|---|---|---|---|---|---|---|"]
    for g in result["groups"]:
        lines.append(f"| {g['source']} | {g['class']} | {g['token']} | {g['proposed']} | {g['trials']} | "
                     f"{g['rate']:.3f} | {g['prior']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(ap, prompts=34, max_new_tokens=128)
    ap.add_argument("--skip", type=int, default=16, help="prompts skipped at the start of each set (the benches' "
                    "first 16: the priors are fitted on others)")
    ap.add_argument("--budget", type=int, default=63, help="nodes proposed a position (the CPU's automatic "
                    "budget on SmolLM2)")
    args = ap.parse_args(argv)
    if args.skip < 0 or args.prompts < 1 or args.budget < 1:
        ap.error("--skip must be >= 0, --prompts and --budget >= 1")
    from tqdm.auto import tqdm

    torch.set_num_threads(args.threads)
    model, tokenizer = load_default()
    trials, hits = collections.Counter(), collections.Counter()
    new_tokens = 0
    for set_path in args.sets:
        prompts = read_prompts(set_path, tokenizer)[args.skip: args.skip + args.prompts]
        for ids in tqdm(prompts, desc=set_name(set_path)):
            new_tokens += replay(model, ids, args.max_new_tokens, args.budget, trials, hits)
    priors = AcceptanceStats().rates.tolist()
    keys = {c: code_key(c) for c in trials}
    groups = collections.defaultdict(lambda: [0, 0, 0.0, 0])  # keys proposed, trials, prior * trials, hits
    for c, n in trials.items():
        g = groups[group(keys[c])]
        g[0] += 1
        g[1] += n
        g[2] += priors[c] * n
        g[3] += hits[c]
    result = {"machine": machine_info("cpu"), "command": command_line(__file__, sys.argv[1:] if argv is None else argv),
              "skip": args.skip, "prompts": args.prompts, "max_new_tokens": args.max_new_tokens,
              "budget": args.budget, "new_tokens": new_tokens,
              "keys": [{"key": list(keys[c]), "trials": trials[c], "hits": hits[c], "prior": priors[c]}
                       for c in sorted(trials)],
              "groups": [{"source": k[0], "class": k[1], "token": k[2], "proposed": k[3], "keys": g[0],
                          "trials": g[1], "prior": g[2] / g[1], "rate": g[3] / g[1]}
                         for k, g in sorted(groups.items(), key=lambda kv: tuple(map(str, kv[0])))]}
    write_results(args.out_dir, f"priors-{args.tag}", result, markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
