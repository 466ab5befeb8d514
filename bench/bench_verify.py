"""Verification of one lookahead step on the draft tree: microseconds per step, Triton kernels vs torch reference.

Rows, for greedy and for sampling (B = 1, float32), on trees of 120 nodes:

* ``linear``: ``TreeShape.linear(30, 4)``, the original lookahead candidates (30 chains of N-1 = 4 tokens);
* ``bushy``: a random pre-ordered tree of depth at most 6, branching mostly near the root;

and methods

* ``triton``: ``lookahead_kernels.verify.verify_tree_greedy`` / ``verify_tree_sample`` (GPU only; sampling
  includes the ``torch.rand`` of its uniforms); ``triton graph``: the same replayed from a CUDA graph;
  ``torch warp + triton graph``: ``warp_logits`` of every row and then the walk, in one graph, as a sampled step
  runs them (temperature 1; mode ``sample top-p``: temperature 0.7, top-p 0.9);
* ``torch reference``: ``verify_tree_greedy_reference`` / ``verify_tree_sample_reference`` (with the uniforms
  drawn), on rows warped beforehand;
* on the CPU, sampling from the logits as a step verifies them (temperature 1; and mode ``sample top-p``:
  temperature 0.7, top-p 0.9): ``torch warp + reference`` (``warp_logits`` of every row, then the reference) and
  ``C++ from logits`` (``verify_tree_sample_cpu``, which warps only the rows its walk reaches), checked equal.

    python bench/bench_verify.py          # on a GPU: every row, timed with triton.testing.do_bench (median)
    python bench/bench_verify.py --cpu    # the CPU's rows (perf_counter medians)

Writes bench/results/verify-<device-slug>.{json,md}. Inputs are random logits; every node's token is, with
probability 1/2, the argmax at its parent (the first child always), so walks have realistic lengths.
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

from _common import command_line, device_slug, machine_info, write_results  # noqa: E402

from lookahead.sampling import SamplingParams, warp_logits  # noqa: E402
from lookahead_kernels.cpu_ops import cpu_ops_available  # noqa: E402
from lookahead_kernels.tree import TreeShape  # noqa: E402
from lookahead_kernels.verify_ref import (draw_tree_uniforms, verify_tree_greedy_reference,  # noqa: E402
                                          verify_tree_sample_reference)

NODES = 120
TREES = ("linear", "bushy")
VOCABS = (32000, 49152, 128256)
# On the H200 (sessions 46 and 54) greedy verification of 120 rows of 128256 logits took 53 us in a graph (5 slices a
# row by default) against 12-17 us at 32000 and 49152: these counts say whether more programs a row bring it under 30
# us. Those slices were 25652 logits long, which the compiler could not prove aligned: 4-byte loads (session 55 made
# every slice a multiple of 16 logits, so 16-byte loads; not yet timed on a GPU).
SLICE_SWEEP = (2, 8, 10, 20, 40)


# ---- inputs ------------------------------------------------------------------------------------------------------
def bushy_parents(size: int, max_depth: int, gen: torch.Generator) -> list[int]:
    """A random pre-ordered tree: each node extends the last one (half the time, within ``max_depth``) or hangs off
    x or one of the first two levels of the current path."""
    parents, stack = [], [-1]  # stack: x, then the path from x down to the last node
    for i in range(size):
        if len(stack) <= max_depth and float(torch.rand((), generator=gen)) < 0.5:
            k = len(stack) - 1
        else:
            k = int(torch.randint(0, min(3, len(stack)), (), generator=gen))
        parents.append(stack[k])
        stack = stack[:k + 1] + [i]
    return parents


def make_tree(kind: str, gen: torch.Generator) -> tuple[TreeShape, list[int]]:
    if kind == "linear":
        tree = TreeShape.linear(NODES // 4, 4)
    else:
        tree = TreeShape.from_parents(bushy_parents(NODES, 6, gen))
    return tree, tree.parents().tolist()


def make_inputs(kind: str, vocab: int, device, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    tree, parents = make_tree(kind, gen)
    x = torch.randn(1, vocab, generator=gen) * 4
    nodes = torch.randn(1, NODES, vocab, generator=gen) * 4
    tokens = torch.randint(0, vocab, (1, NODES), generator=gen)
    y0, pred = x.argmax(-1), nodes.argmax(-1)
    for i, p in enumerate(parents):
        if i == p + 1 or float(torch.rand((), generator=gen)) < 0.5:
            tokens[0, i] = y0[0] if p < 0 else pred[0, p]
    depth = int(tree.depth.max())
    x, nodes, tokens, end = x.to(device), nodes.to(device), tokens.to(device), tree.end.to(device)
    params = SamplingParams(temperature=1.0)
    return x, nodes, tokens, end, depth, warp_logits(x, params), warp_logits(nodes, params)


def add_cpu_sampling_cases(cases: dict, x, nodes, tokens, end, depth, gen, kind, vocab) -> None:
    """The CPU's sampled verification from the logits, both ways, after checking they agree."""
    from lookahead_kernels import verify_tree_sample_cpu

    for mode, params in (("sample", SamplingParams(1.0)), ("sample top-p", SamplingParams(0.7, 0, 0.9))):
        warp = dict(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)
        u = draw_tree_uniforms(1, NODES, "cpu", gen)
        ref = verify_tree_sample_reference(warp_logits(x, params), warp_logits(nodes, params), tokens, end, None,
                                           depth, u)
        got = verify_tree_sample_cpu(x, nodes, tokens, end, None, depth, uniforms=u, **warp)
        if not all(torch.equal(a, b) for a, b in zip(ref, got)):
            raise RuntimeError(f"verify_tree_sample_cpu differs from its reference on the {kind} tree, vocab {vocab}")
        cases[(mode, "torch warp + reference")] = lambda p=params: verify_tree_sample_reference(
            warp_logits(x, p), warp_logits(nodes, p), tokens, end, None, depth, draw_tree_uniforms(1, NODES, "cpu", gen))
        cases[(mode, "C++ from logits")] = lambda w=warp: verify_tree_sample_cpu(x, nodes, tokens, end, None, depth,
                                                                                generator=gen, **w)


