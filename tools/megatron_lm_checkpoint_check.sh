#!/usr/bin/env bash
# torch_dist checkpoints between Megatron-LM's own trainer and ours on 2 GPUs
# (docs/megatron_lm.md): runs profiling/megatron_lm_checkpoint_check.py (Megatron-LM saves at N/2,
# Megatron-LM and ours resume from it; ours saves, ours and Megatron-LM resume; the resumed
# losses of each pair within 1e-5 relative). Six torchrun runs of a small model, each
# stopped after 150 s (--timeout); not timed on a GPU yet.
#
#   bash prerequisite.sh && tools/megatron_lm_checkpoint_check.sh OUT
#                                   (from the checkout's root; the device tool: carry .megatron-lm)
#
# What runs is what `bash prerequisite.sh` installed (the megatron-core 0.19.2 wheel of .whl/
# and this checkout, editable); SITE=/tmp/site-mcore019 runs what
# tools/megatron_lm_plugin_check.sh installed there instead. .megatron-lm/ (git-ignored):
# Megatron-LM's pretrain_gpt.py, gpt_builders.py and model_provider.py at core_r0.19.0, as
# tools/megatron_lm_plugin_check.sh's header says. EXTRA: flags added to every run;
# PYTHON (default python3). Exit status 1 where a check fails; OUT/summary.txt says which.
set -uo pipefail

if [ $# -lt 1 ]; then
  sed -n '2,16p' "$0" >&2
  exit 2
fi
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=$(realpath -m "$1")
PY=${PYTHON:-python3}
if [ ! -f "$ROOT/.megatron-lm/pretrain_gpt.py" ]; then
  echo "$ROOT/.megatron-lm/pretrain_gpt.py is missing (see tools/megatron_lm_plugin_check.sh)" >&2
  exit 2
fi
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 OMP_NUM_THREADS=1
if [ -n "${SITE:-}" ]; then
  export PYTHONPATH=$SITE
fi
cd /tmp || exit 1  # outside the checkout: what runs is what was installed
"$PY" "$ROOT/profiling/megatron_lm_checkpoint_check.py" --megatron-lm "$ROOT/.megatron-lm" \
  --out "$OUT" ${EXTRA:+--extra "$EXTRA"}
