"""Throughput against batch size: our plain decoding and our automatic lookahead, batches of dev prompts.

Each set's prompts are split into consecutive batches of ``B`` (the last one smaller) and every batch is decoded
plainly and with lookahead (``LookaheadConfig()``, whose controller sizes the steps for the batch and turns
lookahead off where it does not pay) back to back, the order alternating from batch to batch, ``--repeats``
times over. Reported per set, batch size and mode: tokens/s over the batches (total new tokens / total
``stats.seconds``, the median over the passes; the controller's one-time cost measurement is outside it), the
ratio of lookahead to plain (the median of each pass's ratio: side by side, so a drift of the machine cancels),
mean tokens fed per row per step, and how many rows equal the prompt's batch-1 plain greedy output token for
token.

    python bench/bench_batch.py --threads 2                        # both dev sets, B = 1 4 16 64, 128 tokens
    python bench/bench_batch.py --batch-sizes 1 4 --prompts 4 --max-new-tokens 16 --tag cpu-smoke
    python bench/bench_batch.py --device cuda --dtype bfloat16 --batch-sizes 1 16 --prompts 16 --max-new-tokens 64
    python bench/bench_batch.py --dry-run --prompts 4 --batch-sizes 1 4 --max-new-tokens 8 --out-dir /tmp/x
    python bench/bench_batch.py --batch-sizes 1 --temperature 0.7 --top-p 0.9 --tag cpu-sampled   # sampling
    python bench/bench_batch.py --device cuda --dtype bfloat16 --batch-sizes 16 --refill --device-tree 4 auto

``--device-tree N ...`` adds a mode ``device-tree N`` for each (``LookaheadConfig(device_tree=N)``; ``auto``: the
size ``lookahead.controller.device_tree_size`` chooses for the batch, reported as ``device_tree_nodes``).

With ``--temperature``, both modes sample (one seeded generator for the run): each output is a draw of the model's
distribution (``tests/test_sampling_e2e.py`` checks that lookahead keeps it), so outputs are not compared and
``identical`` is left blank.

In a dtype below float32, steps of different shapes round differently, so ``identical`` counts rows rather than
being expected to equal the prompts (float32: identical everywhere).

Writes bench/results/batch-<tag>.{json,md,png}.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from _common import (DEFAULT_SETS, command_line, device_label, machine_info, pyplot, render, set_name,  # noqa: E402
                     static_path_kwargs, write_results)  # noqa: E402

from lookahead import LookaheadConfig, load_default  # noqa: E402
from lookahead.cli import DTYPES, device_tree_arg, read_prompts  # noqa: E402
from lookahead.controller import make_plan  # noqa: E402

MODES = {"plain": None, "lookahead": LookaheadConfig()}
DEVICE_TREE = "device-tree"  # --device-tree N ...: modes "device-tree N", LookaheadConfig(device_tree=N)
# --step-by-step: plain (and device-tree) decoding again with each step read before the next is launched
# (generate's _overlap_steps=False; lookahead.overlap), to measure what overlapping them gains.
STEP_BY_STEP = " step-by-step"
# --dry-run: the shape of an H100's step costs (SmolLM2 float32, session 5) ten times slower, given as if measured so
# that the planner learns the host's cost as it does on a GPU. Slower, because a CPU step's host work includes its
# verification (a GPU's graph holds it): beside the H100's own times it would turn every batch's trees off, and the
# dry run would not pass through them. Capped at 64 tokens a row (256 a batch step): the CPU's steps stay short.
H100_LIKE = ((1, 0.0215), (16, 0.0329), (64, 0.0351))
H100_LIKE_BATCH = ((256, 0.0505),)


def mode_kwargs(config, generate_kwargs: dict, device: str, mode: str = "") -> dict:
    """A mode's generate keywords: a device tree runs on the static step path, which the CPU takes only when
    asked (without graphs); a step-by-step mode's steps are not overlapped."""
    if mode.endswith(STEP_BY_STEP):
        generate_kwargs = dict(generate_kwargs, _overlap_steps=False)
    return dict(generate_kwargs, **static_path_kwargs(config, device))


