"""SmolLM2-135M-Instruct end to end on a GPU: tokens/s and greedy identity of our decoding and transformers'.

Systems (``bench_speed.py``'s, on ``--device``): ``ours-plain`` (``lookahead=None``), ``ours-plain-eager`` (the same
without CUDA graphs: ``cuda_graphs=False``), ``ours-lookahead`` (automatic mode, cost model measured first on this
device), ``ours-lookahead-memory`` (the same with one ``DraftMemory`` a set: each prompt reads the set's earlier
prompts and outputs), ``ours-fixed-15-5-15``, ``hf-greedy`` (transformers' ``generate``) and ``hf-prompt-lookup``
(``prompt_lookup_num_tokens=10``), and ``ours-plain-cublas`` / ``ours-lookahead-cublas`` (the first and third with
every linear layer in cuBLAS, our Triton kernel for steps of 2-64 rows off: a second copy of the model, run with
``lookahead.cpu_linear.GPU_KERNEL_ROWS`` empty, its own graphs and cost model), and ``ours-device-tree-gemv``
(``ours-device-tree`` on a third copy whose float32 products of 1-16 rows run ``bench/gpu_gemv.py``'s candidate, in
the configuration that replays fastest here: what it would make of issue 11's figure). Ours run with CUDA graphs
(``generate``'s default on CUDA) unless named eager; the graphs are captured in each system's warm-up call and kept
on the model (``model.step_runners``), so the timed calls replay them. Every prompt is run by every system in turn
after one warm-up per system. Times as in ``bench_speed.py`` (whose runners this uses): ours ``stats.seconds``,
transformers' the wall time of its call with the device synchronised before and after. ``identical`` counts prompts
whose output equals ``ours-plain``'s token for token; ``first_diff`` (per prompt) is the first new-token index where
it differs.

In float32 the output is ``e2e-gpu-<device>.json`` (top-level ``device`` and ``rows`` of ``{"set", "system",
"tokens_per_s", "identical", ...}``, the file other code reads) plus ``.md``; in another dtype
``e2e-gpu-<device>-<dtype>.{json,md}``: the bf16 identity counts. A bar chart of every system's tokens/s
(``.png``) at the end; ``--render JSON`` draws it and the markdown again from a results file.

    python bench/gpu_e2e.py --limit 16 --hf-limit 6 --out-dir $OUT/work    # fp32: speed and identity
    python bench/gpu_e2e.py --dtype bfloat16 --limit 10 --max-new-tokens 64 --systems ours-plain ours-lookahead \
        hf-greedy
    python bench/gpu_e2e.py --dry-run --out-dir /tmp/x                     # CPU, 2 prompts, 8 tokens
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import sys
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from gpu_util import ResultFile, add_device_args, header, parse_dtype, pick_device  # noqa: E402

from _common import DEFAULT_SETS, hf_default_model, pyplot, render as render_files, set_name  # noqa: E402
from bench_speed import SYSTEMS, make_runners, remember_per_set  # noqa: E402

# bench_speed's systems plus our eager loop (what the CUDA graphs gain), trees read on the device (sized by the
# controller) and ours without our linear kernel.
CUBLAS = {"ours-plain-cublas": "ours-plain", "ours-lookahead-cublas": "ours-lookahead"}
# Device trees with bench/gpu_gemv.py's candidate for our kernel's calls of 1-16 rows (session 74): what it would
# make of issue 11's float32 figure, measured in the same run as the model's kernel.
GEMV = {"ours-device-tree-gemv": "ours-device-tree"}
GPU_SYSTEMS = SYSTEMS[:1] + ["ours-plain-eager"] + SYSTEMS[1:] + ["ours-device-tree"] + list(CUBLAS) + list(GEMV)


def cublas_only():
    """Within the block every float32 product runs in cuBLAS: our kernel's rows (GPU_KERNEL_ROWS) emptied. A bench's
    switch, not the library's: the kernel is what the model runs."""
    from unittest import mock

    from lookahead import cpu_linear

    return mock.patch.object(cpu_linear, "GPU_KERNEL_ROWS", range(0))


