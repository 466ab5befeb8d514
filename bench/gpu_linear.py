"""The linear layers of a whole decoding step on a GPU: cuBLAS (``F.linear``, the model's default) against our
row-invariant Triton kernel (``lookahead_kernels.step_linear``, ``model.set_gpu_linear("kernel")``).

For each model shape every linear layer of a step runs once, each layer with its own weight (SmolLM2 float32:
30 layers of four weights and the vocabulary projection, 0.54 GB, more than an H100's L2; Llama-2-7B bfloat16:
32 layers and the head, 13 GB), the whole sequence captured in one CUDA graph and replayed
(``do_bench_cudagraph`` median), at M = 1, 16, 64 and 128 rows. ``t(M) / t(1)`` of this part of a step is what
bounds lookahead's gain where the linear layers dominate a step (SmolLM2 on an H100, session 5: cuBLAS's float32
GEMMs at 16 rows took 2.4x its one-row GEMV). Each row also says whether a row's result is the same bit for bit
at M rows as alone (``invariant``: the first weight, row 0), for both.

Then, SmolLM2 float32 only, a few tile sizes of our kernel at 16 and 64 rows (``--sweep``, last: a time box
keeps the rows before it), to choose ``step_linear.tile_config`` from measurements.

    python bench/gpu_linear.py --out-dir $OUT/work
    python bench/gpu_linear.py --dry-run --out-dir /tmp/x      # tiny shapes, Triton interpreter on the CPU

Writes ``linear-<device>.{json,md}``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from gpu_util import ResultFile, add_device_args, header, interpret_kernels_on_cpu, pick_device  # noqa: E402

# name -> (dtype, layers, per-layer weights [(N, K)], head (N, K))
SHAPES = {
    "smollm2-135m": (torch.float32, 30, [(960, 576), (576, 576), (3072, 576), (576, 1536)], (49152, 576)),
    "llama2-7b": (torch.bfloat16, 32, [(12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008)], (32000, 4096)),
}
DRY_SHAPES = {"tiny": (torch.float32, 2, [(48, 32), (32, 32), (96, 32), (32, 48)], (100, 32))}
ROWS = [1, 16, 64, 128]
DRY_ROWS = [1, 17]
# (BLOCK_N, BLOCK_K, num_warps, num_stages) tried for SmolLM2 float32 in the sweep; None: tile_config's per weight.
SWEEP = [None, (16, 64, 4, 3), (16, 32, 4, 3), (16, 128, 4, 3), (32, 64, 4, 3), (32, 32, 4, 4), (16, 64, 2, 3),
         (16, 64, 4, 4), (64, 64, 4, 3)]
DRY_SWEEP = [None, (16, 32, 4, 3), (32, 16, 4, 3)]


def render(result: dict) -> str:
    m = result["machine"]
    lines = ["# The linear layers of one decoding step: cuBLAS against our row-invariant kernel", "",
             f"Device: {result['device']}; torch {m['torch']}, triton {m['triton']}; git {m['git']}.",
             f"Command: `{result['command']}`", "",
             "ms of device time for every linear layer of one step (each with its own weight; the whole sequence "
             "replayed from one CUDA graph, `do_bench_cudagraph` median); GB/s: weight bytes read / time; "
             "invariant: row 0 of the first weight's output at M rows equals the same row computed alone, bit "
             "for bit.", "",
             "| model | dtype | rows M | cuBLAS ms | ours ms | ours / cuBLAS | cuBLAS t(M)/t(1) | ours t(M)/t(1) | "
             "cuBLAS GB/s | ours GB/s | cuBLAS invariant | ours invariant |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]

    def ratio(a, b):
        return f"{a / b:.2f}" if a and b else "—"

    def num(v, fmt):
        return "—" if v is None else format(v, fmt)

    first = {}
    for r in result["rows"]:
        if r.get("kind") != "stack":
            continue
        base = first.setdefault(r["model"], r)
        lines.append(
            f"| {r['model']} | {r['dtype']} | {r['rows']} | {num(r['torch_ms'], '.3f')} | "
            f"{num(r['kernel_ms'], '.3f')} | {ratio(r['kernel_ms'], r['torch_ms'])} | "
            f"{ratio(r['torch_ms'], base['torch_ms'])} | {ratio(r['kernel_ms'], base['kernel_ms'])} | "
            f"{num(r['torch_gbs'], '.0f')} | {num(r['kernel_gbs'], '.0f')} | {r['torch_invariant']} | "
            f"{r['kernel_invariant']} |")
    sweep = [r for r in result["rows"] if r.get("kind") == "sweep"]
    if sweep:
        lines += ["", "Tile sizes of our kernel, one for every weight of the SmolLM2 float32 stack (`tile_config`: "
                  "its choice per weight, the kernel's default):", "",
                  "| rows M | BLOCK_N | BLOCK_K | warps | stages | ms |", "|---:|---:|---:|---:|---:|---:|"]
        for r in sorted(sweep, key=lambda r: (r["rows"], r["ms"])):
            c = r["config"] or ["`tile_config`", "", "", ""]
            lines.append(f"| {r['rows']} | {c[0]} | {c[1]} | {c[2]} | {c[3]} | {r['ms']:.3f} |")
    return "\n".join(lines) + "\n"


def make_stack(dtype, layers, per_layer, head, device, seed=0):
    """The weights of one step, in order (``layers`` copies of ``per_layer``, then the head)."""
    g = torch.Generator(device=device).manual_seed(seed)  # drawn on the device: 7B's 13 GB in a second
    shapes = [s for _ in range(layers) for s in per_layer] + [head]
    return [torch.randn(n, k, generator=g, device=device, dtype=dtype).mul_(k ** -0.5) for n, k in shapes]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=ROWS)
    ap.add_argument("--no-sweep", dest="sweep", action="store_false", help="skip the tile-size sweep")
    add_device_args(ap, "tiny shapes on the CPU under Triton's interpreter")
    args = ap.parse_args(argv)
    device = pick_device(args.dry_run, args.device)
    interpret_kernels_on_cpu(device)  # before the kernel is defined
    from bench_attention import cpu_timer, cuda_timer

    from lookahead_kernels import step_linear as sl

    timer = cuda_timer if device.type == "cuda" else cpu_timer
    shapes, rows, sweep = (DRY_SHAPES, DRY_ROWS, DRY_SWEEP) if args.dry_run else (SHAPES, args.rows, SWEEP)
    head = header(device, sys.argv[1:] if argv is None else argv, __file__)
    head.update(dry_run=args.dry_run)
    out = ResultFile(args.out_dir, f"linear-{head['device_slug']}" + ("-dry-run" if args.dry_run else ""), head,
                     render)
    if args.dry_run:
        out.note("dry run: tiny shapes, Triton interpreter on the CPU; checks the plumbing only")

    def stack_fn(weights, xs, linear):
        return lambda: [linear(x, w) for x, w in zip(xs, weights)]

    with torch.inference_mode():
        for name, (dtype, layers, per_layer, head_shape) in shapes.items():
            try:
                weights = make_stack(dtype, layers, per_layer, head_shape, device)
            except torch.cuda.OutOfMemoryError as exc:
                out.note(f"{name}: {exc}"[:300])
                continue
            nbytes = sum(w.numel() * w.element_size() for w in weights)
            for m in rows:
                xs = [torch.randn(m, w.shape[1], dtype=dtype, device=device) for w in weights]
                row = {"kind": "stack", "model": name, "dtype": str(dtype).replace("torch.", ""), "rows": m,
                       "weight_gb": nbytes / 1e9}
                for system, linear in (("torch", F.linear), ("kernel", sl.step_linear)):
                    try:
                        ms = timer(stack_fn(weights, xs, linear))
                        one = linear(xs[0][:1], weights[0])
                        row[f"{system}_invariant"] = bool(torch.equal(linear(xs[0], weights[0])[:1], one))
                    except Exception as exc:  # a failing system (a compile, memory) must not lose the other
                        out.note(f"{name} M={m} {system}: {type(exc).__name__}: {exc}"[:300])
                        ms = row[f"{system}_invariant"] = None
                    row[f"{system}_ms"] = ms
                    row[f"{system}_gbs"] = nbytes / (ms * 1e-3) / 1e9 if ms else None
                if row["kernel_ms"] is not None:
                    want = F.linear(xs[0].double(), weights[0].double())
                    row["kernel_rel_err"] = ((sl.step_linear(xs[0], weights[0]).double() - want).norm()
                                             / want.norm()).item()
                out.add(row)
                print(f"{name} M={m:4d}: cuBLAS {row['torch_ms']} ms, ours {row['kernel_ms']} ms, invariant "
                      f"{row['torch_invariant']}/{row['kernel_invariant']}, err {row.get('kernel_rel_err')}",
                      flush=True)
            del weights
        if args.sweep:
            name = next(iter(shapes))
            dtype, layers, per_layer, head_shape = shapes[name]
            weights = make_stack(dtype, layers, per_layer, head_shape, device)
            for m in rows[1:3]:
                xs = [torch.randn(m, w.shape[1], dtype=dtype, device=device) for w in weights]
                ys = [torch.empty(m, w.shape[0], dtype=dtype, device=device) for w in weights]
                for config in sweep:
                    def run(config=config):
                        for x, w, y in zip(xs, weights, ys):
                            sl._launch(x, w, None, y, config)
                    try:
                        ms = timer(run)
                    except Exception as exc:  # a tile that does not compile or fit must not lose the others
                        out.note(f"sweep {config} at M={m}: {type(exc).__name__}: {exc}"[:300])
                        continue
                    out.add({"kind": "sweep", "model": name, "rows": m, "config": config and list(config),
                             "ms": ms})
                    print(f"sweep M={m} {config}: {ms:.3f} ms", flush=True)
    out.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
