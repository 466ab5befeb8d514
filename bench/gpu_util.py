"""Helpers of the ``bench/gpu_*.py`` scripts: random-weight models of 7B/8B shape, timers, incremental results.

Every GPU script writes its JSON and markdown again after each measured row, so a part stopped by its time box
(``bench/run_gpu.sh``) still leaves what it measured. Each has a ``--dry-run`` that shrinks sizes and runs on the
CPU, so plumbing errors show up without a GPU; dry-run figures mean nothing.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _p in (ROOT, HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from _common import device_slug, machine_info  # noqa: E402

from lookahead.cli import DTYPES  # noqa: E402

# name -> ModelConfig keyword arguments. Positions reach 32k here, past Llama-2's trained 4k: the weights are
# random, so only the shapes (and hence the speed) matter.
MODEL_SHAPES = {
    "llama2-7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32, num_heads=32,
                      num_kv_heads=32, head_dim=128, rms_norm_eps=1e-5, rope_theta=10000.0,
                      max_position_embeddings=40960),
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                      num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
                      max_position_embeddings=40960),
    # --dry-run stand-ins: tiny, CPU-sized, MHA and GQA like the two above.
    "tiny-mha": dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=2,
                     num_kv_heads=2, head_dim=64, max_position_embeddings=4096),
    "tiny-gqa": dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=64, max_position_embeddings=4096),
}
DRY_MODELS = {"llama2-7b": "tiny-mha", "llama3-8b": "tiny-gqa"}


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


def random_model(name: str, dtype: torch.dtype, device):
    """Our ``LlamaForCausalLM`` of a named shape with torch's default random initialisation (never zeros: zeros
    can run faster than real data). Built directly on ``device`` (float32 first, then cast: about 30 GB at
    peak for the 8B shape)."""
    from lookahead.model import LlamaForCausalLM, ModelConfig

    if name not in MODEL_SHAPES:
        raise ValueError(f"unknown model shape {name!r}; known: {sorted(MODEL_SHAPES)}")
    torch.manual_seed(0)
    model = LlamaForCausalLM(ModelConfig(**MODEL_SHAPES[name]), dtype=dtype, device=device)
    return model.eval()


def weight_bytes_per_token(model) -> int:
    """Bytes of weights one decoding step must read: every parameter, except that an untied embedding table is
    read one row per token."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if model.lm_head is not None:
        emb = model.embed.weight
        total -= emb.numel() * emb.element_size() - emb.shape[1] * emb.element_size()
    return total


def kv_bytes_per_token(model, context: int) -> int:
    """Bytes of keys and values a step at ``context`` committed rows must read (each row once)."""
    c = model.config
    return 2 * c.num_layers * context * c.num_kv_heads * c.head_dim * model.embed.weight.element_size()


def synchronize(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn, device, reps: int, warmup: int = 2) -> float:
    """Median milliseconds of ``fn()``: CUDA events around each call on a GPU, perf_counter on the CPU."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    if torch.device(device).type == "cuda":
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for s, e in zip(starts, ends):
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize(device)
        times = [s.elapsed_time(e) for s, e in zip(starts, ends)]
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def copy_bandwidth_gbs(device, nbytes: int | None = None) -> float:
    """GB/s of a large device-to-device copy, counting bytes read plus bytes written (METHOD.md's ceiling)."""
    device = torch.device(device)
    n = nbytes or ((1 << 30) if device.type == "cuda" else (1 << 24))
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, reps=20, warmup=3)
    del src, dst
    return 2 * n / (ms * 1e-3) / 1e9


def capture_graph(fn, device):
    """Capture ``fn()`` in a CUDA graph after warm-up on a side stream; returns ``(graph, output)``. Replaying
    the graph reruns ``fn`` on the same input buffers and writes the same output tensor."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(3):  # compiles Triton kernels, settles the allocator
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    torch.cuda.synchronize(device)
    return graph, out


class ResultFile:
    """``out_dir/stem.json`` and ``.md``, rewritten after every row so a killed run keeps its rows; ``plot(result,
    png_path)``, where given, draws ``stem.png`` when the run finishes."""

    def __init__(self, out_dir: str, stem: str, header: dict, render, plot=None):
        self.base = os.path.join(out_dir, stem)
        self.result = dict(header, rows=[], notes=[], complete=False)
        self.render = render
        self.plot = plot
        os.makedirs(out_dir, exist_ok=True)
        self.flush()

    def add(self, row: dict) -> None:
        self.result["rows"].append(row)
        self.flush()

    def note(self, text: str) -> None:
        print("note:", text, flush=True)
        self.result["notes"].append(text)
        self.flush()

    def finish(self) -> None:
        self.result["complete"] = True
        self.flush()
        if self.plot is not None:
            self.plot(self.result, self.base + ".png")
        print(f"wrote {self.base}.json and {self.base}.md", flush=True)

    def flush(self) -> None:
        tmp = self.base + ".json.tmp"
        with open(tmp, "w") as f:
            json.dump(self.result, f, indent=1, default=str)
        os.replace(tmp, self.base + ".json")
        with open(self.base + ".md", "w") as f:
            f.write(self.render(self.result) + self._footer())

    def _footer(self) -> str:
        """The notes, and a warning while the run has not finished (a time box may have stopped it)."""
        lines = [f"- {n}" for n in self.result["notes"]]
        if not self.result["complete"]:
            lines.append("- INCOMPLETE: the run stopped before its last row (time box?).")
        return "\n" + "\n".join(lines) + "\n" if lines else ""


def header(device, argv, script: str) -> dict:
    """Machine description and command line for a result file."""
    from _common import command_line

    info = machine_info(str(device))
    return {"machine": info, "device": info.get("gpu") or "cpu", "device_slug": device_slug(info),
            "command": command_line(script, list(argv))}


def add_device_args(ap, dry_run_help: str) -> None:
    """The options every ``bench/gpu_*.py`` script takes: ``--dry-run`` (what it shrinks to on the CPU),
    ``--device`` and ``--out-dir``; :func:`pick_device` reads the first two."""
    ap.add_argument("--dry-run", action="store_true", help=dry_run_help)
    ap.add_argument("--device", help="default: cuda, or cpu with --dry-run")
    ap.add_argument("--out-dir", default=os.path.join(HERE, "results"))


def interpret_kernels_on_cpu(device: torch.device) -> None:
    """On the CPU (a dry run), run Triton kernels under the interpreter. Call it before the kernels are defined
    (their modules' first import): a script may set ``TRITON_INTERPRET``, a library may not. Also applies the fix
    Triton 3.6's interpreter needs under NumPy >= 2.4."""
    if device.type != "cpu":
        return
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from lookahead_kernels.interpreter_compat import patch_interpreter_index

    patch_interpreter_index()


def pick_device(dry_run: bool, requested: str | None) -> torch.device:
    """``cuda`` for a real run (a clear error without one); the CPU for a dry run unless told otherwise."""
    if requested:
        device = torch.device(requested)
    else:
        device = torch.device("cpu" if dry_run or not torch.cuda.is_available() else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("CUDA was asked for but torch sees no GPU")
    if device.type != "cuda" and not dry_run:
        raise SystemExit("this benchmark needs a CUDA GPU; use --dry-run to check it on the CPU")
    return device