def gemv_steps(config):
    """Within the block our kernel's float32 calls of 1-16 rows without a bias run ``bench/gpu_gemv.py``'s
    candidate in ``config`` (a bench's switch, as :func:`cublas_only`)."""
    from unittest import mock

    import gpu_gemv
    from lookahead_kernels import step_linear

    launch = step_linear._launch

    def launched(x2, weight, bias, y2, counters=None, tiles=None):
        if bias is None and tiles is None and 1 <= x2.shape[0] <= gpu_gemv.ROWS:
            gpu_gemv.rows_gemv(x2, weight, y2, config)
        else:
            launch(x2, weight, bias, y2, counters, tiles)

    return mock.patch.object(step_linear, "_launch", launched)


def fastest_gemv(model, device) -> tuple[str, tuple]:
    """The candidate's configuration whose 16-row products over every weight matrix of ``model`` replay fastest on
    ``device`` (``do_bench_cudagraph``; off CUDA, the candidate's default: it never runs there)."""
    import gpu_gemv

    if torch.device(device).type != "cuda":
        return gpu_gemv.DEFAULT, gpu_gemv.CONFIGS[gpu_gemv.DEFAULT]
    import triton.testing

    weights = [p for p in model.parameters() if p.dim() == 2 and p.dtype == torch.float32]
    xs = {k: torch.randn(gpu_gemv.ROWS, k, device=device) for k in {w.shape[1] for w in weights}}
    outs = [torch.empty(gpu_gemv.ROWS, w.shape[0], device=device) for w in weights]
    times = {}
    for name, run in gpu_gemv.candidate_runs(xs, weights, outs).items():
        try:
            times[name] = triton.testing.do_bench_cudagraph(run)
        except Exception as exc:  # noqa: BLE001 -- a tile that fails is left out
            print(f"gemv {name}: {type(exc).__name__}: {exc}"[:300], flush=True)
    print("gemv candidate, 16 rows, ms over every weight: "
          + ", ".join(f"{k} {v:.3f}" for k, v in times.items()), flush=True)
    best = min(times, key=times.get) if times else gpu_gemv.DEFAULT
    return best, gpu_gemv.CONFIGS[best]


class SwitchedRunner:
    """A runner of ``bench_speed.make_runners`` called within ``switch()`` (:func:`cublas_only` by default; its
    graphs are captured there, on another model's own runners)."""

    def __init__(self, run, switch=cublas_only):
        self.run, self.switch = run, switch

    def __call__(self, ids):
        with self.switch():
            return self.run(ids)

    @property
    def stats(self):
        return getattr(self.run, "stats", None)


def first_diff(seq: torch.Tensor, ref: torch.Tensor, prompt_len: int) -> int | None:
    """First new-token index where ``seq`` and ``ref`` differ (a length difference counts); None if equal."""
    a, b = seq[0, prompt_len:].tolist(), ref[0, prompt_len:].tolist()
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def aggregate(per_prompt: list[dict], systems: list[str]) -> list[dict]:
    """Rows per (set, system) over the prompts that system has finished; ``vs_ours_plain`` compares it with
    ours-plain on the same prompts (transformers' systems may run on fewer: ``--hf-limit``)."""
    rows = []
    for name in dict.fromkeys(p["set"] for p in per_prompt):
        plain = {p["prompt"]: p for p in per_prompt if p["set"] == name and p["system"] == "ours-plain"}
        for system in systems:
            res = [p for p in per_prompt if p["set"] == name and p["system"] == system]
            if not res:
                continue
            total_new, total_s = sum(r["new_tokens"] for r in res), sum(r["seconds"] for r in res)
            rate = total_new / total_s if total_s > 0 else 0.0
            same = [plain[r["prompt"]] for r in res if r["prompt"] in plain]
            plain_s = sum(p["seconds"] for p in same)
            plain_rate = sum(p["new_tokens"] for p in same) / plain_s if plain_s > 0 else None
            rows.append({"set": name, "system": system, "tokens_per_s": rate,
                         "median_tokens_per_s": statistics.median(r["new_tokens"] / r["seconds"] for r in res),
                         "vs_ours_plain": rate / plain_rate if plain_rate and len(same) == len(res) else None,
                         "compression": statistics.mean(r["compression"] for r in res),
                         "identical": sum(bool(r["identical"]) for r in res), "prompts": len(res)})
            if all(r.get("steps") for r in res):  # ours: host work outside the forward, per step
                steps = sum(r["steps"] for r in res)
                rows[-1]["host_ms_per_step"] = 1e3 * sum(r["host_seconds"] for r in res) / steps
                rows[-1]["tokens_per_step"] = total_new / steps  # over the set (compression: the prompts' mean)
                if all(r.get("fed_tokens") is not None for r in res):  # the trees' size the planner chose
                    rows[-1]["fed_per_step"] = sum(r["fed_tokens"] for r in res) / steps
            if all(r.get("prefill_seconds") is not None for r in res):  # ours (older results lack it)
                rows[-1]["prefill_ms_per_call"] = 1e3 * statistics.median(r["prefill_seconds"] for r in res)
    return rows