def add_gpu_warp_cases(cases: dict, x, nodes, tokens, end, depth, gen, kind, vocab) -> None:
    """What a sampled step's graph runs on a GPU: ``warp_logits`` of x and every node row (torch; top-p sorts each
    row of the vocabulary), then the Triton walk; checked against the reference first. Beside the ``sample triton
    graph`` row it tells what the warp costs, and so whether warping lazily inside the walk (as the CPU's C++ walk
    does) could pay."""
    from lookahead_kernels.verify import verify_tree_sample

    for mode, params in (("sample", SamplingParams(1.0)), ("sample top-p", SamplingParams(0.7, 0, 0.9))):
        u = draw_tree_uniforms(1, NODES, x.device, gen)
        xp, np_ = warp_logits(x, params), warp_logits(nodes, params)
        ref = verify_tree_sample_reference(xp, np_, tokens, end, None, depth, u)
        got = verify_tree_sample(xp, np_, tokens, end, None, depth, u)
        if not all(torch.equal(a, b) for a, b in zip(ref, got)):
            raise RuntimeError(f"verify_tree_sample differs from its reference ({mode}) on the {kind} tree, "
                               f"vocab {vocab}")
        cases[(mode, "torch warp + triton graph")] = lambda p=params: verify_tree_sample(
            warp_logits(x, p), warp_logits(nodes, p), tokens, end, None, depth, generator=gen)


# ---- timing ------------------------------------------------------------------------------------------------------
def add_gpu_top_cases(cases: dict, x, nodes) -> None:
    """The successor table's tops of a tree step's rows (``x`` and its nodes: 33 rows, a 32-node tree; 121, this
    bench's trees): ``torch.topk`` and its softmax (``SuccessorTable.top_reference``, what the GPU's graph ran
    until session 56) against the Triton kernels (``lookahead_kernels.row_topk``), each in a graph."""
    from lookahead.successors import SuccessorTable
    from lookahead_kernels.row_topk import row_top_k

    logits = torch.cat([x[:, None], nodes], dim=1)  # [1, 1 + NODES, V], as a step's logits
    for rows in (33, 1 + NODES):
        part = logits[:, :rows]
        ids, probs = row_top_k(part, 8)
        ref_ids, ref_probs = SuccessorTable.top_reference(part, 8)
        if not torch.equal(ids, ref_ids) or not torch.allclose(probs, ref_probs, rtol=1e-5, atol=1e-7):
            raise RuntimeError(f"row_top_k differs from torch.topk over {rows} rows")
        cases[(f"tops {rows} rows", "torch graph")] = lambda p=part: SuccessorTable.top_reference(p, 8)
        cases[(f"tops {rows} rows", "triton graph")] = lambda p=part: row_top_k(p, 8)


