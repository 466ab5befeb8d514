"""Host work per lookahead step, as it would be beside a GPU: the step's forward replayed from a recording.

Where the forward is cheap (SmolLM2 replays a step in 2-5 ms on an H100) the host's work between steps bounds the
speed: candidates, the best-first trees, the step's inputs, the read-back's unpacking, the windows, learning.
On this machine the forward runs on the same cores and streams the weights through their caches, so host work
timed beside it runs cold (measured: twice as long at 16 rows, four to six times for single calls). This bench
therefore decodes each batch twice on the static (padded, graph-shaped) step path: once for real, recording what
each forward and verification returned, then ``--rounds`` times with the step runner's forward and verification
(``StepRunner._step``, what a graph replays on a GPU) replaced by the recording (the host's work is a function of
those results, so the replay takes the same steps; checked: same tokens). It reports ``stats.host_seconds`` per
step both ways, and each step's whole time replayed: everything the host does between a GPU's replays (plain
steps, packing and copying the step's inputs into the runner's buffers, which ``host_seconds`` leaves out).

The planner chooses trees from a GPU's step costs (``--step-costs``, default the H100's SmolLM2 ``t(T)`` of
record, ``bench/results/gpu-h100.md``), or takes fixed budgets (``--budgets``); ``--builders`` adds the draft
builder's Python reference beside the C++ one.

    python bench/bench_host.py                                   # 16 prompts a set, batches of 1 and 16
    python bench/bench_host.py --budgets 64 256 --builders C++ Python --batch-sizes 1 --tag cpu-builders
    python bench/bench_host.py --no-auto --plain --device-tree 4 --step-by-step --refill --prompts 48 \
        --batch-sizes 16 --max-new-tokens 64 --tag cpu-overlap     # overlapped steps against step by step

``--plain`` and ``--device-tree N`` add plain decoding and ``LookaheadConfig(device_tree=N)``; ``--step-by-step``
decodes those again with each step read back before the next is launched (``_overlap_steps=False``; by default
they overlap, ``lookahead/overlap.py``), so the difference is the host work overlapping takes off a GPU's critical
path. ``--refill``: each set's prompts in one call of at most ``B`` rows, a finished row's place going to the next.

Writes bench/results/host-<tag>.{json,md} (default tag `cpu-replay`; `host-cpu.md` is the builders' comparison of git
df8ddbf, made by that revision's version of this script, which timed host work beside the CPU forward).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from unittest import mock

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from _common import DEFAULT_SETS, command_line, machine_info, parse_step_costs, set_name, write_results  # noqa: E402

from lookahead import LookaheadConfig, load_default  # noqa: E402
from lookahead.cli import read_prompts  # noqa: E402
from lookahead.runner import StepRunner  # noqa: E402

BUILDERS = {"C++": True, "Python": False}
# SmolLM2 step latency t(T) in seconds on an H100 (CUDA graphs; bench/results/gpu-h100.md, git 5047120).
H100_STEP_COSTS = [(1, 2.15e-3), (16, 3.29e-3), (64, 3.51e-3), (128, 3.82e-3), (256, 5.05e-3), (1024, 16e-3)]


class RecordedForward:
    """Stands in for a step runner's forward and device-side finish (``StepRunner._step``: what a CUDA graph replays
    on a GPU): records what each real call returns, then replays it in order. Everything else a step does on the
    host runs for real: the trees, packing the step's inputs and copying them into the runner's buffers, the
    read-back's unpacking, learning, and the plain steps' own host work."""

    def __init__(self):
        self.real = StepRunner._step
        self.outputs: list = []
        self.next = None

    @staticmethod
    def _clone(out):
        return tuple(t.clone() for t in out) if isinstance(out, tuple) else out.clone()

    def record(self, runner, buf, finish):
        out = self.real(runner, buf, finish)
        self.outputs.append(self._clone(out))
        return out

    def replay(self, runner, buf, finish):
        return self._clone(next(self.next))  # callers may read it after the next call, as a graph's output is not

    def recording(self):
        self.outputs.clear()
        # A function, not this bound method, in the class: it then binds the runner as the method it replaces did.
        return mock.patch.object(StepRunner, "_step", lambda runner, buf, finish: self.record(runner, buf, finish))

    def replaying(self):
        self.next = iter(self.outputs)
        return mock.patch.object(StepRunner, "_step", lambda runner, buf, finish: self.replay(runner, buf, finish))


def decode(model, batches, kwargs) -> list:
    return [model.generate(b if len(b) > 1 else b[0], **kwargs) for b in batches]


def row_steps(out) -> int:
    """Steps a call's rows took part in (a row that finished early leaves the count)."""
    return sum(r.steps for r in out.stats.rows) if out.stats.rows else out.stats.steps


