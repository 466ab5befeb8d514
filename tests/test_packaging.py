"""A built package carries the C++ sources its extensions are compiled from on first use."""

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_a_built_package_carries_the_cpp_sources_and_finds_them(tmp_path):
    """``setup.py``'s ``build_py`` copies ``csrc/`` into ``lookahead_kernels/csrc`` (a wheel or a plain ``pip install
    .`` is made from that build), and ``source_dir()`` there finds them: before, an installed package had no sources,
    every C++ op fell back to its Python or oneDNN path, and SmolLM2 decoded about 5x slower."""
    from lookahead_kernels import cpu_ops, pool_ext

    subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(tmp_path)], cwd=ROOT,
                   check=True, capture_output=True)
    built = tmp_path / "lookahead_kernels" / "csrc"
    wanted = set(cpu_ops._SOURCES) | set(cpu_ops._HEADERS) | {"ngram_pool.cpp", "ngram_pool.h"}
    assert wanted <= {p.name for p in built.iterdir()}
    assert all((built / name).read_bytes() == (ROOT / "csrc" / name).read_bytes() for name in wanted)
    spec = importlib.util.spec_from_file_location("built_build_lock", tmp_path / "lookahead_kernels" / "build_lock.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.source_dir() == built
    # In this checkout (no lookahead_kernels/csrc): the checkout's csrc/
    assert cpu_ops._CSRC == pool_ext._CSRC == ROOT / "csrc"
