# Shared body of run_{single,master,worker}_{gpt,bert}.sh; see docs/launching.md.
# Usage (from those scripts): source examples/launch_common.sh; dpp_launch MODEL ROLE "$@"
# MODEL is gpt or bert, ROLE single, master or worker; "$@" are extra trainer flags, appended
# last (a repeated flag overrides the scripts' value).
#
# Settings, from the environment (CPU default / GPU default):
#   GPUS_PER_NODE   processes per node: the GPUs present; without GPUs 2 CPU processes
#                   (single) or 1 per node (master/worker)
#   TP, PP, VPP     tensor / pipeline parallel size, model chunks per stage: 1, 2 (1 where
#                   there is one process per TP group, e.g. one GPU), unset
#   NODE_IPS        master/worker: one address per node, in node-rank order (required)
#   NNODES          number of nodes: 1 (single) or the count of NODE_IPS
#   NODE_RANK       0 on the master; a worker finds its own from NODE_IPS
#   MASTER_ADDR     127.0.0.1 (single) or the first of NODE_IPS
#   MASTER_PORT     a free port (single) or 29500
#   RDZV_TIMEOUT    seconds nodes wait for each other at start-up: 300
#   CHECK_LOCAL_ADDRESS  0 skips the check that NODE_IPS[NODE_RANK] is this machine's (NAT)
#   MODEL_SIZE      a preset of examples/<model>/settings.sh: tiny / seed
#   NUM_LAYERS, HIDDEN_SIZE, NUM_HEADS, SEQ_LENGTH   override the preset
#   MICRO_BATCH     2 / 2 (GPT) or 8 (BERT)
#   NUM_MICROBATCHES  per iteration and data-parallel rank: 4 / 16
#   GLOBAL_BATCH    MICRO_BATCH x data-parallel size x NUM_MICROBATCHES
#   TRAIN_ITERS     30 / 50;  LR 1e-3 / 3e-4;  LOG_INTERVAL 5 / 10;  EVAL_ITERS 1 / 10
#   EVAL_INTERVAL   TRAIN_ITERS (one evaluation at the end)
#   PRECISION       fp32 / bf16 (also fp16)
#   DATA_PATH       the sample data (prepared on first use), a --data-path prefix, or "mock"
#   TOKENIZER_TYPE, VOCAB_FILE, MERGE_FILE, TOKENIZER_MODEL   the sample's; for a prefix, the
#                   tokenizer recorded beside it (<prefix>.tokenizer.json, written by
#                   tools/preprocess_data.py); VOCAB_SIZE (mock data) 1024
#   USE_DPP         1: dynamic pipeline schedule (--use-dpp); 0: megatron-core's schedule
#                   (the default with one pipeline stage, where DPP has nothing to schedule)
#   DPP_TRANSPORT   auto (torch, shm); DPP_MAX_INFLIGHT unset (the schedule's default)
#   CHECKPOINT_DIR  unset: no checkpoints; else --save/--load there, every SAVE_INTERVAL
#   RUN_NAME        <model>-<role>;  RUN_DIR <checkout>/runs/RUN_NAME/<N>, N numbering the runs
#                   (runs/RUN_NAME/latest: the last); log: RUN_DIR/train.log, kept as
#                   train.log.<k> when a later run is given the same RUN_DIR
#   STOP_GRACE      seconds torchrun gives its ranks, once it passed a stop signal on, to end
#                   the step and save before it kills them: 120 (torch 2.12 and later; older
#                   torchruns wait 30 whatever it says)
#   PYTHON          python3;  SKIP_PREREQ  auto: run prerequisite.sh when imports fail, 1 never,
#                   0 always

DPP_REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

# settings a worker must share with the master; the master repeats the ones set explicitly
DPP_SHARED_SETTINGS="GPUS_PER_NODE TP PP VPP RDZV_TIMEOUT MODEL_SIZE NUM_LAYERS HIDDEN_SIZE
NUM_HEADS SEQ_LENGTH MICRO_BATCH NUM_MICROBATCHES GLOBAL_BATCH TRAIN_ITERS LR LOG_INTERVAL
EVAL_ITERS EVAL_INTERVAL PRECISION DATA_PATH TOKENIZER_TYPE VOCAB_FILE MERGE_FILE VOCAB_SIZE
TOKENIZER_MODEL USE_DPP DPP_TRANSPORT DPP_MAX_INFLIGHT CHECKPOINT_DIR SAVE_INTERVAL SKIP_PREREQ PYTHON"

