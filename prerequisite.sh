#!/usr/bin/env bash
# Installs what MegatronDPP needs on this machine; safe to run again (it skips what is there).
#   - torch: the CPU build where there is no GPU (a bare `pip install torch` pulls CUDA builds)
#   - rdma-core headers (Debian/Ubuntu, as root) so the native extension builds its RDMA part
#   - the project itself, editable, which builds the native extension from csrc/
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}

say() { echo "prerequisite.sh: $*" >&2; }

if ! "$PY" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    say "installing torch (a CUDA build: this machine has a GPU; a few GB)"
    "$PY" -m pip install -q torch
  else
    say "installing torch 2.13.0, the CPU build (about 200 MB)"
    "$PY" -m pip install -q "torch==2.13.0"
  fi
fi

if [ ! -e /usr/include/infiniband/verbs.h ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  say "installing the rdma-core headers (apt-get) for the RDMA transport"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
      libibverbs-dev librdmacm-dev >/dev/null) ||
    echo "prerequisite.sh: could not install libibverbs-dev; the RDMA transport will not be built" >&2
fi

# Each requirement at the version constraints.txt pins for this Python (the one the tests
# passed with), where it pins one; a different installed version is replaced.
# Offline: only what is missing is installed, and only from a .whl/ folder in this checkout
# when there is one: with everything installed, no network is needed at all. PIP_FIND_LINKS
# (pip reads it itself) adds local wheels without turning the package index off: machines
# set it to a shared wheel folder that need not hold every requirement.
missing=$("$PY" - requirements.txt constraints.txt <<'PYEOF'
import importlib.metadata as metadata
import sys

try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name


def requirements(path):
    """The file's requirements that apply to this Python (markers evaluated)."""
    for line in open(path):
        line = line.split("#")[0].strip()
        if line:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate():
                yield requirement


pins = {canonicalize_name(pin.name): pin.specifier for pin in requirements(sys.argv[2])}
for requirement in requirements(sys.argv[1]):
    specifier = requirement.specifier & pins.get(canonicalize_name(requirement.name), "")
    wanted = f"{requirement.name}{specifier}"  # one word, for pip's command line
    try:
        installed = metadata.version(requirement.name)
    except metadata.PackageNotFoundError:
        print(wanted)
        continue
    if not specifier.contains(installed, prereleases=True):
        print(wanted)
PYEOF
)
pip_local=()
if [ -d .whl ]; then
  pip_local=(--find-links .whl --no-index)
fi
if [ -n "$missing" ]; then
  say "installing" $missing
  # shellcheck disable=SC2086  # one requirement per word
  "$PY" -m pip install -q "${pip_local[@]}" -c constraints.txt $missing ||
    { echo "prerequisite.sh: could not install" $missing "(pip says why above; offline, put" \
        "their wheels in .whl/ with those of their dependencies this machine lacks)" >&2; exit 1; }
fi
# (re)build the native extensions when missing or older than their sources; on a GPU machine
# the cuBLASLt GEMMs (csrc/gemm) as well
native_stale() {
  local built
  built=$(ls megatron/dpp/_native*.so 2>/dev/null | head -n 1)
  [ -z "$built" ] && return 0
  [ -n "$(find csrc setup.py -newer "$built" -print -quit)" ] && return 0
  # built before the verbs headers were installed: the RDMA part is missing
  [ -e /usr/include/infiniband/verbs.h ] && ! "$PY" -c "from megatron.dpp.transport import native
import sys; sys.exit(not native.build_info()['rdma'])" 2>/dev/null && return 0
  command -v nvidia-smi >/dev/null 2>&1 && [ -z "$(ls megatron/trainer/kernels/_gemm_epilogues*.so 2>/dev/null)" ]
}
# the editable install must point at this checkout (one made from another clone, or before
# this one moved, would run that code wherever the checkout is not the working directory)
installed_elsewhere() {
  local here found
  here=$(pwd -P)
  found=$(cd / && "$PY" -c "import megatron.dpp, os; print(os.path.realpath(megatron.dpp.__path__[0]))" 2>/dev/null)
  [ "$found" != "$here/megatron/dpp" ]
}
if ! "$PY" -c "import importlib.metadata as m; m.version('megatron-dpp')" 2>/dev/null || native_stale \
    || installed_elsewhere; then
  say "building the native extensions and installing this checkout (pip install -e .)"
  "$PY" -m pip install -q --no-build-isolation --no-deps -e .
fi
