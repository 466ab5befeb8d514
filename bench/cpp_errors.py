"""Does a refused call of our C++ ops raise ValueError here, or crash the process, and where does it crash?

On the H200 image every refused call of the CPU ops library (a ``TORCH_CHECK_VALUE`` that fails) ended its process
with a segmentation fault (sessions 46 and 54). Session 57 found why: the crash is in formatting the message's
number (``std::ostream::_M_insert<double>``), inside the probe library itself, whose image-built copy holds
libstdc++'s code (frames at offsets past 1 MB of a library 0.25 MB large when built here): the toolchain there
links libstdc++ statically, and a second copy of its locale machinery beside the process's ``libstdc++.so.6``
crashes. Our extensions now name the loaded ``libstdc++.so.6`` on their link line
(``lookahead_kernels/cxx_runtime.py``). This script checks that on a machine, facts first, one row a case:

- facts: the compiler, where it finds ``libstdc++.so`` and ``libstdc++.a``, the libstdc++ this process loaded,
  ``LIBRARY_PATH``, torch's build, and each library's size and links;
- our library's refused call, alone and after a CUDA context, and through its Python module (pybind11), first;
- two probe libraries of two ops that throw with a number in the message (``TORCH_CHECK_VALUE``, ``TORCH_CHECK``):
  our compile flags as before (``-O3 -fopenmp``), and the same with the loaded libstdc++ linked (the fix), built
  meanwhile;
- each crash again under ``segv_trace.so`` (``LD_PRELOAD``; built here from ``bench/segv_trace.c``), which prints
  the native frames.

Session 55 ran it on this project's CPU machine under the image's torch build (2.11.0+cu130 from PyPI), with
Python 3.11, 3.12.1 and, in a Debian 13 chroot, 3.13 with g++ 14: every case raised, none crashed.

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
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# One refused call of our library (temperature 0 is refused).
OURS = r"""
import sys, torch
if "cuda-context" in sys.argv[1:]:
    torch.zeros(1, device="cuda")
from lookahead_kernels.cpu_ops import load_cpu_ops
load_cpu_ops()
try:
    u = torch.zeros(2, dtype=torch.float64)
    torch.ops.lookahead_draft.sample_warped(torch.zeros(2, 5), 0.0, 0, 1.0, 0.0, u)
except ValueError as exc:
    print("ValueError:", str(exc)[:90])  # the number at its end shows the message formatted whole
else:
    print("no error")
"""
# The same library's refusal through its Python module (pybind11's translation of the C++ exception; session 65).
OURS_BOUND = r"""
import torch
from lookahead_kernels.cpu_ops import host_ops
try:
    z = torch.zeros(1, dtype=torch.long)
    host_ops().encode_step(torch.tensor([-1]), torch.tensor([5]), [0], [1], 0, [3], [1], None, z, z)
except ValueError as exc:
    print("ValueError:", str(exc)[:90])
else:
    print("no error")
"""
# One refused call of a probe library: argv = library path, op namespace, op name.
PROBE = r"""
import sys, torch
torch.ops.load_library(sys.argv[1])
try:
    getattr(getattr(torch.ops, sys.argv[2]), sys.argv[3])(torch.zeros(1), 0.0)
except (ValueError, RuntimeError) as exc:
    print(type(exc).__name__ + ":", str(exc).splitlines()[0][:60])
else:
    print("no error")
"""
PROBE_SOURCE = r"""
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

