"""Test configuration. The only place that asks whether a GPU is present.

Without CUDA, Triton kernels run under Triton's interpreter on CPU tensors; ``TRITON_INTERPRET`` must be set
before any kernel is defined, which is why it is set here, before test modules import the kernels.
"""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # Triton 3.6's interpreter breaks under NumPy >= 2.4 on loops with run-time bounds; compiled code is unaffected.
    from lookahead_kernels.interpreter_compat import patch_interpreter_index

    patch_interpreter_index()


@pytest.fixture(scope="session")
def kernel_device() -> str:
    """Where Triton kernels run: ``cuda`` on a GPU, else ``cpu`` under the interpreter."""
    return "cuda" if HAS_CUDA else "cpu"


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", "slow: long-running end-to-end test")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
