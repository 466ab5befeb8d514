"""Installs the packages ``lookahead`` and ``lookahead_kernels`` and the console script ``lookahead``.

The C++ n-gram pool in ``csrc/`` is compiled just in time (ninja, through torch.utils.cpp_extension) on
first use, so installing needs no compiler; see ``lookahead_kernels/pool_ext.py``.
"""

from setuptools import setup

setup(
    name="lookahead",
    version="0.1.0",
    description="Lookahead decoding for Llama-family models with Triton/CUDA kernels",
    packages=["lookahead", "lookahead_kernels"],
    python_requires=">=3.10",
    install_requires=["torch>=2.4", "transformers>=4.45", "safetensors", "tqdm"],
    extras_require={"gguf": ["gguf", "accelerate"], "test": ["pytest", "hypothesis", "scipy"]},
    entry_points={"console_scripts": ["lookahead=lookahead.cli:main"]},
)
