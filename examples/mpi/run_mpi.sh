#!/usr/bin/env bash
# MegatronDPP under mpiexec (e.g. ALCF Polaris with PBS and Cray PALS, or OpenMPI/MPICH):
# one MPI rank per GPU; each rank maps its MPI variables (PALS_*, PMI_*, OMPI_COMM_WORLD_*,
# SLURM_*) to torch.distributed's RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE with
# `python -m megatron.trainer.launch mpi-exec` and runs the trainer; no torchrun needed.
#   qsub -l select=2 ... -- bash examples/mpi/run_mpi.sh gpt [extra trainer flags]
#   MPIEXEC_PPN_FLAG=-npernode bash examples/mpi/run_mpi.sh gpt      # OpenMPI
# Settings: those of the run scripts (docs/launching.md), plus
#   HOSTFILE          nodes, one per line: $PBS_NODEFILE, else this host only
#   MPIEXEC           mpiexec;  MPIEXEC_PPN_FLAG  --ppn (MPICH, PALS); OpenMPI: -npernode
#   MPIEXEC_ARGS      extra mpiexec arguments (e.g. "--cpu-bind depth -d 16" on Polaris)
#   MASTER_ADDR       the first node's address;  MASTER_PORT  29500
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../launch_common.sh"

MODEL=${1:-gpt}
shift || true
DPP_MODEL=$MODEL DPP_ROLE=mpi DPP_SCRIPT=run_mpi.sh
DPP_EXTRA=("$@")
case $MODEL in
    gpt) source "$DPP_REPO/examples/gpt3/settings.sh" ;;
    bert) source "$DPP_REPO/examples/bert/settings.sh" ;;
    *) dpp_die "model '$MODEL': expected gpt or bert" ;;
esac
PYTHON=${PYTHON:-python3}
dpp_prerequisites

hostfile=${HOSTFILE:-${PBS_NODEFILE:-}}
if [[ -n $hostfile ]]; then
    mapfile -t hosts < <(awk '!seen[$1]++ {print $1}' "$hostfile")
else
    hosts=("$(hostname)")
fi
ips=()
for host in "${hosts[@]}"; do
    ip=$(getent ahostsv4 "$host" | awk 'NR == 1 {print $1}')
    [[ -n $ip ]] || dpp_die "cannot resolve node $host (from ${hostfile:-hostname}) to an address"
    ips+=("$ip")
done
NNODES=${#ips[@]}
gpus=$(dpp_count_gpus)
GPUS_PER_NODE=${GPUS_PER_NODE:-$(( gpus > 0 ? gpus : 2 ))}
if (( gpus == 0 )); then export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}; fi
dpp_run_dir
dpp_train_flags "$(( gpus > 0 ))" $(( NNODES * GPUS_PER_NODE ))
node_flags=()
if (( NNODES > 1 )); then node_flags=(--multi-node --node-ips "${ips[@]}"); fi

cmd=(${MPIEXEC:-mpiexec} -n $(( NNODES * GPUS_PER_NODE )) "${MPIEXEC_PPN_FLAG:---ppn}" "$GPUS_PER_NODE")
if [[ -n $hostfile ]]; then cmd+=(--hostfile "$hostfile"); fi
# shellcheck disable=SC2206  # MPIEXEC_ARGS is a list of words
cmd+=(${MPIEXEC_ARGS:-}
      env MASTER_ADDR="${MASTER_ADDR:-${ips[0]}}" MASTER_PORT="${MASTER_PORT:-29500}"
      GPUS_PER_NODE="$GPUS_PER_NODE" PYTHONPATH="$DPP_REPO${PYTHONPATH:+:$PYTHONPATH}"
      "$PYTHON" -m megatron.trainer.launch mpi-exec --
      "$PYTHON" "$DPP_REPO/$MODEL_ENTRY" "${TRAIN_FLAGS[@]}" "${node_flags[@]}" "$@")
printf '%q ' "${cmd[@]}" >"$RUN_DIR/command.txt"
dpp_say_outputs "$RUN_DIR/train.log"
dpp_say "running: $(cat "$RUN_DIR/command.txt")"
"${cmd[@]}" 2>&1 | tee "$RUN_DIR/train.log"
PYTHONPATH=$DPP_REPO "$PYTHON" -m megatron.trainer.launch summarize "$RUN_DIR/train.log"
