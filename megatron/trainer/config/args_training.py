"""Training flags: batch sizes, microbatches, learning rate, step batch-size schedule."""

from __future__ import annotations

from megatron.trainer.config.args_common import add_flags
from megatron.trainer.config.args_parallel import interleaved_group_problem
from megatron.trainer.data.batch_schedule import (
    BatchScheduleError,
    StepSchedule,
    batch_size_schedule,
)


def batch_and_schedule_args(g):
    add_flags(g, {
        "--micro-batch-size int = 1": None,
        "--global-batch-size int": None,
        "--rampup-batch-size int": dict(nargs=3, metavar=("START", "INCREMENT", "SAMPLES")),
        "--train-iters int": None,
        "--train-samples int": None,
        "--exit-interval int": None,
        "--optimizer {adam,sgd} = adam": None,
        "--lr float": None,
        "--min-lr float = 0.0": None,
        "--lr-decay-style {constant,linear,cosine,inverse-square-root} = linear": None,
        "--lr-decay-iters int": None,
        "--lr-decay-samples int": None,
        "--lr-warmup-iters int = 0": None,
        "--lr-warmup-fraction float": None,
        "--lr-warmup-samples int = 0": None,
        "--lr-warmup-init float = 0.0": None,
        "--weight-decay float = 0.01": None,
        "--start-weight-decay float": None,
        "--end-weight-decay float": None,
        "--weight-decay-incr-style {constant,linear,cosine} = constant": None,
        "--clip-grad float = 1.0": None,
        "--adam-beta1 float = 0.9": None,
        "--adam-beta2 float = 0.999": None,
        "--adam-eps float = 1e-8": None,
        "--megatron-optimizer-fallbacks":
            "keep megatron-core's no-apex grad-norm/scale loops and foreach Adam (default: "
            "torch foreach norm/scale, fused Adam on GPU)",
        "--sgd-momentum float = 0.9": None,
        "--seed int = 1234": None,
        "--recompute-activations": None,
        "--recompute-granularity {full,selective}": None,
        "--recompute-method {uniform,block}": None,
        "--recompute-num-layers int": None,
        "--no-gradient-accumulation-fusion": dict(
            dest="gradient_accumulation_fusion", action="store_false",
            help="add each weight gradient to main_grad in a second kernel instead of in the "
                 "GEMM (the fusion runs on GPU only)"),
        "--cuda-graph-impl {auto,none,block,local,transformer_engine} = auto":
            "block: CUDA graphs of each chunk's transformer block, one pair per microbatch in "
            "flight, replayed in any order (also with --use-dpp); megatron-core's local / "
            "transformer_engine graphs are not supported. auto (default): block where the run "
            "allows it, else none",
        "--cuda-graph-memory-limit float": dict(
            metavar="GIB", help="--cuda-graph-impl block with variable lengths: the GiB one "
            "rank's graph recordings (a memory pool per microbatch in flight, holding every "
            "length bucket) may hold; a bucket past it runs eagerly, with one log line "
            "(default: no bound)"),
    })


