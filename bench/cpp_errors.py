"""Does a refused call of our C++ ops raise ValueError here, or crash the process?

On the H200 of session 46 (git d8b31f2) three tests that pass bad arguments to the CPU ops library
(`lookahead_draft.sample_warped`, `verify_tree_argmax`, `lookahead_cpu.compact_kv`) ended their pytest worker with
a segmentation fault inside the op's call, where every other machine raises the ValueError that `TORCH_CHECK_VALUE`
throws. This script says which conditions crash: each case is one fresh interpreter that imports some modules
first (those the crashed workers had loaded; `cuda-context`: a CUDA context made first), loads the library and
makes one refused call. It also records the compiler that built the library and what the library links.

    python bench/cpp_errors.py --out-dir /tmp/x

Writes cpp-errors-<device>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

CALL = r"""
import importlib, sys
import torch
for name in sys.argv[1:]:
    if name == "cuda-context":  # the tests' workers had one
        torch.zeros(1, device="cuda")
    else:
        importlib.import_module(name)
from lookahead_kernels.cpu_ops import load_cpu_ops
load_cpu_ops()
try:
    u = torch.zeros(2, dtype=torch.float64)
    torch.ops.lookahead_draft.sample_warped(torch.zeros(2, 5), 0.0, 0, 1.0, 0.0, u)  # temperature 0: refused
except ValueError as exc:
    print("ValueError:", str(exc)[:60])
else:
    print("no error")
"""
# What the crashed workers had loaded before the call (their "Extension modules" lines), one at a time then all.
ALONE = ["cuda-context", "scipy.stats", "Cython.Compiler.Code", "triton", "pyarrow", "pandas", "sklearn",
         "transformers"]
CASES = [[]] + [[name] for name in ALONE] + [ALONE]


def run(cmd: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")))


def outcome(proc: subprocess.CompletedProcess) -> str:
    if proc.returncode < 0:
        return f"crashed ({signal.Signals(-proc.returncode).name})"
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return f"exit {proc.returncode}: {last[:120]}"
    return proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else "no output"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default=os.path.join(HERE, "results"))
    args = ap.parse_args(argv)
    import torch
    from torch.utils import cpp_extension

    from lookahead_kernels.cpu_ops import _NAME, load_cpu_ops

    load_cpu_ops()
    library = os.path.join(cpp_extension._get_build_directory(_NAME, False), f"{_NAME}.so")
    facts = {"torch": torch.__version__, "python": sys.version.split()[0]}
    for key, cmd in (("c++", ["c++", "--version"]), ("ldd", ["ldd", library])):
        try:
            facts[key] = run(cmd).stdout.strip()
        except (OSError, subprocess.SubprocessError) as exc:
            facts[key] = f"{type(exc).__name__}: {exc}"
    rows = []
    for modules in CASES:
        try:
            got = outcome(run([sys.executable, "-c", CALL, *modules]))
        except subprocess.TimeoutExpired:
            got = "timed out"
        rows.append({"imported first": modules, "outcome": got})
        print(f"{' '.join(modules) or '(nothing)':40s} {got}", flush=True)
    device = torch.cuda.get_device_name().lower().replace(" ", "-") if torch.cuda.is_available() else "cpu"
    result = {"device": device, "facts": facts, "rows": rows}
    os.makedirs(args.out_dir, exist_ok=True)
    base = os.path.join(args.out_dir, f"cpp-errors-{device}")
    with open(base + ".json", "w") as f:
        json.dump(result, f, indent=1)
    lines = [f"# A refused call of the CPU ops: ValueError or a crash ({device})", "",
             f"torch {facts['torch']}, Python {facts['python']}. Command: `python bench/cpp_errors.py`", "",
             "| imported first | outcome |", "|---|---|"]
    lines += [f"| {' '.join(r['imported first']) or '(nothing)'} | {r['outcome']} |" for r in rows]
    lines += ["", "Compiler:", "", "```", facts["c++"], "```", "", "The library links:", "", "```", facts["ldd"], "```"]
    with open(base + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {base}.json and {base}.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
