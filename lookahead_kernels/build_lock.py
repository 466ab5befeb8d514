"""One build of a just-in-time extension at a time, and never a wait on a build that died.

torch's ``cpp_extension.load`` guards its build directory with a plain file, ``<build dir>/lock``, and waits
(forever, polling) while that file exists. A build that is killed (a timeout, an interrupted session) leaves the
file behind, and every later load of that extension on the machine then hangs; CI once sat out its whole 90
minutes so. Here each of our loads first takes an OS lock (``flock``) on a file beside it: the kernel releases
that lock when its holder dies, so whoever holds it knows no live lookahead build holds torch's file, and removes
a leftover one before calling torch.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX: no flock, so torch's own lock is left as it is
    fcntl = None

_FLOCK_FILE = "lookahead-build.flock"


@contextlib.contextmanager
def exclusive_build(name: str):
    """Held around ``cpp_extension.load(name=name, ...)`` (default build directory): waits for any other
    lookahead process building or loading ``name``, then removes the torch lock file a killed build left."""
    from torch.utils import cpp_extension

    build_dir = cpp_extension._get_build_directory(name, False)
    if fcntl is None:
        yield
        return
    os.makedirs(build_dir, exist_ok=True)
    with open(os.path.join(build_dir, _FLOCK_FILE), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            leftover = os.path.join(build_dir, "lock")
            if os.path.exists(leftover):
                print(f"lookahead: removing {leftover}, left by a build of {name} that was interrupted",
                      file=sys.stderr, flush=True)
                with contextlib.suppress(FileNotFoundError):
                    os.remove(leftover)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def extension_name(base: str, source_dir) -> str:
    """``base`` and a digest of ``source_dir``'s absolute path: the name (and so the build directory) of an extension
    built from that directory. Each checkout then builds into a directory of its own: torch rebuilds an extension
    whose build file names other source paths, so two checkouts sharing one name (a CI clone beside a working tree)
    rebuilt each other's library in turn, a minute or more each time, without the line a build announces."""
    digest = hashlib.sha1(os.path.abspath(os.fspath(source_dir)).encode()).hexdigest()[:8]
    return f"{base}_{digest}"


def source_dir() -> Path:
    """Where the C++ sources of our extensions are: ``lookahead_kernels/csrc`` in an installed package (``setup.py``
    copies the checkout's ``csrc/`` there: the extensions are built on first use, so a wheel must carry their
    sources), else the checkout's ``csrc/`` (a source tree or an editable install)."""
    here = Path(__file__).resolve().parent
    packaged = here / "csrc"
    return packaged if packaged.is_dir() else here.parent / "csrc"