def render(result: dict) -> str:
    m = result["machine"]
    lines = [f"# SmolLM2-135M-Instruct end to end, {result['dtype']}", "",
             f"Device: {result['device']}; torch {m['torch']}, triton {m['triton']}, CUDA {m['cuda']}; git {m['git']}.",
             f"Greedy, {result['max_new_tokens']} new tokens, first {result['limit']} prompts of each set"
             + (f" (transformers' systems: the first {result['hf_limit']}, and their `vs ours-plain` is on those)"
                if result.get("hf_limit") else "")
             + "; wall clock with the device synchronised around each call (prefill included).",
             f"Command: `{result['command']}`", "",
             "Host ms / step: `stats.host_seconds` per step, the lookahead steps' host work outside the forward, "
             "verification and read-back (a plain step has none, one whose trees the planner declined "
             "its trees' building, since session 49). Prefill ms: `stats.prefill_seconds`, the median "
             "call's (within its time). Compression: the mean of each prompt's new tokens a step; tokens a step and "
             "fed a step: new and fed tokens over all the set's steps.", "",
             "| set | system | tokens/s | median tokens/s | vs ours-plain | compression | tokens a step | fed a step "
             "| host ms / step | prefill ms | identical to ours-plain |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        vs = f"{r['vs_ours_plain']:.2f}x" if r.get("vs_ours_plain") else "—"
        host = f"{r['host_ms_per_step']:.2f}" if r.get("host_ms_per_step") is not None else "—"
        prefill = f"{r['prefill_ms_per_call']:.1f}" if r.get("prefill_ms_per_call") is not None else "—"
        per_step, fed = (f"{r[k]:.2f}" if r.get(k) is not None else "—" for k in ("tokens_per_step", "fed_per_step"))
        lines.append(f"| {r['set']} | {r['system']} | {r['tokens_per_s']:.1f} | {r['median_tokens_per_s']:.1f} | {vs} "
                     f"| {r['compression']:.2f} | {per_step} | {fed} | {host} | {prefill} | "
                     f"{r['identical']}/{r['prompts']} |")
    if result.get("gemv_config"):
        lines += ["", f"`ours-device-tree-gemv`: `bench/gpu_gemv.py`'s candidate in `{result['gemv_config']}` (the "
                  "fastest of its configurations over this model's weights at 16 rows, timed at the start) for our "
                  "kernel's float32 calls of 1-16 rows."]
    if result.get("failed_systems"):
        lines += ["", "Systems that failed and were dropped (traceback in the part's log):", ""]
        lines += [f"- {system}: `{error}`" for system, error in result["failed_systems"].items()]
    diffs = [p for p in result["per_prompt"] if p["first_diff"] is not None]
    if diffs:
        lines += ["", "Outputs that differ from ours-plain (first differing new-token index):", ""]
        lines += [f"- {p['set']} prompt {p['prompt']} {p['system']}: at {p['first_diff']}" for p in diffs]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> None:
    """Tokens/s of every system, a group of bars a set (log scale: transformers' run at a twentieth of ours), each
    labelled with its tokens/s and its ratio to ours-plain (transformers' on the prompts they ran)."""
    plt = pyplot()
    rows = result["rows"]
    if plt is None or not rows:
        return
    sets = list(dict.fromkeys(r["set"] for r in rows))
    systems = list(dict.fromkeys(r["system"] for r in rows))
    width = 0.8 / len(systems)
    fig, ax = plt.subplots(figsize=(max(7.0, 0.75 * len(sets) * len(systems)), 5))
    for i, system in enumerate(systems):
        xs, ys, labels = [], [], []
        for j, name in enumerate(sets):
            r = next((r for r in rows if r["set"] == name and r["system"] == system), None)
            if r is not None:
                xs.append(j + (i - (len(systems) - 1) / 2) * width)
                ys.append(r["tokens_per_s"])
                labels.append(f"{r['tokens_per_s']:.0f}" + (f"\n{r['vs_ours_plain']:.2f}x"
                                                            if r.get("vs_ours_plain") else ""))
        bars = ax.bar(xs, ys, width, label=system)
        ax.bar_label(bars, labels=labels, fontsize=6, padding=1)
    ax.set_yscale("log")
    ax.set_ylim(top=2 * max(r["tokens_per_s"] for r in rows))  # room for the tallest bar's label
    ax.set_xticks(range(len(sets)), sets)
    ax.set_ylabel("tokens per second")
    ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.08))
    ax.grid(axis="y", alpha=0.3)
    hf = f"; transformers' on the first {result['hf_limit']}" if result.get("hf_limit") else ""
    ax.set_title(f"{result['model']} {result['dtype']}, greedy, {result['max_new_tokens']} new tokens, first "
                 f"{result['limit']} prompts a set{hf}: {result['device']}, git {result['machine'].get('git')}",
                 fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--render", metavar="JSON", help="only re-write the markdown and plot of a results file")
    ap.add_argument("--sets", nargs="+", default=DEFAULT_SETS)
    ap.add_argument("--systems", nargs="+", default=GPU_SYSTEMS, choices=GPU_SYSTEMS)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--limit", type=int, default=8, help="first N prompts of each set (0: all)")
    ap.add_argument("--hf-limit", type=int, default=None,
                    help="transformers' systems on the first N of those only (default: all of them; at ~35 tokens/s "
                         "they take most of the run)")
    add_device_args(ap, "CPU, 2 prompts per set, 8 new tokens")
    args = ap.parse_args(argv)
    if args.render:
        render_files(args.render, render, plot)
        return 0
    device = pick_device(args.dry_run, args.device)
    dtype = parse_dtype(args.dtype)
    limit, max_new = (args.limit or None), args.max_new_tokens
    hf_limit = args.hf_limit
    if args.dry_run:
        limit, max_new, hf_limit = 2, 8, 1
    systems = ["ours-plain"] + [s for s in args.systems if s != "ours-plain"]  # the reference runs first

    from lookahead import LookaheadConfig  # noqa: F401  (import errors show here, before the long loads)
    from lookahead.cli import read_prompts
    from lookahead.controller import cost_key, measure_step_costs
    from lookahead.loading import default_gguf_path, from_pretrained, load_tokenizer

    head = header(device, sys.argv[1:] if argv is None else argv, __file__)
    dname = str(dtype).replace("torch.", "")
    head.update(model="SmolLM2-135M-Instruct", dtype=dname, max_new_tokens=max_new, limit=limit, hf_limit=hf_limit,
                dry_run=args.dry_run, systems=systems, per_prompt=[])
    stem = f"e2e-gpu-{head['device_slug']}" + ("" if dtype == torch.float32 else f"-{dname}") \
        + ("-dry-run" if args.dry_run else "")
    out = ResultFile(args.out_dir, stem, head, render, plot)
    if args.dry_run:
        out.note("dry run on the CPU: 2 prompts, 8 new tokens; checks the plumbing only")

    t0 = time.perf_counter()
    path = default_gguf_path()
    model = from_pretrained(path, dtype=dtype, device=device)
    tokenizer = load_tokenizer(path)
    hf_model = None
    if any(s.startswith("hf-") for s in systems):
        hf_model = hf_default_model(dtype, device)
    out.result["load_seconds"] = time.perf_counter() - t0
    cublas_model = from_pretrained(path, dtype=dtype, device=device) if any(s in CUBLAS for s in systems) else None
    gemv_model = from_pretrained(path, dtype=dtype, device=device) if any(s in GEMV for s in systems) else None
    gemv_switch = contextlib.nullcontext
    if gemv_model is not None:
        out.result["gemv_config"], config = fastest_gemv(gemv_model, device)
        gemv_switch = functools.partial(gemv_steps, config)
    for m, key, wanted, switch in ((model, "step_costs", ("ours-lookahead", "ours-device-tree"),
                                    contextlib.nullcontext),
                                   (cublas_model, "step_costs_cublas", ("ours-lookahead-cublas",), cublas_only),
                                   (gemv_model, "step_costs_gemv", tuple(GEMV), gemv_switch)):
        if any(w in systems for w in wanted):
            with switch():
                costs = measure_step_costs(m)  # measured here and now, not read from a disk cache
                m.step_costs_cache = {cost_key(m): costs}
            out.result[key] = list(zip(costs.tokens, costs.seconds))
    runners = {name: run for name, run in make_runners(model, hf_model, max_new, device).items() if name in systems}
    if cublas_model is not None:
        cublas_runners = make_runners(cublas_model, None, max_new, device)
        runners.update({name: SwitchedRunner(cublas_runners[base]) for name, base in CUBLAS.items() if name in systems})
    if gemv_model is not None:
        gemv_runners = make_runners(gemv_model, None, max_new, device)
        runners.update({name: SwitchedRunner(gemv_runners[base], gemv_switch) for name, base in GEMV.items()
                        if name in systems})

    failed = out.result.setdefault("failed_systems", {})

    def attempt(system: str, ids):
        """``runners[system](ids)``; a system that raises is said (its traceback on stderr, its error under
        ``failed_systems``) and dropped, so that the others' figures survive it (``ours-device-tree`` had never run
        on a GPU when this was written). An error that leaves the device unusable still ends the part."""
        try:
            return runners[system](ids)
        except Exception as exc:  # noqa: BLE001 -- any failure of one system: the others go on
            traceback.print_exc()
            failed[system] = f"{type(exc).__name__}: {exc}"[:500]
            print(f"{system}: FAILED, dropped: {failed[system]}", flush=True)
            del runners[system]
            out.flush()
            return None

    with torch.inference_mode():
        sets = {set_name(p): [ids.to(device) for ids in read_prompts(p, tokenizer)[:limit]] for p in args.sets}
        for prompts in sets.values():
            for system, run in list(runners.items()):  # warm-up: Triton compiles, pool extension, allocator, graphs
                attempt(system, prompts[0])
        # Prompt i of every set before prompt i + 1 of any: a time box leaves every set measured alike.
        order = [(name, i, ids) for i in range(max(map(len, sets.values()))) for name, prompts in sets.items()
                 for ids in prompts[i: i + 1]]
        memories = {}  # one DraftMemory a set, begun after the warm-ups (ours-lookahead-memory)
        for name, i, ids in order:
            ref = None
            remember_per_set(runners, memories, name)
            for system, run in list(runners.items()):
                if system.startswith("hf-") and hf_limit is not None and i >= hf_limit:
                    continue
                done = attempt(system, ids)
                if done is None:
                    continue
                seq, seconds, comp = done
                if system == "ours-plain":
                    ref = seq
                diff = first_diff(seq, ref, ids.shape[1])
                stats = getattr(run, "stats", None)  # ours only
                out.result["per_prompt"].append(
                    {"set": name, "prompt": i, "system": system, "new_tokens": seq.shape[1] - ids.shape[1],
                     "seconds": seconds, "compression": comp, "identical": diff is None, "first_diff": diff,
                     "steps": stats.steps if stats else None, "host_seconds": stats.host_seconds if stats else None,
                     "prefill_seconds": stats.prefill_seconds if stats else None,
                     "fed_tokens": stats.fed_tokens if stats else None})
            out.result["rows"] = aggregate(out.result["per_prompt"], systems)
            out.flush()
            print(f"{name} prompt {i}: " + ", ".join(
                f"{p['system']} {p['new_tokens'] / p['seconds']:.0f} tok/s{'' if p['identical'] else ' DIFF'}"
                for p in out.result["per_prompt"] if p["set"] == name and p["prompt"] == i), flush=True)
    for r in out.result["rows"]:
        print(f"{r['set']:10s} {r['system']:20s} {r['tokens_per_s']:8.1f} tok/s  compression {r['compression']:.2f}"
              f"  identical {r['identical']}/{r['prompts']}", flush=True)
    out.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