dpp_say() { echo "[$DPP_SCRIPT] $*" >&2; }
dpp_die() { dpp_say "error: $*"; exit 2; }

dpp_prerequisites() {
    local mode=${SKIP_PREREQ:-auto}
    if [[ $mode == 1 ]]; then return; fi
    if [[ $mode == auto ]] && "$PYTHON" -c "import importlib.metadata as m, torch, megatron.core
m.version('megatron-dpp')" 2>/dev/null; then
        return
    fi
    dpp_say "installing prerequisites (bash prerequisite.sh; SKIP_PREREQ=1 skips)"
    PYTHON=$PYTHON bash "$DPP_REPO/prerequisite.sh"
}

dpp_count_gpus() {
    "$PYTHON" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0
}

# the flags of the data: sample data (prepared once), a prefix, or mock data
dpp_data_flags() {
    local path=${DATA_PATH:-sample} split_flags=()
    if [[ $path == mock ]]; then
        DATA_FLAGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size "${VOCAB_SIZE:-1024}")
        return
    fi
    if [[ $path == sample ]]; then
        path=$DPP_REPO/$SAMPLE_PREFIX
        if [[ ! -f $path.idx ]]; then
            dpp_say "preparing the sample data into $SAMPLE_DIR/ (first use)"
            # master and worker may share a checkout (network namespaces): prepare once
            PYTHON=$PYTHON flock "${TMPDIR:-/tmp}/megatron-dpp-$SAMPLE_DIR.lock" \
                bash "$DPP_REPO/$SAMPLE_DIR/prepare.sh"
        fi
        : "${TOKENIZER_TYPE:=$SAMPLE_TOKENIZER}" "${VOCAB_FILE:=$DPP_REPO/$SAMPLE_VOCAB}"
        if ! dpp_extra_has --split; then split_flags=(--split "$SAMPLE_SPLIT"); fi
        if [[ -n $SAMPLE_MERGES ]]; then : "${MERGE_FILE:=$DPP_REPO/$SAMPLE_MERGES}"; fi
    elif [[ ! -f $path.idx ]]; then
        dpp_die "DATA_PATH=$path: $path.idx not found (give the prefix that tools/preprocess_data.py wrote, 'sample' or 'mock')"
    elif [[ -z ${TOKENIZER_TYPE:-} ]] && ! dpp_extra_has --tokenizer-type; then
        dpp_data_tokenizer "$path"
    fi
    # the dataset index cache goes to the runs' directory, not next to the data
    DATA_FLAGS=(--data-path "$path" --data-cache-path "$DATA_CACHE" "${split_flags[@]}")
    if [[ -n ${TOKENIZER_TYPE:-} ]]; then DATA_FLAGS+=(--tokenizer-type "$TOKENIZER_TYPE"); fi
    if [[ -n ${VOCAB_FILE:-} ]]; then DATA_FLAGS+=(--vocab-file "$VOCAB_FILE"); fi
    if [[ -n ${MERGE_FILE:-} ]]; then DATA_FLAGS+=(--merge-file "$MERGE_FILE"); fi
    if [[ -n ${TOKENIZER_MODEL:-} ]]; then DATA_FLAGS+=(--tokenizer-model "$TOKENIZER_MODEL"); fi
    if [[ ${TOKENIZER_TYPE:-} == NullTokenizer ]]; then
        DATA_FLAGS+=(--vocab-size "${VOCAB_SIZE:-1024}")
    fi
}

