"""Installs the packages ``lookahead`` and ``lookahead_kernels`` and the console script ``lookahead``.

The C++ ops in ``csrc/`` are compiled just in time (ninja, through torch.utils.cpp_extension) on first use, so
installing needs no compiler; see ``lookahead_kernels/cpu_ops.py`` and ``lookahead_kernels/pool_ext.py``. That is
also why a built package carries the sources: they are copied into ``lookahead_kernels/csrc``, where
``lookahead_kernels.build_lock.source_dir`` finds them (a wheel without them ran SmolLM2 about 5x slower, every
C++ op falling back to its Python or oneDNN path).
"""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

SOURCES = Path(__file__).resolve().parent / "csrc"


class BuildPyWithSources(build_py):
    """``build_py``, then ``csrc/`` copied into the built ``lookahead_kernels/csrc``."""

    def run(self):
        super().run()
        shutil.copytree(SOURCES, Path(self.build_lib) / "lookahead_kernels" / "csrc", dirs_exist_ok=True)


setup(
    name="lookahead",
    version="0.1.0",
    description="Lookahead decoding for Llama-family models with Triton/CUDA kernels",
    packages=["lookahead", "lookahead_kernels"],
    python_requires=">=3.10",
    install_requires=["torch>=2.4", "transformers>=4.45", "safetensors", "tqdm"],
    extras_require={"gguf": ["gguf", "accelerate"], "test": ["pytest", "hypothesis", "scipy"]},
    entry_points={"console_scripts": ["lookahead=lookahead.cli:main"]},
    cmdclass={"build_py": BuildPyWithSources},
)