def run_paired(model, prompts: list, batch_size: int, max_new_tokens: int, repeats: int, refill: bool = False,
               modes: dict = MODES, **generate_kwargs) -> dict:
    """Decode ``prompts`` (1-D tensors) in batches of ``batch_size`` in every mode, the modes of one batch back to
    back (their order alternating from batch to batch), ``repeats`` times over, after the first batch once in each
    mode, untimed (``generate_kwargs`` go to every call). ``refill``: every prompt in one call of at most
    ``batch_size`` rows at once, a finished row's place going to the next prompt (``max_batch_size``), instead of
    batches one after another. Returns per mode its outputs (each
    prompt's new tokens, from the first pass) and totals, tokens/s being the median over the passes; and per pass
    the ratio of each mode's tokens/s to plain's (side by side, so a drift of the machine's speed cancels).
    ``modes``: name to ``lookahead=`` config, ``"plain"`` among them."""
    per_mode = {mode: {"outputs": [], "passes": []} for mode in modes}
    batches = [prompts] if refill else [prompts[i: i + batch_size] for i in range(0, len(prompts), batch_size)]
    generate_kwargs = dict(generate_kwargs, max_batch_size=batch_size)
    kwargs = {mode: mode_kwargs(config, generate_kwargs, str(model.device.type), mode)
              for mode, config in modes.items()}
    # Untimed, the first batch once in each mode: on CUDA that builds this batch size's runners and captures their
    # graphs (kept on the model), which a timed pass would otherwise pay for once, lookahead's menu more than plain.
    for mode in modes:
        model.generate(prompts[:batch_size], max_new_tokens=max_new_tokens, lookahead=modes[mode], **kwargs[mode])
    for rep in range(repeats):
        totals = {mode: dict(new=0, seconds=0.0, prefill=0.0, host=0.0, steps=0, batch_steps=0, fed=0)
                  for mode in modes}
        for i, batch in enumerate(batches):
            order = list(modes) if (i + rep) % 2 == 0 else list(reversed(modes))
            for mode in order:
                out = model.generate(batch, max_new_tokens=max_new_tokens, lookahead=modes[mode], **kwargs[mode])
                if rep == 0:
                    L = max(p.numel() for p in batch)
                    per_mode[mode]["outputs"] += [out.sequences[b, L: L + row.new_tokens].tolist()
                                                  for b, row in enumerate(out.stats.rows)]
                t = totals[mode]
                t["new"] += out.stats.new_tokens
                t["seconds"] += out.stats.seconds
                t["prefill"] += out.stats.prefill_seconds
                t["host"] += out.stats.host_seconds
                t["batch_steps"] += out.stats.steps
                t["steps"] += sum(r.steps for r in out.stats.rows)
                t["fed"] += out.stats.fed_tokens
        for mode, t in totals.items():
            per_mode[mode]["passes"].append(t)
    result = {}
    for mode, m in per_mode.items():
        passes = m["passes"]
        tps = [p["new"] / p["seconds"] for p in passes]
        ratios = [(p["new"] / p["seconds"]) / (q["new"] / q["seconds"])
                  for p, q in zip(passes, per_mode["plain"]["passes"])]
        result[mode] = (m["outputs"], {"new_tokens": passes[0]["new"],
                                       "seconds": statistics.median(p["seconds"] for p in passes),
                                       "tokens_per_s": statistics.median(tps), "tokens_per_s_passes": tps,
                                       "vs_plain_passes": ratios, "paired_vs_plain": statistics.median(ratios),
                                       "prefill_seconds": statistics.median(p["prefill"] for p in passes),
                                       # a forward of the whole batch, its host work and read-back: what to set
                                       # beside the step's replay time
                                       "decode_ms_per_batch_step": statistics.median(
                                           1e3 * (p["seconds"] - p["prefill"]) / p["batch_steps"] for p in passes),
                                       # the trees' host work (planning, building, learning) over all steps,
                                       # plain ones included: what bench_predict's --host-ms stands for
                                       "host_ms_per_batch_step": statistics.median(
                                           1e3 * p["host"] / p["batch_steps"] for p in passes),
                                       "fed_per_row_step": passes[0]["fed"] / passes[0]["steps"],
                                       "tokens_per_step": passes[0]["new"] / passes[0]["steps"]})
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sets", nargs="+", default=DEFAULT_SETS)
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 4, 16, 64])
    ap.add_argument("--prompts", type=int, default=None, help="first N prompts of each set (default: all)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1, help="passes over the prompts per batch size (medians)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES),
                    help="parameter dtype (bfloat16: where a GPU's steps stay flat longest; identity then counted)")
    ap.add_argument("--refill", action="store_true",
                    help="continuous batching: each set in one call of at most B rows at once, a finished row's "
                         "place going to the next prompt (generate's max_batch_size), not batches one after another")
    ap.add_argument("--temperature", type=float, default=None,
                    help="sample at this temperature (default: greedy decoding, outputs compared with plain's)")
    ap.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass, with --temperature")
    ap.add_argument("--device-tree", type=device_tree_arg, nargs="+", default=[], metavar="N",
                    help="also decode with LookaheadConfig(device_tree=N) for each N (an int >= 1, or 'auto': sized "
                         "for the batch from the step costs): trees read on the device from successor tables kept "
                         "there (modes 'device-tree N')")
    ap.add_argument("--step-by-step", action="store_true",
                    help="also decode plainly (and with --device-tree) reading each step before launching the next "
                         "(modes '... step-by-step'): what overlapping the steps gains (lookahead/overlap.py)")
    ap.add_argument("--tag", default=None, help="result file tag (default: the device)")
    ap.add_argument("--tag-suffix", default="", help="appended to the default tag (another run on the same device)")
    ap.add_argument("--out-dir", default=os.path.join(HERE, "results"))
    ap.add_argument("--render", metavar="JSON", help="only re-write the markdown and plot of a results file")
    ap.add_argument("--dry-run", action="store_true",
                    help="the GPU run's loop on the CPU, for plumbing only: static steps run eagerly, an H100's step "
                         "costs given as if measured (the planner learns the host cost, as on a GPU)")
    args = ap.parse_args(argv)
    if args.render:
        render(args.render, markdown, plot)
        return 0
    if any(b < 1 for b in args.batch_sizes):
        ap.error(f"--batch-sizes must be >= 1, got {args.batch_sizes}")
    if args.top_p is not None and args.temperature is None:
        ap.error("--top-p samples: give --temperature too")
    modes = dict(MODES, **{f"{DEVICE_TREE} {n}": LookaheadConfig(device_tree=n) for n in args.device_tree if n})
    if args.step_by_step:
        modes.update({mode + STEP_BY_STEP: config for mode, config in list(modes.items())
                      if mode == "plain" or mode.startswith(DEVICE_TREE)})
    from tqdm.auto import tqdm

    if args.dry_run:
        args.device = "cpu"
    torch.set_num_threads(args.threads)
    machine = machine_info(args.device)  # at the start: the revision that runs, whatever is committed meanwhile
    model, tokenizer = load_default(dtype=DTYPES[args.dtype], device=args.device)
    generate_kwargs = {}
    if args.dry_run:  # the model's own memo of measured costs (lookahead.controller), filled before any call
        from lookahead.controller import StepCosts, cost_key

        key = cost_key(model)
        model.step_costs_cache = {key: StepCosts.from_pairs(H100_LIKE),
                                  key + "|batch": StepCosts.from_pairs(H100_LIKE_BATCH)}
        generate_kwargs = dict(cuda_graphs=False, _static_steps=True)
    sampled = args.temperature is not None
    if sampled:
        generate_kwargs.update(do_sample=True, temperature=args.temperature, top_p=args.top_p, top_k=0,
                               generator=torch.Generator(args.device).manual_seed(0))
    rows = []
    # Modes whose warm-up raised (device trees had never run on a GPU when this was written): said and dropped,
    # so that the other modes' figures survive them.
    failed = {}
    with torch.inference_mode():
        for set_path in args.sets:
            name = set_name(set_path)
            prompts = [ids[0].to(model.device) for ids in read_prompts(set_path, tokenizer)[: args.prompts]]
            for B in args.batch_sizes:  # the controller's cost measurement for this batch, outside the timings
                make_plan(MODES["lookahead"], model, min(B, len(prompts)))
            for mode, config in list(modes.items()):  # warm-up: packing, caches, allocator
                try:
                    model.generate(prompts[:2], max_new_tokens=4, lookahead=config,
                                   **mode_kwargs(config, generate_kwargs, args.device, mode))
                except Exception as exc:  # noqa: BLE001 -- a mode that fails is dropped, plain decoding is not
                    if mode == "plain":
                        raise
                    traceback.print_exc()
                    failed[mode] = f"{type(exc).__name__}: {exc}"[:500]
                    print(f"{mode}: FAILED in its warm-up, dropped: {failed[mode]}", flush=True)
                    del modes[mode]
            reference = None
            if 1 not in args.batch_sizes and not sampled:  # each prompt's batch-1 plain output, for the identity
                reference = [model.generate(p, max_new_tokens=args.max_new_tokens, lookahead=None)
                             .sequences[0, p.numel():].tolist()
                             for p in tqdm(prompts, desc=f"{name} batch-1 reference")]
            for B in tqdm(sorted(args.batch_sizes), desc=name):
                for mode, (outputs, totals) in run_paired(model, prompts, B, args.max_new_tokens, args.repeats,
                                                          args.refill, modes, **generate_kwargs).items():
                    if reference is None:  # batch 1, plain: the first run
                        reference = outputs
                    identical = None if sampled else sum(o == r for o, r in zip(outputs, reference))
                    config = modes[mode]
                    nodes = config.device_tree if config is not None else 0
                    if nodes == "auto":  # what it chose for this batch (the costs are measured by now)
                        nodes = make_plan(config, model, min(B, len(prompts)), sampled=sampled).device_tree
                    rows.append({"set": name, "batch_size": B, "mode": mode, "prompts": len(prompts),
                                 "identical": identical, "device_tree_nodes": nodes, **totals})
                    print(f"{name:10s} B={B:3d} {mode:26s} {totals['tokens_per_s']:8.2f} tok/s  fed/row/step "
                          f"{totals['fed_per_row_step']:.2f}  tokens/step {totals['tokens_per_step']:.2f}  "
                          + ("" if sampled else f"identical {identical}/{len(prompts)}"), flush=True)
    for r in rows:
        r["vs_plain"] = r["paired_vs_plain"]
    machine["load_average_end"] = machine_info(args.device)["load_average"]
    tag = args.tag or ("cpu" if args.device == "cpu" else device_label(machine).lower().replace(" ", "-")) \
        + ("" if args.dtype == "float32" else f"-{args.dtype}") \
        + ("-refill" if args.refill else "") \
        + "".join(f"-device-tree{'-' if n == 'auto' else ''}{n}" for n in args.device_tree if n) \
        + (f"-{args.tag_suffix}" if args.tag_suffix else "") \
        + ("-dry-run" if args.dry_run else "")
    result = {"machine": machine, "command": command_line(__file__, sys.argv[1:] if argv is None else argv),
              "model": f"SmolLM2-135M-Instruct ({args.dtype})", "dtype": args.dtype,
              "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": args.top_p,
              "prompts_per_set": args.prompts, "threads": args.threads, "repeats": args.repeats, "refill": args.refill,
              "step_costs": planner_tables(model), "rows": rows, "failed_modes": failed}
    base = write_results(args.out_dir, f"batch-{tag}", result, markdown(result))
    plot(result, base + ".png")
    return 0