# the tokenizer settings of a user's data from the record tools/preprocess_data.py wrote
# beside it: the sample's files where the data was made with them
dpp_data_tokenizer() {
    local exports
    exports=$(PYTHONPATH="$DPP_REPO${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m \
        megatron.trainer.launch tokenizer --prefix "$1" \
        --sample-vocab-file "$DPP_REPO/$SAMPLE_VOCAB" \
        ${SAMPLE_MERGES:+--sample-merge-file "$DPP_REPO/$SAMPLE_MERGES"} 2>&1) ||
        dpp_die "${exports#*error: }"
    eval "$exports"
    dpp_say "tokenizer: $TOKENIZER_TYPE${VOCAB_FILE:+ $VOCAB_FILE}${MERGE_FILE:+ $MERGE_FILE}${TOKENIZER_MODEL:+ $TOKENIZER_MODEL} (recorded in $1.tokenizer.json)"
}

# whether the extra trainer arguments hold flag $1; dpp_extra_value prints its value
dpp_extra_has() {
    local word
    for word in "${DPP_EXTRA[@]}"; do
        if [[ $word == "$1" || $word == "$1="* ]]; then return 0; fi
    done
    return 1
}

dpp_extra_value() {
    local i
    for (( i = 0; i < ${#DPP_EXTRA[@]}; i++ )); do
        case ${DPP_EXTRA[i]} in
            "$1") echo "${DPP_EXTRA[i + 1]:-}"; return ;;
            "$1="*) echo "${DPP_EXTRA[i]#*=}"; return ;;
        esac
    done
}

# this run's directory: RUN_DIR as given, else the next free runs/RUN_NAME/<N>; the dataset
# index cache is shared by the runs of a name
dpp_run_dir() {
    if [[ -n ${RUN_DIR:-} ]]; then
        mkdir -p "$RUN_DIR"
        DATA_CACHE=$RUN_DIR/data_cache
        return
    fi
    local root=$DPP_REPO/runs/${RUN_NAME:-$DPP_MODEL-$DPP_ROLE} n=1
    mkdir -p "$root" || dpp_die "cannot create the run directory $root"
    while [[ -e $root/$n ]] || ! mkdir "$root/$n" 2>/dev/null; do
        [[ -w $root ]] || dpp_die "cannot create a run directory in $root"
        n=$(( n + 1 ))
    done
    ln -sfn "$n" "$root/latest"
    RUN_DIR=$root/$n
    DATA_CACHE=$root/data_cache
}

# the first lines of a run: where its log, checkpoints and traces go
dpp_say_outputs() {
    local logfile=$1 save trace_dir
    dpp_say "log: $logfile"
    save=$(dpp_extra_value --save)
    if [[ -n $save ]]; then
        dpp_say "checkpoints: $save (--save)"
    elif [[ -n ${CHECKPOINT_DIR:-} ]]; then
        dpp_say "checkpoints: $CHECKPOINT_DIR (${SAVE_INTERVAL:+every $SAVE_INTERVAL iterations and }at the end; a run resumes from the latest)"
    else
        dpp_say "no checkpoints: set CHECKPOINT_DIR (and SAVE_INTERVAL) to save them"
    fi
    if dpp_extra_has --trace; then
        trace_dir=$(dpp_extra_value --trace-dir)
        dpp_say "traces: ${trace_dir:-$RUN_DIR/traces}/trace-rank<R>.jsonl (docs/profiling.md)"
    else
        dpp_say "no traces: pass --trace to record the pipeline's spans"
    fi
}

dpp_model_flags() {
    local size=${MODEL_SIZE:-$1} preset layers hidden heads seq
    preset=$(model_preset "$size") || dpp_die "MODEL_SIZE=$size: unknown; one of: $MODEL_PRESETS"
    read -r layers hidden heads seq <<<"$preset"
    MODEL_FLAGS=(--num-layers "${NUM_LAYERS:-$layers}" --hidden-size "${HIDDEN_SIZE:-$hidden}"
                 --num-attention-heads "${NUM_HEADS:-$heads}" --seq-length "${SEQ_LENGTH:-$seq}"
                 --max-position-embeddings "${SEQ_LENGTH:-$seq}")
}

dpp_integer() {
    [[ ${!1} =~ ^[0-9]+$ ]] || dpp_die "$1=${!1} is not a whole number"
}

# trainer flags from the settings; sets TRAIN_FLAGS
dpp_train_flags() {
    local on_gpu=$1 world=$2
    local tp=${TP:-1} pp=${PP:-2} use_dpp=${USE_DPP:-1}
    dpp_integer tp
    if [[ -z ${PP:-} ]] && (( world < 2 * tp )); then
        pp=1  # one process per tensor-parallel group (one GPU, say): no pipeline
    fi
    dpp_integer pp
    (( world % (tp * pp) == 0 )) ||
        dpp_die "TP=$tp x PP=$pp does not divide the $world processes (NNODES x GPUS_PER_NODE)"
    if (( pp == 1 )); then
        local cpu_hint="CPU processes: CUDA_VISIBLE_DEVICES= bash $DPP_SCRIPT"
        if [[ -n ${USE_DPP:-} && $USE_DPP == 1 ]]; then
            dpp_die "USE_DPP=1 needs PP >= 2 pipeline stages, and $world process(es) give one; use two or more GPUs, or $cpu_hint"
        fi
        use_dpp=0
        dpp_say "one pipeline stage on $world process(es): megatron-core's schedule; the dynamic schedule (USE_DPP=1) needs two or more stages: use two or more GPUs, or $cpu_hint"
    fi
    DPP_SCHEDULE=$([[ $use_dpp == 1 ]] && echo DPP || echo megatron-core)
    local dp=$(( world / (tp * pp) ))
    local micro=${MICRO_BATCH:-$([[ $on_gpu == 1 ]] && echo "$GPU_MICRO_BATCH" || echo 2)}
    local count=${NUM_MICROBATCHES:-$([[ $on_gpu == 1 ]] && echo 16 || echo 4)}
    local iters=${TRAIN_ITERS:-$([[ $on_gpu == 1 ]] && echo 50 || echo 30)}
    dpp_integer micro; dpp_integer count; dpp_integer iters
    dpp_model_flags "$([[ $on_gpu == 1 ]] && echo seed || echo tiny)"
    dpp_data_flags
    TRAIN_FLAGS=("${MODEL_FLAGS[@]}" "${DATA_FLAGS[@]}"
        --tensor-model-parallel-size "$tp" --pipeline-model-parallel-size "$pp"
        --micro-batch-size "$micro" --global-batch-size "${GLOBAL_BATCH:-$(( micro * dp * count ))}"
        --train-iters "$iters" --lr "${LR:-$([[ $on_gpu == 1 ]] && echo 3e-4 || echo 1e-3)}"
        --log-interval "${LOG_INTERVAL:-$([[ $on_gpu == 1 ]] && echo 10 || echo 5)}"
        --eval-interval "${EVAL_INTERVAL:-$iters}"
        --eval-iters "${EVAL_ITERS:-$([[ $on_gpu == 1 ]] && echo 10 || echo 1)}"
        --log-throughput --exit-signal-handler)
    if [[ -n ${VPP:-} ]]; then TRAIN_FLAGS+=(--virtual-pipeline-model-parallel-size "$VPP"); fi
    case ${PRECISION:-$([[ $on_gpu == 1 ]] && echo bf16 || echo fp32)} in
        bf16) TRAIN_FLAGS+=(--bf16) ;;
        fp16) TRAIN_FLAGS+=(--fp16) ;;
        fp32) ;;
        *) dpp_die "PRECISION=$PRECISION: expected bf16, fp16 or fp32" ;;
    esac
    case $use_dpp in
        1) TRAIN_FLAGS+=(--use-dpp --dpp-transport "${DPP_TRANSPORT:-auto}")
           if [[ -n ${DPP_MAX_INFLIGHT:-} ]]; then
               TRAIN_FLAGS+=(--dpp-max-inflight "$DPP_MAX_INFLIGHT")
           fi ;;
        0) ;;
        *) dpp_die "USE_DPP=$USE_DPP: expected 1 (dynamic schedule) or 0 (megatron-core's)" ;;
    esac
    if [[ -n ${CHECKPOINT_DIR:-} ]]; then
        TRAIN_FLAGS+=(--save "$CHECKPOINT_DIR" --load "$CHECKPOINT_DIR")
        if [[ -n ${SAVE_INTERVAL:-} ]]; then TRAIN_FLAGS+=(--save-interval "$SAVE_INTERVAL"); fi
    fi
}

