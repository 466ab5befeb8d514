"""Our just-in-time extensions link the C++ runtime this process already runs, never a second copy of it.

On the H200 image (session 57, ``bench/results/gpu-h200-s57.md``) the toolchain linked libstdc++ statically into
every extension it built: a second copy of libstdc++'s locale machinery beside the process's ``libstdc++.so.6``
crashed on the first number an iostream formatted, so every refused call (its message names a number) ended the
process instead of raising ``ValueError``. Built so on this project's CPU machine (``-static-libstdc++``), such a
library does not crash but drops the numbers from its messages. Naming the loaded ``libstdc++.so.6`` on the link
line resolves those symbols from it (the library then needs it by its soname, as any normal build does), and the
linker takes nothing from a static archive, whatever the toolchain's defaults.
"""

from __future__ import annotations

import os


def loaded_libstdcxx(maps: str = "/proc/self/maps") -> str | None:
    """The path of the libstdc++ shared library mapped into this process (torch loads it), or None where there is
    none or no ``/proc`` (not Linux)."""
    try:
        with open(maps) as lines:
            for line in lines:
                fields = line.rstrip("\n").split(maxsplit=5)
                if len(fields) == 6 and os.path.basename(fields[5]).startswith("libstdc++.so"):
                    return fields[5] if os.path.isfile(fields[5]) else None
    except OSError:
        return None
    return None


def runtime_link_flags() -> list[str]:
    """Linker inputs for ``cpp_extension.load(extra_ldflags=...)``: the loaded libstdc++, where there is one."""
    path = loaded_libstdcxx()
    return [path] if path else []