def planner_tables(model) -> dict:
    """The step-cost tables the planner used (``{cost key: [[tokens, seconds], ...]}``, the single-row table and the
    batch one): on a GPU they say how a step's cost grew with its size in this run's dtype and device."""
    memo = getattr(model, "step_costs_cache", None) or {}
    return {key: [[int(t), float(c)] for t, c in zip(costs.tokens, costs.seconds)] for key, costs in memo.items()}


def cost_lines(result: dict) -> list[str]:
    """One line a table: ``t(T)`` in ms, and each size's cost over ``t(1)`` (none in results before session 53)."""
    lines = []
    for key, pairs in (result.get("step_costs") or {}).items():
        base = dict(pairs).get(1)
        costs = ", ".join(f"t({t}) = {1e3 * c:.3f} ms" + (f" ({c / base:.2f} t(1))" if base and t > 1 else "")
                          for t, c in pairs)
        lines.append(f"- {'batch' if key.endswith('|batch') else 'one row'}: {costs}")
    return ["The planner's step costs:", "", *lines, ""] if lines else []


def decoding(result: dict) -> str:
    if result.get("temperature") is None:
        return "Greedy"
    top_p = "" if result.get("top_p") is None else f", top-p {result['top_p']}"
    return f"Sampled (temperature {result['temperature']}{top_p})"


