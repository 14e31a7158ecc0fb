#!/usr/bin/env bash
# What a newcomer with a GPU machine does, on a fresh copy of this checkout: the README's two
# commands (`bash run_single_gpt.sh`, then the test command), each ending in one summary line.
#
#   bash tools/gpu_check.sh [OUT]     (OUT: where the logs go; default /tmp/gpu_check)
#
# The copy holds the files git tracks or would track (the work tree as it is, uncommitted
# changes included) and the wheels in .whl/, from which prerequisite.sh installs offline
# (the GPU machines reach no package index). OUT gets run_single.log, tests.log,
# pip-freeze.txt (the versions the tests ran with) and summary.txt (the two lines).
set -uo pipefail  # not -e: both commands run, and the summary says how each ended

ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=$(realpath -m "${1:-/tmp/gpu_check}")
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1  # the GPU machines' rule

copy=$(mktemp -d /tmp/megatron-dpp-fresh.XXXXXX)
if git -C "$ROOT" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  git -C "$ROOT" ls-files -z --cached --others --exclude-standard |
    tar -C "$ROOT" --null -T - -cf - | tar -C "$copy" -xf -
else  # a copy without .git: everything but what runs and builds leave behind
  tar -C "$ROOT" --exclude=./runs --exclude=./build --exclude='*.so' --exclude=__pycache__ \
    --exclude=./.whl -cf - . | tar -C "$copy" -xf -
fi
if [ -d "$ROOT/.whl" ]; then cp -r "$ROOT/.whl" "$copy/.whl"; fi
cd "$copy" || exit 1
echo "gpu_check: a fresh copy in $copy; logs in $OUT" >&2

summary() {  # name, status, seconds, what the log's last relevant line says
  echo "$1: exit $2 in $3 s; $4" | tee -a "$OUT/summary.txt"
}
: >"$OUT/summary.txt"

started=$SECONDS
bash run_single_gpt.sh >"$OUT/run_single.log" 2>&1
status=$?
last=$(grep -E "throughput:|training failed|error:" "$OUT/run_single.log" | tail -n 1)
summary "bash run_single_gpt.sh" "$status" $(( SECONDS - started )) "${last:-no summary line}"

command=$(sed -n '/<!-- test-command -->/,/<!-- \/test-command -->/p' README.md |
  grep -v -e '^<!--' -e '^```')
started=$SECONDS
bash -c "$command" >"$OUT/tests.log" 2>&1
status=$?
last=$(grep -E "(passed|failed|error)" "$OUT/tests.log" | tail -n 1)
summary "the test command" "$status" $(( SECONDS - started )) "${last:-no pytest line}"
"$PY" -m pip freeze >"$OUT/pip-freeze.txt" 2>/dev/null
