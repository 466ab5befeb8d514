"""The CPU GEMM on weights as GGUF's quantised types dequantise them: read from the integer blocks against the
float32 layout, and what packing them costs.

For each type (Q4_1, the default model's; Q4_K, Q5_K, Q6_K and Q3_K, what most published GGUF files hold; and weights
of Q4_K rows beside Q6_K ones, as a fused q/k/v of a "Q4_K_M" layer, packed as mixed), ``--layers``
decoder layers of random weights in shapes like SmolLM2's with K a multiple of 256 (the k-quants' super-block), far
more bytes than the caches hold (as in a model's forward, where each weight is read once a step): one product of
every weight at M rows, from the packed blocks and from the float32 layout, interleaved, the fastest of ``--reps``
rounds. Every result is checked bit-equal between the two layouts.

    python bench/bench_gguf_types.py --threads 2

Writes bench/results/gguf-types-<tag>.{json,md}.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from _common import command_line, machine_info, write_results  # noqa: E402

from lookahead import cpu_linear  # noqa: E402
from tests.test_fast_forward import (gguf_dequantised, gguf_q4_k_weight, gguf_q5_blocks,  # noqa: E402
                                     gguf_q6_k_blocks, gguf_random_k_blocks, quantised_weight)

SHAPES = ((3072, 512), (512, 1536), (768, 512), (512, 512))  # gate/up, down, q/k/v, o


def weights(kind: str, layers: int, g: torch.Generator) -> list[torch.Tensor]:
    def seed() -> int:
        return int(torch.randint(0, 2**31, (1,), generator=g))

    def q6_k(N: int, K: int) -> torch.Tensor:
        return gguf_dequantised(gguf_q6_k_blocks(N, K, seed()), "Q6_K", N, K)

    make = {"Q4_1": lambda N, K: quantised_weight(N, K, "q4", g), "Q4_K": lambda N, K: gguf_q4_k_weight(N, K, g),
            "Q5_K": lambda N, K: gguf_dequantised(gguf_q5_blocks("Q5_K", N, K, seed()), "Q5_K", N, K),
            "Q6_K": q6_k,
            "Q3_K": lambda N, K: gguf_dequantised(gguf_random_k_blocks("Q3_K", N, K, seed()), "Q3_K", N, K),
            # a fused weight of two types (q/k/v with a Q6_K v): its first three quarters Q4_K, the rest Q6_K
            "Q4_K+Q6_K": lambda N, K: torch.cat([gguf_q4_k_weight(N - N // 4, K, g), q6_k(N // 4, K)])}[kind]
    return [make(N, K) for _ in range(layers) for N, K in SHAPES]


def timed_products(ws, packs, xs) -> float:
    start = time.perf_counter()
    for w, p, x in zip(ws, packs, xs):
        torch.ops.lookahead_gemm.linear(x, p, w.shape[0], None)
    return time.perf_counter() - start


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--tag", default="cpu")
    ap.add_argument("--out-dir", default=os.path.join(HERE, "results"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not cpu_linear.gemm_available():
        print(f"no CPU GEMM: {cpu_linear.gemm_error()}", file=sys.stderr)
        return 1
    gemm = torch.ops.lookahead_gemm
    machine = machine_info("cpu")
    g = torch.Generator().manual_seed(0)
    rows = []
    for kind in ("Q4_1", "Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q4_K+Q6_K"):
        ws = weights(kind, args.layers, g)
        started = time.perf_counter()
        blocks = [gemm.pack(w) for w in ws]
        pack_ns = (time.perf_counter() - started) / sum(w.numel() for w in ws) * 1e9
        formats = sorted({gemm.packed_format(p) for p in blocks})
        plain = [gemm.pack(w, "f32") for w in ws]
        for M in args.rows:
            xs = [torch.randn(M, w.shape[1], generator=g) for w in ws]
            identical = all(torch.equal(gemm.linear(x, a, w.shape[0], None), gemm.linear(x, b, w.shape[0], None))
                            for w, a, b, x in zip(ws, blocks, plain, xs))
            best = {"blocks": float("inf"), "f32": float("inf")}
            for _ in range(args.reps):  # interleaved: a slow spell of the machine slows both alike
                best["blocks"] = min(best["blocks"], timed_products(ws, blocks, xs))
                best["f32"] = min(best["f32"], timed_products(ws, plain, xs))
            row = {"type": kind, "packed_as": "+".join(formats), "rows": M, "weights": sum(w.numel() for w in ws),
                   "ms_blocks": best["blocks"] * 1e3, "ms_f32": best["f32"] * 1e3, "identical": identical,
                   "pack_ns_per_weight": pack_ns}
            rows.append(row)
            print(f"{kind} M={M}: blocks {row['ms_blocks']:.2f} ms, float32 {row['ms_f32']:.2f} ms, identical "
                  f"{identical}, packed as {row['packed_as']} at {pack_ns:.1f} ns a weight")
    result = {"command": command_line(__file__, sys.argv[1:] if argv is None else argv), "machine": machine,
              "threads": args.threads, "layers": args.layers, "shapes": SHAPES, "rows": rows}
    write_results(args.out_dir, f"gguf-types-{args.tag}", result, markdown(result))
    return 0


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = [f"# The CPU GEMM on GGUF quantised types: integer blocks against the float32 layout", "",
             f"`{result['command']}`", "",
             f"{m.get('cpu', 'cpu')}, {result['threads']} threads, torch {m.get('torch')}, git {m.get('git')}. "
             f"{result['layers']} layers of random weights of shapes {list(map(tuple, result['shapes']))} per type; "
             "one product of every weight at M rows, the fastest of the rounds.", "",
             "| type | packed as | M | from the blocks ms | from float32 ms | float32 / blocks | identical "
             "| pack ns a weight |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['type']} | {r['packed_as']} | {r['rows']} | {r['ms_blocks']:.2f} | {r['ms_f32']:.2f} | "
                     f"{r['ms_f32'] / r['ms_blocks']:.2f}x | {r['identical']} | {r['pack_ns_per_weight']:.1f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