def markdown(result: dict) -> str:
    m = result["machine"]
    subset = "every prompt" if result["prompts_per_set"] is None else f"first {result['prompts_per_set']} prompts"
    lines = [f"# Throughput against batch size ({result['model']})", "",
             f"{decoding(result)}, {result['max_new_tokens']} new tokens, {subset} of each set, "
             f"{result['threads']} threads"
             + (", continuous batching (each set in one call of at most B rows at once, a finished row's place "
                "going to the next prompt)" if result.get("refill") else "") + ". "
             f"Device: {m['device']} ({m.get('gpu') or m['cpu']}), torch {m['torch']}, git {m['git']}, load average "
             f"at the start {m.get('load_average')}, at the end {m.get('load_average_end')}.", "",
             f"Command: `{result['command']}`", "", *cost_lines(result),
             f"Tokens/s over the batches (new tokens / seconds; the median of {result.get('repeats', 1)} pass(es)); "
             "vs plain: the median over the passes of lookahead's tokens/s over plain's, each batch decoded both ways "
             "back to back; passes: the lowest and highest of those ratios (the machine's pass-to-pass noise); "
             "tokens a step: new tokens per row and step (compression); prefill s: the prefills' seconds within "
             "those; ms a step: the rest over the batch's steps (its forward, host work and read-back); host ms: the "
             "trees' host work (`stats.host_seconds`, declined trees' included since session 49) over all the "
             "batch's steps, plain ones included; identical: "
             "rows equal to the prompt's batch-1 plain greedy output (blank when sampling).", "",
             "| set | batch | mode | tokens/s | vs plain | passes | tokens fed per row and step | tokens a step | "
             "prefill s | ms a step | host ms | identical |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        ratios = r.get("vs_plain_passes") or [r["vs_plain"]]
        spread = "" if r["mode"] == "plain" else f"{min(ratios):.2f}-{max(ratios):.2f}"
        per_step = f"{r['tokens_per_step']:.2f}" if "tokens_per_step" in r else ""  # (older results lack it)
        identical = "" if r["identical"] is None else f"{r['identical']}/{r['prompts']}"
        prefill = f"{r['prefill_seconds']:.3f}" if "prefill_seconds" in r else ""  # (older results lack these)
        step_ms = f"{r['decode_ms_per_batch_step']:.2f}" if "decode_ms_per_batch_step" in r else ""
        host_ms = f"{r['host_ms_per_batch_step']:.3f}" if "host_ms_per_batch_step" in r else ""
        mode = r["mode"] + (f" ({r['device_tree_nodes']} nodes)" if "auto" in r["mode"] else "")
        lines.append(f"| {r['set']} | {r['batch_size']} | {mode} | {r['tokens_per_s']:.2f} | "
                     f"{r['vs_plain']:.2f}x | {spread} | {r['fed_per_row_step']:.2f} | {per_step} | {prefill} | "
                     f"{step_ms} | {host_ms} | {identical} |")
    if result.get("failed_modes"):
        lines += ["", "Modes that failed in their warm-up and were dropped (traceback in the run's log):", ""]
        lines += [f"- {mode}: `{error}`" for mode, error in result["failed_modes"].items()]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for s in dict.fromkeys(r["set"] for r in result["rows"]):
        for mode in dict.fromkeys(r["mode"] for r in result["rows"]):
            if mode.endswith(STEP_BY_STEP):
                continue
            style = "--" if mode == "plain" else ":" if mode.startswith(DEVICE_TREE) else "-"
            pts = [(r["batch_size"], r["tokens_per_s"]) for r in result["rows"] if r["set"] == s and r["mode"] == mode]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", label=f"{s} {mode}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("tokens per second (over the batch)")
    m = result["machine"]
    ax.set_title(f"{result['model']}, {m.get('gpu') or m['cpu']}", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