# the command that starts the worker of node $1, with the settings given to the master
dpp_worker_command() {
    local rank=$1 name words=()
    words+=("NODE_IPS=$(printf %q "$NODE_IPS")" "NODE_RANK=$rank" "MASTER_PORT=$MASTER_PORT")
    for name in $DPP_SHARED_SETTINGS; do
        if [[ -n ${DPP_EXPLICIT[$name]+x} ]]; then words+=("$name=$(printf %q "${!name}")"); fi
    done
    words+=(bash "run_worker_${DPP_MODEL}.sh")
    if (( ${#DPP_EXTRA[@]} )); then words+=("$(printf '%q ' "${DPP_EXTRA[@]}")"); fi
    echo "${words[*]}"
}

# torchrun (the command after $1, the log) in the background, so that a SIGTERM of this
# script (docker stop, Kubernetes) reaches it at once: bash runs a trap only after the
# foreground command ends. torchrun runs in a process group of its own (setsid): a signal to
# this script's group (a terminal's Ctrl-C) reaches it only as this script passes it on,
# once; torch elastic's handler raises again on a second one while it stops the ranks.
# torchrun passes SIGTERM and SIGINT on to the ranks, which end at a step boundary under
# --exit-signal-handler (dpp_interrupt for Ctrl-C); they also stop when this script is gone
# (DPP_LAUNCH_SCRIPT_PID, megatron/trainer/run/exit_signals.py). The terminal gets the
# ranks' output without torchrun's traceback (the log keeps it); tee and the filter ignore
# Ctrl-C and SIGHUP so that the log keeps the ranks' last lines. Returns torchrun's status;
# DPP_STOP_SIGNAL names a signal received.
dpp_run_torchrun() {
    local logfile=$1 output trainer status
    shift
    DPP_STOP_SIGNAL= DPP_INTERRUPTED=
    # the filter ignores Ctrl-C and a closed terminal from its start (Python would end with
    # a traceback of the imports it was in); tee -p keeps writing the log should the filter
    # end (its terminal gone)
    exec {output}> >(trap '' INT HUP; tee -i -p "$logfile" |
        PYTHONPATH="$DPP_REPO${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m megatron.trainer.launch console)
    local filter=$!
    # the traps come first: a signal between the start and `trainer=$!` would otherwise end
    # this script at once; one that comes before the pid is known is passed on after it
    trainer=
    trap 'dpp_pass_on TERM "$trainer"' TERM
    trap 'dpp_pass_on HUP "$trainer"' HUP
    trap 'dpp_pass_on QUIT "$trainer"' QUIT
    trap 'dpp_interrupt "$trainer"' INT
    # a background command starts with Ctrl-C ignored: torchrun takes it only once it has
    # set its handlers, just before it starts the ranks (dpp_interrupt)
    TORCH_ELASTIC_SHUTDOWN_TIMEOUT=$STOP_GRACE DPP_LAUNCH_SCRIPT_PID=$$ \
        setsid "$@" >&"$output" 2>&1 &
    trainer=$!
    exec {output}>&-
    case $DPP_STOP_SIGNAL in
        INT) dpp_interrupt "$trainer" ;;
        ?*) dpp_pass_on "$DPP_STOP_SIGNAL" "$trainer" ;;
    esac
    while true; do
        status=0
        wait "$trainer" || status=$?
        # a trapped signal ends `wait` early: wait again while torchrun still runs
        kill -0 "$trainer" 2>/dev/null || break
    done
    trap - TERM HUP QUIT INT
    wait "$filter" 2>/dev/null || true
    return "$status"
}

# SIGTERM, SIGHUP, SIGQUIT: passed on to torchrun ($2, once started); SIGHUP (the terminal
# closed) as SIGTERM, so that the ranks save and stop as for docker stop
dpp_pass_on() {
    DPP_STOP_SIGNAL=$1
    [[ -z $2 ]] || kill -"${1/HUP/TERM}" "$2" 2>/dev/null
}

# Ctrl-C: SIGINT to a torchrun that runs its ranks; one that has not started them yet
# ignores SIGINT, and SIGTERM ends it at once (no rank to stop, nothing to save). A second
# Ctrl-C goes to the ranks themselves, which then end without waiting for the step (torchrun,
# already stopping them, would raise again and pass SIGTERM on, which waits)
dpp_interrupt() {
    DPP_STOP_SIGNAL=INT
    [[ -n $1 ]] || return 0  # torchrun not started yet: dpp_run_torchrun passes it on
    local children
    children=$(cat /proc/"$1"/task/*/children 2>/dev/null || ps -o pid= --ppid "$1" 2>/dev/null)
    if [[ -z ${children// /} ]]; then
        kill -TERM "$1" 2>/dev/null
    elif [[ -n ${DPP_INTERRUPTED:-} ]]; then
        # shellcheck disable=SC2086  # one pid a word
        kill -INT $children 2>/dev/null
    else
        DPP_INTERRUPTED=1
        kill -INT "$1" 2>/dev/null
    fi
}

dpp_launch() {
    DPP_MODEL=$1 DPP_ROLE=$2
    shift 2
    DPP_EXTRA=("$@")
    DPP_SCRIPT="run_${DPP_ROLE}_${DPP_MODEL}.sh"
    declare -gA DPP_EXPLICIT=()
    local name
    for name in $DPP_SHARED_SETTINGS; do
        if [[ -n ${!name+x} ]]; then DPP_EXPLICIT[$name]=1; fi
    done
    case $DPP_MODEL in
        gpt) source "$DPP_REPO/examples/gpt3/settings.sh" ;;
        bert) source "$DPP_REPO/examples/bert/settings.sh" ;;
        *) dpp_die "unknown model $DPP_MODEL" ;;
    esac
    PYTHON=${PYTHON:-python3}
    dpp_prerequisites

    local gpus on_gpu=0
    gpus=$(dpp_count_gpus)
    if (( gpus > 0 )); then on_gpu=1; fi
    if [[ $DPP_ROLE == single ]]; then
        : "${GPUS_PER_NODE:=$(( on_gpu ? gpus : 2 ))}"
    else
        : "${GPUS_PER_NODE:=$(( on_gpu ? gpus : 1 ))}"
    fi
    dpp_integer GPUS_PER_NODE
    : "${STOP_GRACE:=120}"
    dpp_integer STOP_GRACE
    if (( on_gpu && GPUS_PER_NODE > gpus )); then
        dpp_die "GPUS_PER_NODE=$GPUS_PER_NODE but this node has $gpus GPUs"
    fi
    if (( ! on_gpu )); then export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}; fi

    # node settings: checked here so that mistakes do not end in a rendezvous timeout
    local exports
    exports=$(PYTHONPATH="$DPP_REPO${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m \
        megatron.trainer.launch preflight --role "$DPP_ROLE" --script "$DPP_SCRIPT") || exit 2
    eval "$exports"

    dpp_run_dir
    dpp_train_flags "$on_gpu" $(( NNODES * GPUS_PER_NODE ))
    local node_flags=()
    if [[ $DPP_ROLE != single ]]; then
        # shellcheck disable=SC2206  # NODE_IPS is a list of addresses
        node_flags=(--multi-node --node-ips $NODE_IPS)
    fi
    if dpp_extra_has --trace && ! dpp_extra_has --trace-dir; then
        TRAIN_FLAGS+=(--trace-dir "$RUN_DIR/traces")
    fi
    local logfile=$RUN_DIR/train.log
    local launcher=(torchrun)
    if ! command -v torchrun >/dev/null; then launcher=("$PYTHON" -m torch.distributed.run); fi
    command -v setsid >/dev/null ||
        dpp_die "setsid not found: install util-linux (it starts torchrun in a process group of its own)"
    local cmd=("${launcher[@]}" --nnodes "$NNODES" --node_rank "$NODE_RANK"
        --nproc_per_node "$GPUS_PER_NODE" --master_addr "$MASTER_ADDR"
        --master_port "$MASTER_PORT" --rdzv-conf "timeout=${RDZV_TIMEOUT:-300}"
        "$DPP_REPO/$MODEL_ENTRY" "${TRAIN_FLAGS[@]}" "${node_flags[@]}" "${DPP_EXTRA[@]}")
    printf '%q ' "${cmd[@]}" >"$RUN_DIR/command.txt"
    echo >>"$RUN_DIR/command.txt"

    dpp_say_outputs "$logfile"
    dpp_say "node $NODE_RANK of $NNODES, $GPUS_PER_NODE processes on $([[ $on_gpu == 1 ]] && echo GPUs || echo CPU), schedule $DPP_SCHEDULE"
    if [[ $DPP_ROLE == master ]]; then
        local rank ips
        read -r -a ips <<<"$NODE_IPS"
        dpp_say "now start the worker on each other node, in its MegatronDPP checkout:"
        for (( rank = 1; rank < NNODES; rank++ )); do
            echo "  node $rank (${ips[rank]}):  $(dpp_worker_command "$rank")" >&2
        done
    fi
    dpp_say "running: $(cat "$RUN_DIR/command.txt")"

    if [[ $DPP_ROLE == worker && ${DATA_PATH:-sample} != mock ]]; then
        # megatron.core writes the dataset index files on rank 0 (the master's node) only
        dpp_say "building this node's dataset index cache in $DATA_CACHE"
        PYTHONPATH="$DPP_REPO${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m megatron.trainer.launch \
            prepare-data --model "$DPP_MODEL" --world-size $(( NNODES * GPUS_PER_NODE )) -- \
            "${TRAIN_FLAGS[@]}" "${node_flags[@]}" "${DPP_EXTRA[@]}" >"$RUN_DIR/prepare_data.log" 2>&1 ||
            { cat "$RUN_DIR/prepare_data.log" >&2; dpp_die "could not build the dataset index cache"; }
    fi
    if [[ -e $logfile ]]; then
        local kept=1
        while [[ -e $logfile.$kept ]]; do kept=$(( kept + 1 )); done
        mv "$logfile" "$logfile.$kept"
        dpp_say "kept the previous run's log of RUN_DIR as $logfile.$kept"
    fi
    local status
    dpp_run_torchrun "$logfile" "${cmd[@]}" || status=$?
    status=${status:-0}
    if [[ -n $DPP_STOP_SIGNAL ]]; then
        # the ranks saved (with CHECKPOINT_DIR) and logged their line; the job's status is
        # the signal's, as a shell reports it
        status=$(( 128 + $(kill -l "$DPP_STOP_SIGNAL") ))
        if grep -q "forcefully exiting via" "$logfile"; then
            dpp_say "torchrun killed ranks that had not stopped $STOP_GRACE s after it passed the signal on (STOP_GRACE; torch before 2.12 waits 30 s): their step and any checkpoint they were saving are lost, a new run resumes from the last checkpoint saved"
        fi
        dpp_say "stopped by SIG$DPP_STOP_SIGNAL (exit $status); full log: $logfile"
        exit "$status"
    fi
    if (( status != 0 )); then
        # torchrun exits 1 whatever the rank's status; its failure block holds the rank's
        local trainer_status
        trainer_status=$(PYTHONPATH="$DPP_REPO${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m \
            megatron.trainer.launch exit-status "$logfile") || trainer_status=
        status=${trainer_status:-$status}
        if (( status == 130 || status == 143 )) && grep -q "stopped by SIG" "$logfile"; then
            dpp_say "stopped by SIG$(kill -l $(( status - 128 ))), which reached the ranks but not this script (another node's, or sent to the ranks) (exit $status); full log: $logfile"
            exit "$status"
        fi
        dpp_say "training failed (exit $status); full log: $logfile"
        if grep -q "waiting for clients" "$logfile"; then
            dpp_say "no worker joined within RDZV_TIMEOUT=${RDZV_TIMEOUT:-300} s: start the worker command printed above on each other node"
        fi
        exit "$status"
    fi
    if grep -q "tokens/s:" "$logfile"; then
        PYTHONPATH="$DPP_REPO${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m megatron.trainer.launch \
            summarize "$logfile" | sed "s/^/[$DPP_SCRIPT] /"
    else
        dpp_say "finished; the last pipeline stage (node $(( NNODES - 1 ))) logs the iterations"
    fi
}
