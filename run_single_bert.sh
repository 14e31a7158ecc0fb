#!/usr/bin/env bash
# Train BERT on this machine: PP=2 over its GPUs, or over 2 CPU processes without GPUs.
# Settings come from environment variables (listed with their defaults in
# examples/launch_common.sh and docs/launching.md); extra arguments are passed to
# pretrain_bert.py after the scripts' own flags. Outputs go to RUN_DIR (runs/bert-single).
#   bash run_single_bert.sh                       # small model on CPU, the seeds' size on GPUs
#   USE_DPP=0 TRAIN_ITERS=100 bash run_single_bert.sh   # megatron-core's schedule
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/examples/launch_common.sh"
dpp_launch bert single "$@"
