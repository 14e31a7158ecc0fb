#!/usr/bin/env bash
# A virtual environment with a given megatron-core release, to run this checkout's tests and
# CPU training runs against it (CI itself runs the version pinned in requirements.txt).
#
#   tools/mcore_env.sh VERSION|WHEEL [VENV]       e.g.  tools/mcore_env.sh 0.19.2
#
# VERSION is a megatron-core release on the package index, or the path of its wheel.
# VENV defaults to ../venv-mcore-VERSION (outside the checkout). Environment:
#   PYTHON       interpreter for the venv (default: python3.12; megatron-core >= 0.17 needs
#                Python >= 3.12, 0.16 runs on 3.10+)
#   TORCH_SPEC   torch requirement (default torch==2.13.0, the version CI uses; from the
#                default index that is the CUDA build, which also runs on CPU: ~4.7 GB venv)
#   TORCH_INDEX  extra index for torch, e.g. https://download.pytorch.org/whl/cpu
#   NO_NATIVE=1  skip the native extension (the shm / RDMA tests then skip, saying why)
#
# The project is not pip-installed into the venv: since 0.17 the megatron-core wheel ships
# Megatron-LM's own `megatron/trainer` package, which has this project's package name.
# Run from the checkout's root, where `megatron/trainer` is found first:
#   cd <checkout> && OMP_NUM_THREADS=1 VENV/bin/python -m pytest -q tests
#   cd <checkout> && OMP_NUM_THREADS=1 VENV/bin/torchrun --nproc_per_node 2 pretrain_gpt.py ...
# The native extension is built in VENV/native-build and its .so (named for this Python's
# ABI, so it sits beside other interpreters' builds) copied into megatron/dpp/.
set -euo pipefail

if [ $# -lt 1 ]; then
  sed -n '2,22p' "$0" >&2
  exit 2
fi
SPEC=$1
ROOT=$(cd "$(dirname "$0")/.." && pwd)
if [[ "$SPEC" == *.whl ]]; then
  MCORE="$(cd "$(dirname "$SPEC")" && pwd)/$(basename "$SPEC")"
  VERSION=$(basename "$SPEC" | cut -d- -f2)
else
  MCORE="megatron-core==$SPEC"
  VERSION=$SPEC
fi
VENV=${2:-$ROOT/../venv-mcore-$VERSION}
PY=${PYTHON:-python3.12}

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install -q)
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  "${PIP[@]}" ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"} "${TORCH_SPEC:-torch==2.13.0}"
fi
"${PIP[@]}" "$MCORE"
grep -v -E '^\s*(#|megatron-core)' "$ROOT/requirements.txt" > "$VENV/requirements-project.txt"
"${PIP[@]}" -r "$VENV/requirements-project.txt"

if [ "${NO_NATIVE:-0}" != 1 ]; then
  # a torch built for CUDA compiles the extension's CUDA part: it needs the toolkit's
  # root (an nvcc wrapper script elsewhere on PATH misleads torch's search) and, without
  # a GPU to ask, the architectures (Hopper, the GPU machines')
  if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then
    export CUDA_HOME=/usr/local/cuda
  fi
  export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
  mkdir -p "$VENV/native-build"
  if ! (cd "$ROOT" && "$VENV/bin/python" setup.py build_ext \
      --build-temp "$VENV/native-build/tmp" --build-lib "$VENV/native-build/lib") \
      > "$VENV/native-build/build.log" 2>&1; then
    echo "mcore_env.sh: building the native extension failed; see $VENV/native-build/build.log" >&2
    exit 1
  fi
  cp "$VENV"/native-build/lib/megatron/dpp/_native.*.so "$ROOT/megatron/dpp/"
fi

(cd "$ROOT" && "$VENV/bin/python" -W ignore - 2>/dev/null <<'EOF'
import megatron.core.package_info as info
import megatron.trainer
import torch
print(f"megatron-core {info.__version__}, torch {torch.__version__}; "
      f"megatron.trainer from {megatron.trainer.__file__}")
EOF
)
echo "ready: cd $ROOT && OMP_NUM_THREADS=1 $VENV/bin/python -m pytest -q tests"
