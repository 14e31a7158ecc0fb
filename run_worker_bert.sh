#!/usr/bin/env bash
# A worker node of a multi-node BERT run started by run_master_bert.sh.
# Settings come from environment variables (listed with their defaults in
# examples/launch_common.sh and docs/launching.md); extra arguments are passed to
# pretrain_bert.py after the scripts' own flags. Outputs go to RUN_DIR (runs/bert-worker).
#   NODE_IPS="10.0.0.1 10.0.0.2" bash run_worker_bert.sh   # NODE_RANK found from NODE_IPS
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/examples/launch_common.sh"
dpp_launch bert worker "$@"
