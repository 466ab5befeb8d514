"""Just-in-time build of the host's C++ ops: the CPU forward's small-M GEMM (``csrc/small_gemm.cpp``, namespace
``torch.ops.lookahead_gemm``), step attention (``csrc/cpu_attention.cpp``, its tasks built per instruction set in
``csrc/cpu_attention_*.cpp``; ``torch.ops.lookahead_cpu``) and the whole decoder stack (``csrc/cpu_layer.cpp``,
every layer: the two before plus everything between them, same namespace), and the draft builder's best-first walk
and tree encoding (``csrc/draft_tree.cpp``, ``torch.ops.lookahead_draft``), which serve the GPU path too: the draft
is built on the host, and the successor table's top-k of a CPU step's logits (``csrc/row_topk.cpp``, same
namespace), tree verification from the logits, greedy and sampled (``csrc/verify_sample.cpp``), a plain step's
sampled draw (``csrc/sample_warped.cpp``) and a tree step's trees encoded into its packed inputs
(``csrc/pack_step.cpp``) and a verified step's acceptance trials recorded (``csrc/accept_trials.cpp``), same
namespace; and KV compaction after a tree step (``csrc/kv_compact_cpu.cpp``, ``torch.ops.lookahead_cpu``).

All live in one library, built with ninja into torch's extensions directory on first use (a subdirectory per
checkout: :func:`lookahead_kernels.build_lock.extension_name`; ``scripts/setup.sh`` builds it at install time) and
loaded by later processes in about a second. It is compiled with OpenMP: ATen's
``at::parallel_for`` is an OpenMP pragma in its headers, so without ``-fopenmp`` the ops would run on one thread
whatever ``torch.set_num_threads`` says (measured: the vocabulary projection at one row took 2.8 ms on one core,
1.3 ms on two). At run time the library binds to the libgomp torch has loaded: one thread pool for both.
"""

from __future__ import annotations

import hashlib
import sys
import threading
from pathlib import Path

import torch

from .build_lock import exclusive_build, extension_name, source_dir
from .cxx_runtime import runtime_link_flags

_CSRC = source_dir()
_NAME = extension_name("lookahead_cpu_ops", _CSRC)
# The longest compiles first (seconds on a 2-core Zen 4, one at a time: 30, 29, about 20; most others 10-15): ninja
# starts them in this order, so no long one starts last on a machine with cores to spare.
_SOURCES = ("cpu_attention_avx512_split.cpp", "cpu_attention_avx512.cpp", "small_gemm.cpp", "cpu_layer.cpp",
            "draft_tree.cpp", "host_bindings.cpp", "cpu_attention_avx2.cpp", "cpu_attention.cpp", "row_topk.cpp",
            "verify_sample.cpp", "sample_warped.cpp", "kv_compact_cpu.cpp", "suffix_match.cpp", "pack_step.cpp",
            "accept_trials.cpp")
# A change to one rebuilds the library too.
_HEADERS = ("cpu_ops.h", "cpu_vec.h", "cpu_attention_tasks.h", "draft_encode.h", "host_ops.h")
_state: dict = {}  # "ok": bool once tried in this process, "error": why not, "module": the library as a module
_lock = threading.Lock()


class CpuOpsError(RuntimeError):
    """The CPU ops library could not be built or loaded; the message carries the compiler's output."""


def _registered() -> bool:
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key("lookahead_cpu::step_attention", "CPU") and \
            torch._C._dispatch_has_kernel_for_dispatch_key("lookahead_cpu::decoder_stack", "CPU") and \
            torch._C._dispatch_has_kernel_for_dispatch_key("lookahead_cpu::forward_step", "CPU") and \
            torch._C._dispatch_has_kernel_for_dispatch_key("lookahead_gemm::linear", "CPU") and \
            torch._C._dispatch_has_kernel_for_dispatch_key("lookahead_draft::propose", "CPU") and \
            torch._C._dispatch_has_kernel_for_dispatch_key("lookahead_draft::top_successors", "CPU") and \
            torch._C._dispatch_has_kernel_for_dispatch_key("lookahead_draft::verify_tree_warped", "CPU") and \
            torch._C._dispatch_has_kernel_for_dispatch_key("lookahead_draft::sample_warped", "CPU") and \
            torch._C._dispatch_has_kernel_for_dispatch_key("lookahead_draft::verify_tree_argmax", "CPU") and \
            torch._C._dispatch_has_kernel_for_dispatch_key("lookahead_cpu::compact_kv", "CPU")
    except RuntimeError:  # a schema is not registered yet
        return False


