"""Helpers shared by the benchmark scripts: git revision, machine description, result file names and writing.

The scripts import this as a sibling module (``bench/`` is put on ``sys.path`` first), so it works both for
``python bench/bench_x.py`` and for loading a script by file path.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# The dev prompt sets (``../shared/data`` beside the checkout).
DATA = os.path.join(ROOT, "..", "shared", "data")
DEFAULT_SETS = [os.path.join(DATA, "mt_bench_dev.jsonl"), os.path.join(DATA, "humaneval_dev.jsonl")]


def parse_step_costs(text: str, named: dict) -> tuple:
    """``--step-costs``: a name in ``named`` (its table), or ``T:seconds`` pairs such as ``1:2e-3,64:3e-3``."""
    if text in named:
        return tuple(named[text])
    try:
        return tuple((int(t), float(s)) for t, s in (pair.split(":") for pair in text.split(",")))
    except ValueError as exc:
        names = " or ".join(repr(n) for n in named)
        raise SystemExit(f"--step-costs: {names} or T:seconds pairs such as 1:2e-3,64:3e-3, got {text!r}") from exc


def add_output_args(ap, max_new_tokens: int, render: bool = False, threads: bool = True) -> None:
    """``--max-new-tokens``, ``--threads`` (unless ``threads`` is false: a bench that sets its own counts), and
    where the results go (``<out-dir>/<name>-<tag>.*``); with ``render``, ``--render``: only re-render a results
    file."""
    ap.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    if threads:
        ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tag", default="cpu")
    ap.add_argument("--out-dir", default=os.path.join(HERE, "results"))
    if render:
        ap.add_argument("--render", metavar="JSON", help="only re-write the markdown (and plot) of a results file")


def add_run_args(ap, prompts: int, max_new_tokens: int, threads: bool = True) -> None:
    """The options of a bench that decodes the first ``--prompts`` prompts of each of ``--sets`` on the CPU with
    ``--threads`` (see :func:`add_output_args`) and writes ``<out-dir>/<name>-<tag>.*``."""
    ap.add_argument("--sets", nargs="+", default=DEFAULT_SETS)
    ap.add_argument("--prompts", type=int, default=prompts, help="first N prompts of each set")
    add_output_args(ap, max_new_tokens, threads=threads)


def add_prompt_set_args(ap, prompts: int, max_new_tokens: int) -> None:
    """:func:`add_run_args`, and ``--render``: only re-render a results file."""
    add_run_args(ap, prompts, max_new_tokens)
    ap.add_argument("--render", metavar="JSON", help="only re-write the markdown (and plot) of a results file")


def first_prompts(sets: list[str], tokenizer, count: int) -> list[tuple[str, object]]:
    """``(set name, ids [1, L])`` for the first ``count`` prompts of each set (chat template applied)."""
    from lookahead.cli import read_prompts

    return [(set_name(path), ids) for path in sets for ids in read_prompts(path, tokenizer)[:count]]


def static_path_kwargs(config, device_type: str) -> dict:
    """``generate`` keywords a ``lookahead=config`` call needs on ``device_type``: a device tree runs on the static
    step path, which a CPU takes only when asked (without graphs)."""
    if config is not None and config.device_tree and device_type != "cuda":
        return dict(cuda_graphs=False, _static_steps=True)
    return {}


def set_name(path: str) -> str:
    """``mt_bench`` for ``.../mt_bench_dev.jsonl``: how results name a prompt set."""
    return os.path.basename(path).split(".")[0].replace("_dev", "")


def git_revision(root: str | None = None) -> str:
    """Short hash of HEAD of ``root`` (default: this checkout), with ``-dirty`` when tracked files have uncommitted
    changes; "unknown" without git.

    ``LOOKAHEAD_REVISION`` wins when set: the device machine's copy of the checkout carries the session's base
    commit in ``.git`` with the newer files over it (so git says "<base>-dirty"); ``bench/run_gpu.sh`` sets it
    from ``.device-model/REVISION``, written here before the calls."""
    given = os.environ.get("LOOKAHEAD_REVISION")
    if given:
        return given
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root or ROOT, capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root or ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
        return rev + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def cpu_model() -> str:
    # lookahead.controller.cpu_model_name's twin (the GPU run's env part calls this before lookahead may import):
    # the model name with its family and model numbers, "AMD EPYC (family 26, model 2)" (a Zen 5; a Zen 4 is
    # family 25, and hypervisors name both "AMD EPYC").
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    name = fields.get("model name")
    if not name:
        return platform.processor() or platform.machine() or "unknown CPU"
    numbers = [f"{key.split()[-1]} {fields[key]}" for key in ("cpu family", "model") if fields.get(key)]
    return f"{name} ({', '.join(numbers)})" if numbers else name


def _triton_version() -> str | None:
    try:
        import triton
    except Exception:  # not installed, or unusable on this machine
        return None
    return getattr(triton, "__version__", None)


def machine_info(device: str, root: str | None = None) -> dict:
    """What a result depends on: ``device`` ("cpu", "cuda", "cuda:1"), ``gpu`` name on CUDA, CPU, versions, git
    (of the checkout at ``root`` whose code runs, default this one), and the load average (other work on the
    machine skews CPU timings)."""
    info = {"device": device, "cpu": cpu_model(), "cpu_count": os.cpu_count(), "torch": torch.__version__,
            "triton": _triton_version(), "cuda": torch.version.cuda, "python": platform.python_version(),
            "platform": platform.platform(), "git": git_revision(root), "torch_threads": torch.get_num_threads()}
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    try:
        info["load_average"] = [round(v, 2) for v in os.getloadavg()]
    except (AttributeError, OSError):
        info["load_average"] = None
    return info


def device_label(info: dict) -> str:
    """The GPU's name, or "cpu"."""
    return info.get("gpu") or "cpu"


