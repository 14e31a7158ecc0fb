#!/usr/bin/env bash
# Installs what MegatronDPP needs on this machine; safe to run again (it skips what is there).
#   - torch: the CPU build where there is no GPU (a bare `pip install torch` pulls CUDA builds)
#   - rdma-core headers (Debian/Ubuntu, as root) so the native extension builds its RDMA part
#   - the project itself, editable, which builds the native extension from csrc/
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}

if ! "$PY" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    "$PY" -m pip install -q torch
  else
    "$PY" -m pip install -q "torch==2.13.0"
  fi
fi

if [ ! -e /usr/include/infiniband/verbs.h ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
      libibverbs-dev librdmacm-dev >/dev/null) ||
    echo "prerequisite.sh: could not install libibverbs-dev; the RDMA transport will not be built" >&2
fi

"$PY" -m pip install -q -r requirements.txt
"$PY" -m pip install -q --no-build-isolation --no-deps -e .
