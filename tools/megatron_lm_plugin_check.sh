#!/usr/bin/env bash
# Megatron-LM's own trainer with the DPP plugin on a machine of 2 (or 4) GPUs
# (docs/megatron_lm.md): installs the carried wheels and this checkout, then runs
# profiling/megatron_lm_plugin_check.py (Megatron-LM's pretrain_gpt.py with the plugin's
# two-line change at PP=2: fp32 losses of 1F1B, --use-dpp and --use-dpp --dpp-split-backward;
# bf16 tokens/s of 1F1B and DPP in Megatron-LM's trainer and in ours).
#
#   tools/megatron_lm_plugin_check.sh OUT [PP] [GPUS]   (from the checkout's root; the device
#                                                       tool: carry .whl019 and .megatron-lm)
#
# .whl019/ (git-ignored): megatron_core-0.19.2 and the wheels docs/compatibility.md lists.
# .megatron-lm/ (git-ignored): Megatron-LM's pretrain_gpt.py, gpt_builders.py and
# model_provider.py at core_r0.19.0 (its megatron/training is the 0.19.2 wheel's), made with
#   mkdir -p .megatron-lm && git --git-dir /work/.mirror/NVIDIA+Megatron-LM/repo archive \
#     core_r0.19.0 pretrain_gpt.py gpt_builders.py model_provider.py | tar -x -C .megatron-lm
# SITE (default /tmp/site-mcore019): the pip --target folder; PYTHON (default python3).
# INSTALL=0: no install; what `bash prerequisite.sh` installed runs (its megatron-core wheel
# from .whl/ and this checkout, editable), which saves about a minute of a GPU call.
# RUNS: a comma-separated subset of the check's runs (default: all seven); EXTRA: flags added
# to every run (e.g. what a Megatron-LM release's validate_args asks for); REPEATS: passes over
# the bf16 runs, every other one reversed, each trainer's ratio their median (default 1);
# RESUME=1: the runs OUT already has a complete log of are read, not run again.
# Checkpoints between Megatron-LM's trainer and ours:
# tools/megatron_lm_checkpoint_check.sh OUT, after `bash prerequisite.sh`.
set -uo pipefail

if [ $# -lt 1 ]; then
  sed -n '2,24p' "$0" >&2
  exit 2
fi
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=$(realpath -m "$1")
PP=${2:-2}
GPUS=${3:-$PP}
SITE=${SITE:-/tmp/site-mcore019}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
cd "$ROOT" || exit 1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 OMP_NUM_THREADS=1

# what runs is this checkout as installed (about a minute: the native extension is built)
if [ "${INSTALL:-1}" != 0 ]; then
  rm -rf "$SITE"
  if ! "$PY" -m pip install --no-index --no-deps --no-build-isolation --target "$SITE" \
      .whl019/*.whl . > "$OUT/install.log" 2>&1; then
    echo "install failed: $OUT/install.log" >&2
    exit 1
  fi
  export PYTHONPATH=$SITE
fi
cd /tmp || exit 1  # outside the checkout: what runs is what was installed
"$PY" "$ROOT/profiling/megatron_lm_plugin_check.py" --megatron-lm "$ROOT/.megatron-lm" \
  --out "$OUT" --pp "$PP" --gpus "$GPUS" ${RUNS:+--runs "$RUNS"} ${EXTRA:+"--extra=$EXTRA"} \
  ${REPEATS:+--repeats "$REPEATS"} ${RESUME:+--resume}