def load_cpu_ops(verbose: bool = False) -> None:
    """Build (first time, about two minutes on 2 cores, announced on stderr) and load the CPU ops.

    Raises:
        CpuOpsError: the build or load failed (no compiler or ninja, say); the message says why.
    """
    if _registered():
        return
    with _lock:
        if _registered():
            return
        from torch.utils import cpp_extension

        sources = [_CSRC / s for s in _SOURCES]
        try:
            library = Path(cpp_extension._get_build_directory(_NAME, False)) / f"{_NAME}.so"
            stale = not library.is_file() or any(s.stat().st_mtime > library.stat().st_mtime
                                                 for s in sources + [_CSRC / h for h in _HEADERS])
        except (OSError, RuntimeError):
            stale = True
        if stale:
            print(f"lookahead: building the CPU ops extension {_NAME} (first use only; about two minutes on 2 "
                  "cores)...", file=sys.stderr, flush=True)
        try:
            with exclusive_build(_NAME):
                _state["module"] = cpp_extension.load(
                    name=_NAME, sources=[str(s) for s in sources], extra_cflags=["-O3", "-fopenmp"],
                    extra_ldflags=["-fopenmp", *runtime_link_flags()], is_python_module=True, verbose=verbose)
        except Exception as exc:  # compiler, linker or loader failure: one clear error
            raise CpuOpsError(f"building the CPU ops extension {_NAME!r} from {', '.join(_SOURCES)} failed "
                              f"(torch {torch.__version__}):\n{exc}") from exc
        if not _registered():
            raise CpuOpsError(f"the library {_NAME!r} loaded but registered no lookahead_cpu / lookahead_gemm / "
                              f"lookahead_draft ops")


def cpu_ops_available(build: bool = True) -> bool:
    """Whether the CPU ops are loaded; with ``build``, build and load them if needed (a failure is remembered
    for the process, its reason in :func:`cpu_ops_error`, and not retried)."""
    ok = _state.get("ok")
    if ok is not None:
        return ok
    if _registered():
        _state["ok"] = True
        return True
    if not build:
        return False
    try:
        load_cpu_ops()
        _state["ok"] = True
    except CpuOpsError as exc:
        _state["ok"], _state["error"] = False, str(exc)
    return _state["ok"]


def host_ops():
    """The library as a Python module (``csrc/host_bindings.cpp``): the host-side draft ops the decoding loop calls
    every step (``propose``, ``encode``, ``encode_step``, ``suffix_spans``, ``record_successors``,
    ``record_trials``), the same functions as ``torch.ops.lookahead_draft``'s with less overhead a call
    (``csrc/host_ops.h``). Loads the library where :func:`cpu_ops_available` has not yet.

    Raises:
        CpuOpsError: the library cannot be built or loaded here."""
    module = _state.get("module")
    if module is None:
        if not cpu_ops_available():
            raise CpuOpsError(cpu_ops_error() or "the CPU ops are not available")
        module = _state.get("module")
        if module is None:  # only load_cpu_ops loads the library, and it keeps the module
            raise CpuOpsError(f"the library {_NAME!r} was loaded without its Python module")
    return module


def cpu_ops_error() -> str | None:
    """Why :func:`cpu_ops_available` said no (None if it was not tried or worked)."""
    return _state.get("error")


def sources_digest() -> str:
    """12 hex digits of the SHA-256 of the library's sources and headers: what a cache of timings measured on
    these ops is keyed by, so that a change to any kernel measures again."""
    digest = _state.get("digest")
    if digest is None:
        h = hashlib.sha256()
        for name in _SOURCES + _HEADERS:
            h.update(name.encode())
            h.update((_CSRC / name).read_bytes())
        digest = _state["digest"] = h.hexdigest()[:12]
    return digest
