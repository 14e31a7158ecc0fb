#!/usr/bin/env bash
# megatron-core 0.19.2 on a GPU machine without internet: installs
# the carried wheels and this checkout (`pip install .`, which builds the native extension),
# trains ../shared/GPU.md's GPT at PP=1 with the fast path, and runs the CPU tests that
# exercise megatron-core. Each step is bounded (training 200 s, tests 240 s) so that the
# whole ends within the device tool's 10 minutes; 8 at most is expected on one H200.
#
#   tools/gpu_mcore_check.sh OUT         (from the checkout's root; the device tool: carry .whl019)
#
# .whl019/ (git-ignored) holds megatron_core-0.19.2 and the wheels a plain torch machine lacks
# (docs/compatibility.md lists them). Everything is installed by one pip call into a --target
# folder (SITE, default /tmp/site-mcore019; one invocation, so megatron-core's and this project's
# megatron/ end up in one directory) that goes first on PYTHONPATH; the machine's own packages
# stay as they are. PYTHON: the interpreter (default python3). OUT gets flat files:
# summary.txt versions.txt install.log pp1-xent-graphs.log results.json table.txt tests.log.
set -uo pipefail  # not -e: every step runs and summary.txt says which failed

if [ $# -ne 1 ]; then
  sed -n '2,15p' "$0" >&2
  exit 2
fi
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=$(realpath -m "$1")
SITE=${SITE:-/tmp/site-mcore019}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
cd "$ROOT" || exit 1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 OMP_NUM_THREADS=1
SUMMARY=$OUT/summary.txt
: > "$SUMMARY"
step() {  # step NAME LOG COMMAND...: runs COMMAND into LOG, notes its exit status and duration
  local name=$1 log=$2 start=$SECONDS
  shift 2
  "$@" > "$log" 2>&1
  local status=$?
  echo "$name: exit $status, $((SECONDS - start)) s" >> "$SUMMARY"
  return $status
}

rm -rf "$SITE"
if ! step install "$OUT/install.log" "$PY" -m pip install --no-index --no-deps \
    --no-build-isolation --target "$SITE" .whl019/*.whl .; then
  cat "$SUMMARY"
  exit 1
fi
export PYTHONPATH=$SITE
# the tests run from the checkout (pytest puts it first on sys.path): they need the extension
# next to its sources; a new file, in case an old one is mapped by a running process
cp --remove-destination "$SITE"/megatron/dpp/_native.*.so megatron/dpp/

# outside the checkout: what is imported is what was installed
(cd /tmp && "$PY" -W ignore -c '
import platform, torch, megatron.core.package_info as core, megatron.trainer, megatron.dpp._native
print("python", platform.python_version(), "| torch", torch.__version__, "| megatron-core",
      core.__version__)
print("GPU:", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
print("megatron.trainer from", megatron.trainer.__file__)
print("native extension", megatron.dpp._native.__file__)
from megatron.trainer.core_compat import core_overrides
core_overrides.verify()
print("core_overrides.verify(): all", len(core_overrides.INTERNALS), "internals in place")
') > "$OUT/versions.txt" 2>&1
echo "versions: exit $?" >> "$SUMMARY"

# the GPT of GPU.md, 16 microbatches, 3 warm-up + 5 measured iterations, the installed trainer
# (bench_gpt's output is the run's log, table.txt and results.json; its own log is kept only
# when it fails)
step train "$OUT/train-step.log" "$PY" profiling/bench_gpt.py --installed --out "$OUT" \
  --configs pp1-xent-graphs --gpus 1 --pp 1 --microbatches 16 --warmup 3 --iters 5 \
  --timeout 200 && rm -f "$OUT/train-step.log"
cat "$OUT/table.txt" >> "$SUMMARY" 2>/dev/null

# CPU only, as CI runs them: the tests that import megatron.core (the others test the DPP
# runtime alone and do not change with megatron-core), spread over 8 workers
PARALLEL=()
"$PY" -c "import xdist" 2>/dev/null && PARALLEL=(-n 8)
CUDA_VISIBLE_DEVICES="" step tests "$OUT/tests.log" timeout 240 "$PY" -m pytest -q \
  "${PARALLEL[@]}" tests/trainer/core_compat/test_core_overrides.py tests/trainer/data/test_batch_schedule.py \
  tests/trainer/core_compat/test_no_apex.py tests/trainer/kernels/test_fusions.py tests/trainer/model/test_models.py tests/trainer/config/test_arguments.py \
  tests/design/test_imports.py tests/trainer/run/test_training.py tests/trainer/checkpoint/test_checkpointing.py \
  tests/dpp/test_weight_grad.py tests/dpp/test_dpp_equivalence.py tests/trainer/data/test_tokenizer.py
tail -n 1 "$OUT/tests.log" >> "$SUMMARY"
cat "$SUMMARY"
