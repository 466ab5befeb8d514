"""Running the CPU ops (our GEMM and the step attention) as a narrower instruction set than the CPU's, so that
every build of them is tested on whichever machine runs the tests."""

import contextlib

import pytest
import torch


@contextlib.contextmanager
def forced_isa(isa: str):
    """Within the block the CPU ops run as ``isa`` ("avx512", "avx2" or "scalar"); skips the test where the CPU
    lacks it. The ops must be loaded."""
    ops = torch.ops.lookahead_gemm
    ops.force_isa("")
    cpu = ops.isa()
    if isa == "avx512" and cpu != "avx512" or isa == "avx2" and cpu == "scalar":
        pytest.skip(f"this CPU runs {cpu}")
    ops.force_isa("" if isa == "avx512" else isa)
    assert ops.isa() == isa
    try:
        yield
    finally:
        ops.force_isa("")


@contextlib.contextmanager
def forced_chunked_rows(rows: int):
    """Within the block a quantised weight's blocks are read by steps of up to ``rows`` rows (in chunks past the
    kernels' own limit; 0: never past it), whatever this CPU would choose. The ops must be loaded."""
    ops = torch.ops.lookahead_gemm
    ops.force_chunked_rows(rows)
    try:
        yield
    finally:
        ops.force_chunked_rows(-1)