def validate_batch(args, need) -> bool:
    """False where the ramp-up cannot be followed (its batch sizes are unknown)."""
    dp, mbs = args.data_parallel_size, args.micro_batch_size
    if args.global_batch_size is None:
        args.global_batch_size = mbs * dp
    gbs = args.global_batch_size
    need(gbs % (mbs * dp) == 0,
         f"--global-batch-size {gbs} is not divisible by --micro-batch-size {mbs} x "
         f"data-parallel size {dp}")
    args.num_microbatches = max(1, gbs // (mbs * dp))
    if args.rampup_batch_size is None:
        return True
    start, increment, _ = args.rampup_batch_size
    ramp = "--rampup-batch-size " + " ".join(map(str, args.rampup_batch_size))
    # megatron-core's ramp-up divides by the number of increments
    need(start < gbs, f"{ramp}: the start must be below --global-batch-size {gbs}")
    need((gbs - start) % increment == 0,
         f"{ramp}: --global-batch-size {gbs} minus the start is not a multiple of the "
         "increment")
    return start < gbs and (gbs - start) % increment == 0


def validate_microbatches(args, need):
    """Every global batch size the run uses (the ramp-up's included) must split into
    micro-batches over the data-parallel ranks; with virtual stages, megatron-core's
    interleaved schedule and the DPP policy (StageConfig) both run the microbatches in
    groups of --pipeline-model-parallel-size and need a multiple of it."""
    dp, mbs = args.data_parallel_size, args.micro_batch_size
    interleaved = args.virtual_pipeline_model_parallel_size is not None
    for size, iteration in _global_batch_sizes(args).items():
        if args.rampup_batch_size is None:
            what = f"--global-batch-size {size}"
        else:
            what = (f"--rampup-batch-size {' '.join(map(str, args.rampup_batch_size))}: global "
                    f"batch size {size} (from iteration {iteration})")
        if size % (mbs * dp) != 0:
            # the full --global-batch-size has been named already (validate_batch)
            need(size == args.global_batch_size, f"{what} is not divisible by "
                 f"--micro-batch-size {mbs} x data-parallel size {dp}")
            continue
        count = size // (mbs * dp)
        # --microbatch-group-size-per-virtual-pipeline-stage: megatron-core's own rule
        problem = interleaved_group_problem(args, count) if interleaved else None
        need(problem is None,
             f"{what} gives {count} microbatches (--micro-batch-size {mbs} x data-parallel size "
             f"{dp}); with virtual pipeline stages megatron-core's interleaved schedule and "
             f"--use-dpp both need {problem}")


def _global_batch_sizes(args) -> dict[int, int]:
    """Each global batch size the run uses -> the first iteration (from 1) that uses it,
    following megatron-core's RampupBatchsizeNumMicroBatchesCalculator."""
    gbs = args.global_batch_size
    if args.rampup_batch_size is None:
        return {gbs: 1}
    start, increment, samples = args.rampup_batch_size
    samples_per_increment = samples / ((gbs - start) // increment)
    sizes, consumed = {}, 0
    for iteration in range(1, args.train_iters + 1):
        if consumed > samples:
            size = gbs
        else:
            size = start + int(consumed / samples_per_increment) * increment
        sizes.setdefault(size, iteration)
        if size == gbs:
            break
        consumed += size
    return sizes


def validate_schedule(args, need):
    need((args.train_iters is None) != (args.train_samples is None),
         "exactly one of --train-iters and --train-samples is needed")
    if args.train_iters is None and args.train_samples is not None:
        args.train_iters = args.train_samples // args.global_batch_size
        need(args.train_iters > 0, f"--train-samples {args.train_samples} is less than one "
             f"global batch (--global-batch-size {args.global_batch_size})")
    need(args.lr is not None, "--lr is required")
    need(args.lr_warmup_fraction is None or args.lr_warmup_iters == 0,
         f"--lr-warmup-fraction {args.lr_warmup_fraction} and --lr-warmup-iters "
         f"{args.lr_warmup_iters} are mutually exclusive")
    if args.start_weight_decay is None:
        args.start_weight_decay = args.weight_decay
    if args.end_weight_decay is None:
        args.end_weight_decay = args.weight_decay


    # whether wandb is installed is checked at start-up (metrics.require_wandb), not here:
    # validation depends on the flags alone


def add_batch_schedule_args(g):
    add_flags(g, {
        "--step-batch-size-schedule str":
            'Megatron-LM\'s step schedule "THRESHOLD:SIZE ...": the global batch size of the '
            "last threshold reached, thresholds in tokens (K, M, B, T suffixes), e.g. "
            '"0:16 2.4B:320"',
    })


def resolve_step_batch_schedule(args, need):
    """--step-batch-size-schedule sets --global-batch-size to its final size. Megatron-LM
    refuses both flags together; here both are accepted where they agree."""
    if args.step_batch_size_schedule is None:
        return
    text = args.step_batch_size_schedule
    need(args.rampup_batch_size is None,
         "--step-batch-size-schedule and --rampup-batch-size exclude each other")
    try:
        final = StepSchedule.parse(text, args.seq_length).end
    except BatchScheduleError as error:
        need(False, str(error))
        args.step_batch_size_schedule = None  # the rest of validation uses the global size
        return
    need(args.global_batch_size in (None, final),
         f"--global-batch-size {args.global_batch_size} differs from the final size {final} "
         f"of --step-batch-size-schedule {text!r} (leave --global-batch-size out)")
    args.global_batch_size = final


def validate_step_batch_schedule(args, need):
    """Each size the run reaches splits into microbatches (in groups of the pipeline size
    with virtual stages); --train-samples counts the steps through the schedule."""
    if args.step_batch_size_schedule is None or args.rampup_batch_size is not None:
        return
    schedule = batch_size_schedule(None, args.micro_batch_size, args.data_parallel_size,
                                   step_batch_size_schedule=args.step_batch_size_schedule,
                                   seq_length=args.seq_length)
    if args.train_samples is not None:
        args.train_iters = schedule.iterations_for_samples(args.train_samples)
    if args.train_iters is None:
        return
    per_round = args.micro_batch_size * args.data_parallel_size
    group = args.pipeline_model_parallel_size
    interleaved = args.virtual_pipeline_model_parallel_size is not None
    for size, iteration in schedule.first_iterations(args.train_iters).items():
        if size == args.global_batch_size:
            continue  # named by the --global-batch-size checks
        what = (f"--step-batch-size-schedule {args.step_batch_size_schedule!r}: global batch "
                f"size {size} (from iteration {iteration})")
        need(size % per_round == 0, f"{what} is not divisible by --micro-batch-size "
             f"{args.micro_batch_size} x data-parallel size {args.data_parallel_size}")
        need(not interleaved or size % per_round or (size // per_round) % group == 0,
             f"{what} gives {size // per_round} microbatches; with virtual pipeline stages "
             f"they must be a multiple of --pipeline-model-parallel-size {group}")
