"""Compiling Triton kernels for an H100 (sm_90) on a machine without a GPU: the interpreter never compiles, so
compiled-path errors (loop-carried types, constexpr specialisation of strides equal to 1) would otherwise first
show up on a GPU."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest


def run_compile_script(script: str, kernel_device: str, env_extra: dict | None = None) -> None:
    """Run ``script`` (which builds kernels with ``triton.compile`` for ``GPUTarget("cuda", 90, 32)`` and prints
    ``sm90 ok``) in a fresh interpreter without ``TRITON_INTERPRET``; skips on a GPU (the other tests compile
    there) and where this Triton has no ``ptxas``."""
    if kernel_device == "cuda":
        pytest.skip("on a GPU the other tests compile the kernels")
    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not (os.path.exists(ptxas) or shutil.which("ptxas")):
        pytest.skip("this Triton install has no ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(env_extra or {})
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "sm90 ok" in proc.stdout, proc.stderr[-3000:]