at::Tensor refuse_value(const at::Tensor& x, double t) {
  TORCH_CHECK_VALUE(t > 0, "refuse_value: t must be > 0, got ", t);
  return x;
}
at::Tensor refuse_runtime(const at::Tensor& x, double t) {
  TORCH_CHECK(t > 0, "refuse_runtime: t must be > 0, got ", t);
  return x;
}
TORCH_LIBRARY(NAMESPACE, m) {
  m.def("refuse_value(Tensor x, float t) -> Tensor");
  m.def("refuse_runtime(Tensor x, float t) -> Tensor");
}
TORCH_LIBRARY_IMPL(NAMESPACE, CPU, m) {
  m.impl("refuse_value", &refuse_value);
  m.impl("refuse_runtime", &refuse_runtime);
}
"""
# Our compile flags, linked as before and with the loaded libstdc++ named (the fix). Session 57 dropped the probes
# without OpenMP and with the new string ABI forced: on the image they crashed as this one did, in the same frames.
PROBE_FLAGS = ["-O3", "-fopenmp"]
PROBES = ("cpperr_probe_omp", "cpperr_probe_runtime")


def run(cmd: list[str], timeout: float = 60, env: dict | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {}))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


def outcome(proc: subprocess.CompletedProcess) -> str:
    if proc.returncode < 0:
        return f"crashed ({signal.Signals(-proc.returncode).name})"
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return f"exit {proc.returncode}: {last[:120]}"
    return proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else "no output"


def native_frames(stderr: str) -> str:
    """The lines segv_trace.so printed (its header and the frames), else the last lines of stderr."""
    lines = stderr.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("segv_trace:")), None)
    return "\n".join(lines[start:start + 40] if start is not None else lines[-15:])


def command_output(cmd: list[str]) -> str:
    try:
        return run(cmd).stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{type(exc).__name__}: {exc}"


def library_facts(path: str) -> str:
    """A library's size (a statically linked libstdc++ adds about 1.5 MB) and what it links (``ldd``)."""
    return f"{os.path.getsize(path)} bytes\n" + command_output(["ldd", path])


def start_probe_builds(work: str, runtime: list[str]) -> dict:
    """name -> the process building that probe library (each in its own process, both at once); ``runtime``: the
    link flags of the fix (``cxx_runtime.runtime_link_flags``). :func:`finish_probe_builds` collects them."""
    procs = {}
    for name in PROBES:
        ldflags = ["-fopenmp"] + (runtime if name == "cpperr_probe_runtime" else [])
        code = ("import sys, torch\nfrom torch.utils import cpp_extension\n"
                f"src = {PROBE_SOURCE.replace('NAMESPACE', name)!r}\n"
                f"cpp_extension.load_inline(name={name!r}, cpp_sources=[src], extra_cflags={PROBE_FLAGS!r}, "
                f"extra_ldflags={ldflags!r}, is_python_module=False, "
                f"build_directory={os.path.join(work, name)!r})\n")
        os.makedirs(os.path.join(work, name), exist_ok=True)
        procs[name] = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       text=True)
    return procs


def finish_probe_builds(work: str, procs: dict) -> dict:
    """name -> the built library's path, or the error that stopped its build."""
    built = {}
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=120)
        path = os.path.join(work, name, f"{name}.so")
        built[name] = path if proc.returncode == 0 and os.path.exists(path) else f"build failed: {err[-300:]}"
    return built