def time_cpu(fn, min_reps=5, budget_s=0.5):
    fn()  # warm-up
    times = []
    start = time.perf_counter()
    while len(times) < min_reps or (time.perf_counter() - start < budget_s and len(times) < 1000):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6, len(times)


def time_gpu(fn):
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3, None


def time_gpu_graph(fn):
    """The device's time alone: ``fn`` captured in a CUDA graph and replayed (no host launch cost), as a step
    replayed from a graph would pay it."""
    import triton.testing

    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3, None


# ---- main --------------------------------------------------------------------------------------------------------
def save(args, device, on_gpu: bool, argv, rows: list) -> str:
    """Write the rows so far (after every vocabulary: a time box that stops the run keeps what was measured)."""
    info = machine_info(device)  # its load average: the one the CPU rows ran under so far
    result = {"machine": info, "command": command_line(__file__, sys.argv[1:] if argv is None else argv),
              "timer": ("triton.testing.do_bench median (launch included); `triton graph`: "
                        "triton.testing.do_bench_cudagraph median (device time)" if on_gpu
                        else "time.perf_counter median (CPU)"),
              "batch": 1, "dtype": "float32", "rows": rows}
    markdown = render_markdown(result)
    write_results(args.out_dir, f"verify-{args.tag or device_slug(info)}", result, markdown)
    return markdown



def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="run the torch reference rows on CPU")
    ap.add_argument("--out-dir", default=os.path.join(HERE, "results"))
    ap.add_argument("--tag", default=None, help="result file tag (default: the device)")
    args = ap.parse_args(argv)
    on_gpu = torch.cuda.is_available() and not args.cpu
    if not on_gpu and not args.cpu:
        print("bench_verify: the Triton kernel rows need a CUDA GPU; none here. "
              "Run with --cpu for the torch reference rows on CPU.")
        return 0
    device = "cuda" if on_gpu else "cpu"
    timer = time_gpu if on_gpu else time_cpu
    if not on_gpu:
        torch.set_num_threads(1)  # steadier medians; these rows are single-stream work anyway
    if on_gpu:
        from lookahead_kernels.verify import verify_tree_greedy, verify_tree_sample

    rows = []
    for vocab in VOCABS:
        for kind in TREES:
            x, nodes, tokens, end, depth, xp, np_ = make_inputs(kind, vocab, device)
            gen = torch.Generator(device=device).manual_seed(0)
            cases = {
                ("greedy", "torch reference"): lambda: verify_tree_greedy_reference(x, nodes, tokens, end, None,
                                                                                    depth),
                ("sample", "torch reference"): lambda: verify_tree_sample_reference(
                    xp, np_, tokens, end, None, depth, draw_tree_uniforms(1, NODES, device, gen)),
            }
            if on_gpu:
                cases[("greedy", "triton")] = lambda: verify_tree_greedy(x, nodes, tokens, end, None, depth)
                cases[("sample", "triton")] = lambda: verify_tree_sample(xp, np_, tokens, end, None, depth,
                                                                         generator=gen)
                ref = verify_tree_greedy_reference(x, nodes, tokens, end, None, depth)
                got = verify_tree_greedy(x, nodes, tokens, end, None, depth)
                if not all(torch.equal(a, b) for a, b in zip(ref, got)):
                    raise RuntimeError(f"verify_tree_greedy differs from its reference on the {kind} tree, "
                                       f"vocab {vocab}")
                u = draw_tree_uniforms(1, NODES, device, gen)
                ref = verify_tree_sample_reference(xp, np_, tokens, end, None, depth, u)
                got = verify_tree_sample(xp, np_, tokens, end, None, depth, u)
                if not all(torch.equal(a, b) for a, b in zip(ref, got)):
                    raise RuntimeError(f"verify_tree_sample differs from its reference on the {kind} tree, "
                                       f"vocab {vocab}")
            if not on_gpu and cpu_ops_available():
                add_cpu_sampling_cases(cases, x, nodes, tokens, end, depth, gen, kind, vocab)
            accepted = int(verify_tree_greedy_reference(x, nodes, tokens, end, None, depth)[0])
            if on_gpu:  # the same kernels, launch cost removed: what they cost inside a captured step
                cases[("greedy", "triton graph")] = cases[("greedy", "triton")]
                cases[("sample", "triton graph")] = cases[("sample", "triton")]
                if kind == "linear":  # slices a row's argmax is shared by (default: 4 programs an SM over the rows)
                    for splits in SLICE_SWEEP:
                        cases[("greedy", f"triton graph {splits:02d} slices")] = \
                            lambda s=splits: verify_tree_greedy(x, nodes, tokens, end, None, depth, vocab_splits=s)
                add_gpu_warp_cases(cases, x, nodes, tokens, end, depth, gen, kind, vocab)
                if kind == "linear":
                    add_gpu_top_cases(cases, x, nodes)
            for (mode, method), fn in sorted(cases.items()):
                try:
                    us, reps = (time_gpu_graph if "graph" in method else timer)(fn)
                except Exception as exc:  # noqa: BLE001 - a capture failing must not lose the other rows
                    print(f"{mode} {method} vocab={vocab} {kind}: {type(exc).__name__}: {exc}"[:300], flush=True)
                    continue
                rows.append({"mode": mode, "method": method, "vocab": vocab, "tree": kind, "nodes": NODES,
                             "depth": depth, "greedy_accepted": accepted, "us": round(us, 2), "reps": reps})
                print(f"{mode:6s} {method:16s} vocab={vocab:6d} {kind:6s} tree: {us:10.1f} us", flush=True)
        save(args, device, on_gpu, argv, rows)

    markdown = save(args, device, on_gpu, argv, rows)
    print(markdown)
    return 0


