"""Just-in-time build of the n-gram pool's C++ (CPU) torch ops.

The ops live in the ``torch.ops.lookahead_pool`` namespace (schemas and table layout: ``csrc/ngram_pool.h``
and ``csrc/ngram_pool.cpp``):

* ``insert(conts, stamp, clock, ngrams) -> ()`` updates the tables in place;
* ``lookup(conts, stamp, key) -> (out, count)``.

Nothing is built at import. The first :func:`load_pool_extension` call compiles with ninja into torch's
extensions directory (``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``; a subdirectory per
checkout, :func:`lookahead_kernels.build_lock.extension_name`); later processes reuse the build, and within a
process an already registered library is not loaded again, and a failed build is not tried again (it took
10-60 s; its error is raised again at once). A build (as opposed to loading an existing one) prints one line on
stderr first; ``scripts/setup.sh`` builds the CPU library at install time.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch

from .build_lock import exclusive_build, extension_name, source_dir
from .cxx_runtime import runtime_link_flags

_CSRC = source_dir()
_CPU_NAME = extension_name("lookahead_pool_cpu", _CSRC)
# A failed build's error by library name, for the process: every lookahead call makes its rows' pools, and
# "auto" falls back to the Python pool on an error, which must not cost a compile each time.
_FAILED: dict[str, str] = {}


class PoolExtensionError(RuntimeError):
    """The n-gram pool extension could not be built or loaded; the message carries the compiler's output."""


def _has_kernel() -> bool:
    # Asks torch's op registry (process state owned by torch): a successful load needs no cache of ours.
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key("lookahead_pool::insert", "CPU")
    except RuntimeError:  # the op's schema is not registered yet
        return False


def _with_local_includes(sources: list[Path]) -> list[Path]:
    """``sources`` and the files of their directories they ``#include "..."``, transitively: what a build reads
    (ninja rebuilds on exactly these; another header of ``csrc/`` changing leaves the library as it is)."""
    seen, todo = [], list(sources)
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.append(path)
        for name in re.findall(r'^\s*#\s*include\s+"([^"]+)"', path.read_text(), flags=re.MULTILINE):
            if (path.parent / name).is_file():
                todo.append(path.parent / name)
    return seen


def _announce_build(name: str, sources: list[Path], cpp_extension) -> None:
    """One line on stderr when the library is missing or older than its sources (a compile follows, which takes
    tens of seconds); nothing when an existing build is only loaded."""
    try:
        library = Path(cpp_extension._get_build_directory(name, False)) / f"{name}.so"
        built = library.stat().st_mtime if library.is_file() else None
        inputs = _with_local_includes(sources)
        stale = built is None or any(s.stat().st_mtime > built for s in inputs)
    except (OSError, RuntimeError):
        stale = True
    if stale:
        print(f"lookahead: building the n-gram pool extension {name} (first use only; takes 10-60 s)...",
              file=sys.stderr, flush=True)


def _build(name: str, sources: list[Path], verbose: bool) -> None:
    from torch.utils import cpp_extension

    kwargs = dict(
        name=name,
        sources=[str(s) for s in sources],
        extra_include_paths=[str(_CSRC)],
        extra_cflags=["-O3"],
        extra_ldflags=runtime_link_flags(),
        is_python_module=False,
        verbose=verbose,
    )
    _announce_build(name, sources, cpp_extension)
    try:
        with exclusive_build(name):
            cpp_extension.load(**kwargs)
    except Exception as exc:  # compiler, linker or loader failure: hand the caller one clear error
        raise PoolExtensionError(
            f"building the n-gram pool extension {name!r} from {', '.join(s.name for s in sources)} failed "
            f"(torch {torch.__version__}, build dir {cpp_extension._get_build_directory(name, False)}):\n{exc}"
        ) from exc


def load_pool_extension(verbose: bool = False):
    """Build (first time) and load the pool ops; returns the ``torch.ops.lookahead_pool`` namespace.

    Args:
        verbose: print the build commands and compiler output.

    Raises:
        PoolExtensionError: the build or load failed (now or at an earlier call in this process, then not
            tried again); the message includes the compiler's output.
    """
    if not _has_kernel():
        if _CPU_NAME in _FAILED:
            raise PoolExtensionError(_FAILED[_CPU_NAME])
        try:
            _build(_CPU_NAME, [_CSRC / "ngram_pool.cpp"], verbose=verbose)
        except PoolExtensionError as exc:
            _FAILED[_CPU_NAME] = str(exc)
            raise
    return torch.ops.lookahead_pool