class Report:
    """The JSON and markdown, rewritten after every row (a time box may stop the script at any point)."""

    def __init__(self, out_dir: str, device: str, facts: dict):
        os.makedirs(out_dir, exist_ok=True)
        self.base = os.path.join(out_dir, f"cpp-errors-{device}")
        self.result = {"device": device, "facts": facts, "rows": []}
        self.write()

    def add(self, case: str, got: str, frames: str | None = None) -> None:
        self.result["rows"].append({"case": case, "outcome": got, "native_frames": frames})
        print(f"{case:48s} {got}", flush=True)
        if frames:
            print(frames, flush=True)
        self.write()

    def write(self) -> None:
        facts, rows = self.result["facts"], self.result["rows"]
        with open(self.base + ".json", "w") as f:
            json.dump(self.result, f, indent=1)
        lines = [f"# A refused call of C++ ops: ValueError or a crash ({self.result['device']})", "",
                 "Command: `python bench/cpp_errors.py`", "", "| case | outcome |", "|---|---|"]
        lines += [f"| {r['case']} | {r['outcome']} |" for r in rows]
        for r in rows:
            if r["native_frames"]:
                lines += ["", f"Native frames, {r['case']}:", "", "```", r["native_frames"], "```"]
        for key, value in facts.items():
            lines += ["", f"{key}:", "", "```", str(value), "```"]
        with open(self.base + ".md", "w") as f:
            f.write("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default=os.path.join(HERE, "results"))
    args = ap.parse_args(argv)
    import torch
    from torch.utils import cpp_extension

    from lookahead_kernels.cpu_ops import _NAME, load_cpu_ops
    from lookahead_kernels.cxx_runtime import loaded_libstdcxx, runtime_link_flags

    device = torch.cuda.get_device_name().lower().replace(" ", "-") if torch.cuda.is_available() else "cpu"
    facts = {"torch": torch.__version__, "python": sys.version.split()[0],
             "torch C++ ABI (_GLIBCXX_USE_CXX11_ABI)": getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", "?"),
             "torch build": torch.__config__.show()}
    for key, cmd in (("c++ --version", ["c++", "--version"]),
                     ("c++ -print-file-name=libstdc++.so", ["c++", "-print-file-name=libstdc++.so"]),
                     ("c++ -print-file-name=libstdc++.a", ["c++", "-print-file-name=libstdc++.a"]),
                     ("readlink -f /usr/bin/c++", ["readlink", "-f", "/usr/bin/c++"])):
        facts[key] = command_output(cmd)
    found = facts["c++ -print-file-name=libstdc++.so"]
    facts["that libstdc++.so resolved"] = os.path.realpath(found) if os.path.exists(found) else "missing"
    facts["loaded libstdc++"] = loaded_libstdcxx()
    facts["LIBRARY_PATH"] = os.environ.get("LIBRARY_PATH")
    report = Report(args.out_dir, device, facts)
    work = tempfile.mkdtemp(prefix="cpperr-")
    trace = os.path.join(work, "segv_trace.so")
    traced = False
    for compiler in ("cc", "gcc", "c++"):  # whichever the machine has
        try:
            traced = run([compiler, "-x", "c", "-shared", "-fPIC", "-O1", "-o", trace,
                          os.path.join(HERE, "segv_trace.c")]).returncode == 0
        except OSError:
            continue
        if traced:
            break
    facts["segv_trace built"] = traced
    # The probes build in the background while our library's cases run first: they are what a lease needs, and
    # session 57's 90 s box ended among the probes' crashes before reaching them.
    building = start_probe_builds(work, runtime_link_flags())

    def case(name: str, cmd: list[str]) -> None:
        try:
            proc = run(cmd)
        except subprocess.TimeoutExpired:
            report.add(name, "timed out")
            return
        got = outcome(proc)
        frames = None
        if got.startswith("crashed") and traced:  # again, with the native stack printed
            try:
                frames = native_frames(run(cmd, env={"LD_PRELOAD": trace}).stderr)
            except subprocess.TimeoutExpired:
                frames = "timed out"
        report.add(name, got, frames)

    load_cpu_ops()
    facts["size and links, our CPU ops"] = library_facts(
        os.path.join(cpp_extension._get_build_directory(_NAME, False), f"{_NAME}.so"))
    report.write()
    case("ours: sample_warped, temperature 0", [sys.executable, "-c", OURS])
    case("ours through its Python module: encode_step, keep > size", [sys.executable, "-c", OURS_BOUND])
    if torch.cuda.is_available():
        case("ours, after a CUDA context", [sys.executable, "-c", OURS, "cuda-context"])
    for name, path in finish_probe_builds(work, building).items():
        if not os.path.exists(path):
            report.add(f"probe {name}", path)
            continue
        facts[f"size and links, {name}"] = library_facts(path)
        for op in ("refuse_value", "refuse_runtime"):
            case(f"probe {name} {op}", [sys.executable, "-c", PROBE, path, name, op])
    print(f"wrote {report.base}.json and {report.base}.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
