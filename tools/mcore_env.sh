#!/usr/bin/env bash
# A virtual environment for running this checkout against one megatron-core release.
#
#   tools/mcore_env.sh VERSION|WHEEL [VENV]      e.g.  tools/mcore_env.sh 0.19.2
#
# VERSION comes from the package index, WHEEL is a local megatron_core-*.whl. The venv
# (default: ../venv-mcore-VERSION beside the checkout) gets torch, that megatron-core, the
# other packages of requirements.txt, and this project by `pip install .`, which builds the
# native extension for the venv's Python. Tests run from the checkout, so the built extension
# is also copied into its megatron/dpp/ (the file name carries the Python ABI: builds for
# several Pythons sit side by side there):
#   cd <checkout> && OMP_NUM_THREADS=1 VENV/bin/python -m pytest -q tests
# Environment:
#   PYTHON       the venv's interpreter (default python3.12; megatron-core >= 0.17 needs it)
#   TORCH_INDEX  where torch comes from, e.g. https://download.pytorch.org/whl/cpu (the CPU
#                build; the default index gives the CUDA build, which also runs on CPU)
#   NO_NATIVE=1  no native extension (the shm / RDMA tests then skip, saying why)
set -euo pipefail

if [ $# -lt 1 ]; then
  sed -n '2,17p' "$0" >&2
  exit 2
fi
ROOT=$(cd "$(dirname "$0")/.." && pwd)
if [[ "$1" == *.whl ]]; then
  MCORE=$(realpath "$1")
  VERSION=$(basename "$1" | cut -d- -f2)
else
  MCORE="megatron-core==$1"
  VERSION=$1
fi
VENV=$(realpath -m "${2:-$ROOT/../venv-mcore-$VERSION}")
PIP=("$VENV/bin/python" -m pip install -q)

[ -x "$VENV/bin/python" ] || "${PYTHON:-python3.12}" -m venv "$VENV"
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  "${PIP[@]}" ${TORCH_INDEX:+--index-url "$TORCH_INDEX"} torch
fi
grep -v -E '^\s*(#|megatron-core)' "$ROOT/requirements.txt" > "$VENV/requirements-project.txt"
"${PIP[@]}" "$MCORE" -r "$VENV/requirements-project.txt" setuptools wheel ninja

# A CUDA build of torch compiles the extension's CUDA part: point it at the toolkit (an nvcc
# wrapper elsewhere on PATH misleads its search) and, with no GPU to ask, at Hopper
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then
  export CUDA_HOME=/usr/local/cuda
fi
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
[ "${NO_NATIVE:-0}" != 1 ] || export DPP_NO_NATIVE=1
# --no-build-isolation: the extension compiles against the venv's torch
if ! (cd "$ROOT" && "${PIP[@]}" --no-build-isolation --no-deps --force-reinstall .) \
    > "$VENV/install-project.log" 2>&1; then
  echo "mcore_env.sh: pip install . failed; see $VENV/install-project.log" >&2
  exit 1
fi
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')
if [ "${NO_NATIVE:-0}" != 1 ]; then
  # a new file, not the old one overwritten: running processes may have it mapped
  cp --remove-destination "$SITE"/megatron/dpp/_native.*.so "$ROOT/megatron/dpp/"
fi

# outside the checkout, so what is imported is what was installed
(cd / && "$VENV/bin/python" -W ignore -c '
import megatron.core.package_info as core, megatron.trainer, pretrain_gpt, torch
print(f"megatron-core {core.__version__}, torch {torch.__version__}, "
      f"trainer from {megatron.trainer.__path__[0]}")')
echo "ready: cd $ROOT && OMP_NUM_THREADS=1 $VENV/bin/python -m pytest -q tests"