def per_step(outs, seconds) -> float:
    return 1e3 * sum(seconds(o) for o in outs) / sum(o.stats.steps for o in outs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=16, help="first prompts of each set")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--budgets", type=int, nargs="*", default=[],
                    help="fixed max_step_tokens configurations (default: the planner with --step-costs)")
    ap.add_argument("--step-costs", default="h100", help="'h100' (default) or T:seconds pairs, e.g. 1:2e-3,64:3e-3")
    ap.add_argument("--builders", nargs="+", choices=list(BUILDERS), default=["C++"])
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=5, help="replays of each recording (median reported)")
    ap.add_argument("--sets", nargs="+", default=DEFAULT_SETS)
    ap.add_argument("--auto", action=argparse.BooleanOptionalAction, default=True,
                    help="the planner's trees (or --budgets); --no-auto with --plain or --device-tree leaves them out")
    ap.add_argument("--plain", action="store_true", help="also plain decoding")
    ap.add_argument("--device-tree", type=int, default=0, metavar="N", help="also LookaheadConfig(device_tree=N)")
    ap.add_argument("--step-by-step", action="store_true",
                    help="plain and device-tree decoding again, each step read back before the next is launched")
    ap.add_argument("--refill", action="store_true",
                    help="each set in one call of at most B rows, a finished row's place going to the next prompt")
    ap.add_argument("--tag", default="cpu-replay")
    ap.add_argument("--out-dir", default=os.path.join(HERE, "results"))
    args = ap.parse_args(argv)
    costs = parse_step_costs(args.step_costs, {"h100": H100_STEP_COSTS})
    if args.device_tree < 0:
        ap.error(f"--device-tree must be >= 0, got {args.device_tree}")
    # label -> (lookahead, further generate keywords)
    configs = {f"fixed {b}": (LookaheadConfig(max_step_tokens=b), {}) for b in args.budgets} or \
        {"auto": (LookaheadConfig(step_costs=costs), {})}
    if not args.auto:
        configs = {}
    if args.plain:
        configs["plain"] = (None, {})
    if args.device_tree:
        configs[f"device-tree {args.device_tree}"] = (LookaheadConfig(device_tree=args.device_tree), {})
    if args.step_by_step:
        configs.update({f"{label} step-by-step": (config, {"_overlap_steps": False})
                        for label, (config, _) in list(configs.items())
                        if config is None or config.device_tree})
    if not configs:
        ap.error("nothing to decode: --no-auto needs --plain or --device-tree")
    torch.set_num_threads(args.threads)
    machine = machine_info("cpu")
    model, tokenizer = load_default()
    forward = RecordedForward()
    rows = []
    for set_path in args.sets:
        name = set_name(set_path)
        prompts = [ids[0] for ids in read_prompts(set_path, tokenizer)[: args.prompts]]  # 1-D: a batch is a list
        for batch_size in args.batch_sizes:
            batches = [prompts] if args.refill else \
                [prompts[i: i + batch_size] for i in range(0, len(prompts), batch_size)]
            for label, (config, extra) in configs.items():
                for builder in args.builders:
                    kwargs = dict(max_new_tokens=args.max_new_tokens, lookahead=config, cuda_graphs=False,
                                  _static_steps=True, _native_draft=BUILDERS[builder], **extra)
                    if args.refill:
                        kwargs["max_batch_size"] = batch_size
                    decode(model, [batches[0][:batch_size]], {**kwargs, "max_new_tokens": 8})  # warm-up: runner
                    with forward.recording():
                        real = decode(model, batches, kwargs)
                    replayed, whole = [], []
                    for _ in range(args.rounds):
                        with forward.replaying():
                            outs = decode(model, batches, kwargs)
                        if any(not torch.equal(o.sequences, r.sequences) for o, r in zip(outs, real)):
                            raise RuntimeError("the replayed decode took other steps than the recorded one")
                        replayed.append(per_step(outs, lambda o: o.stats.host_seconds))
                        whole.append(per_step(outs, lambda o: o.stats.seconds - o.stats.prefill_seconds))
                    steps = sum(o.stats.steps for o in real)
                    rows.append({
                        "set": name, "batch_size": batch_size, "config": label, "builder": builder,
                        "steps": steps,
                        "compression": sum(o.stats.new_tokens for o in real) / sum(map(row_steps, real)),
                        "host_ms_per_step_replayed": statistics.median(replayed),
                        "host_ms_per_step_replayed_min": min(replayed),
                        "host_ms_per_step_replayed_rounds": replayed,
                        # every step's whole time replayed: its host work, plain steps' and the runner's included
                        "step_ms_replayed": statistics.median(whole), "step_ms_replayed_min": min(whole),
                        "host_ms_per_step_beside_cpu_forward": per_step(real, lambda o: o.stats.host_seconds),
                        "forward_ms_per_step": per_step(real, lambda o: o.stats.seconds - o.stats.prefill_seconds
                                                        - o.stats.host_seconds),
                        "prompts": len(prompts)})
                    r = rows[-1]
                    print(f"{name:10s} B={batch_size:<3d} {label:9s} {builder:6s} host "
                          f"{r['host_ms_per_step_replayed']:.3f} ms/step replayed (min "
                          f"{r['host_ms_per_step_replayed_min']:.3f}) "
                          f"({r['host_ms_per_step_beside_cpu_forward']:.3f} beside the CPU forward), whole step "
                          f"{r['step_ms_replayed']:.3f} ms replayed, "
                          f"{steps} steps, compression {r['compression']:.2f} a row", flush=True)
    machine["load_average_end"] = machine_info("cpu")["load_average"]
    result = {"device": "cpu", "machine": machine, "command": command_line(__file__, sys.argv[1:] if argv is None
                                                                           else argv),
              "model": "SmolLM2-135M-Instruct (float32)", "threads": args.threads, "prompts": args.prompts,
              "max_new_tokens": args.max_new_tokens, "step_costs": costs, "rounds": args.rounds,
              "refill": args.refill, "rows": rows}
    write_results(args.out_dir, f"host-{args.tag}", result, markdown(result))
    return 0


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = [f"# Host work per lookahead step ({result['model']})", "",
             f"Static (padded, graph-shaped) steps on {m['device']} ({m['cpu']}), {result['threads']} threads, torch "
             f"{m['torch']}, git {m['git']}; first {result['prompts']} prompts of each set in batches, "
             f"{result['max_new_tokens']} new tokens, greedy"
             + ("; each set in one call of at most `rows` rows, a finished row's place going to the next prompt"
                if result.get("refill") else "") + "; `auto`: the planner with step costs "
             f"{result['step_costs']} (seconds). Host: `stats.host_seconds` per step (candidates, trees, step inputs, "
             "read-back, windows, learning, declined trees' included since session 49; not the forward or "
             "verification). Replayed: the forward's recorded "
             f"results returned in order, median and least of {result['rounds']} rounds (warm caches, as beside a "
             "GPU; this machine's speed drifts by up to 2x within minutes: the least is the steadier figure); beside "
             "the CPU forward: the recording run itself; rest: the recording run's other time per step (the CPU "
             "forward, verification). Whole step replayed: each step's time with only the forward and the "
             "verification replayed (since session 52; before, the host column alone, with the runner replayed too): "
             "what a GPU's host does between replays, plain steps and the copies into the runner's buffers "
             "included, and, for batches, moving the rows' caches to a smaller runner as rows finish (a copy in "
             "this CPU's memory here, in the device's there). `plain`, `device-tree N`: plain decoding and trees "
             "read on the device, their steps overlapped (the host reads a step back after launching the next); "
             "`... step-by-step`: not overlapped; compare their whole steps (a plain step-by-step step counts no "
             "host seconds).", "",
             f"Command: `{result['command']}`", "",
             "| set | rows | config | builder | host ms / step replayed, median (least) | whole step ms replayed, "
             "median (least) | beside the CPU forward | rest ms / step | steps | tokens a row-step |",
             "|---|---:|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['set']} | {r['batch_size']} | {r['config']} | {r['builder']} | "
                     f"{r['host_ms_per_step_replayed']:.3f} ({r['host_ms_per_step_replayed_min']:.3f}) | "
                     + (f"{r['step_ms_replayed']:.3f} ({r['step_ms_replayed_min']:.3f}) | " if "step_ms_replayed" in r
                        else " | ")
                     + f"{r['host_ms_per_step_beside_cpu_forward']:.3f} | "
                     f"{r['forward_ms_per_step']:.1f} | {r['steps']} | {r['compression']:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