def render_markdown(result: dict) -> str:
    m = result["machine"]
    where = m.get("gpu") or f"CPU ({m['cpu']}, {m['cpu_count']} cores)"
    cpu_load = "gpu" not in m and m.get("load_average") is not None
    methods = sorted({r["method"] for r in result["rows"]})
    lines = ["# Verification of one lookahead step on the draft tree: microseconds per step", "",
             f"Device: {where}; torch {m['torch']}, triton {m['triton']}, CUDA {m['cuda']}, Python {m['python']}; "
             f"git {m['git']}." + (f" CPU load average at the end: {m['load_average']} ({m['torch_threads']} "
                                   "torch thread)." if cpu_load else ""),
             f"Command: `{result['command']}`. Timer: {result['timer']}. B = {result['batch']}, {result['dtype']}, "
             f"trees of {NODES} nodes (linear: 30 chains of 4; bushy: random, depth <= 6); max_accept = the "
             "tree's depth.", ""]
    if "triton" not in methods:
        lines += ["Triton kernel rows need a GPU and are absent here. Sampling rows include drawing the "
                  "random numbers.", ""]
    lines += ["| mode | vocab | tree | depth | greedy accepted | " + " | ".join(f"{x} µs" for x in methods) + " |",
              "|---|---:|---|---:|---:|" + "---:|" * len(methods)]
    index = {(r["mode"], r["vocab"], r["tree"], r["method"]): r for r in result["rows"]}
    keys = sorted({(r["mode"], r["vocab"], r["tree"]) for r in result["rows"]})
    for mode, vocab, tree in keys:
        some = next(r for (mo, v, t, _), r in index.items() if (mo, v, t) == (mode, vocab, tree))
        vals = [index.get((mode, vocab, tree, x), {}).get("us") for x in methods]
        lines.append(f"| {mode} | {vocab} | {tree} | {some['depth']} | {some['greedy_accepted']} | "
                     + " | ".join("" if v is None else f"{v:.1f}" for v in vals) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
