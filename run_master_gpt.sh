#!/usr/bin/env bash
# Node 0 of a multi-node GPT run; prints the command each worker must run.
# Settings come from environment variables (listed with their defaults in
# examples/launch_common.sh and docs/launching.md); extra arguments are passed to
# pretrain_gpt.py after the scripts' own flags. Outputs go to RUN_DIR (runs/gpt-master).
#   NODE_IPS="10.0.0.1 10.0.0.2" bash run_master_gpt.sh
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/examples/launch_common.sh"
dpp_launch gpt master "$@"