def device_slug(info: dict) -> str:
    """The device part of result file names: ``nvidia-h100-80gb-hbm3``, ``cpu``."""
    return re.sub(r"[^a-z0-9]+", "-", device_label(info).lower()).strip("-")


def command_line(script: str, argv: list[str]) -> str:
    """``python bench/<script> args...`` as run from the repository root."""
    return "python " + " ".join([os.path.relpath(os.path.abspath(script), ROOT), *argv])


def read_results(path: str) -> tuple[dict, str]:
    """A results JSON (for ``--render``) and its path without the extension, where its markdown and plot go."""
    with open(path) as f:
        return json.load(f), os.path.splitext(path)[0]


def render(path: str, markdown, plot) -> None:
    """``--render``: re-writes a results file's markdown (``markdown(result)``, a string) and plot (``plot(result,
    png_path)``) beside it, from its JSON alone."""
    result, base = read_results(path)
    with open(base + ".md", "w") as f:
        f.write(markdown(result))
    plot(result, base + ".png")


def write_results(out_dir: str, stem: str, result: dict, markdown: str) -> str:
    """Writes ``out_dir/stem.json`` and ``out_dir/stem.md``; returns ``out_dir/stem``."""
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, stem)
    with open(base + ".json", "w") as f:
        json.dump(result, f, indent=1)
    with open(base + ".md", "w") as f:
        f.write(markdown)
    print(f"wrote {base}.json and {base}.md")
    return base


def hf_default_model(dtype=torch.float32, device="cpu"):
    """transformers' own model of the embedded default checkpoint (SmolLM2's GGUF, dequantised by its loader) in
    eval mode: the peer our benchmarks run beside ours on the same weights."""
    from transformers import AutoModelForCausalLM

    from lookahead.loading import default_gguf_path

    path = default_gguf_path()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).to(device).eval()


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend, or None where matplotlib is missing (plots are skipped)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt
