"""Parallelism flags: sizes, virtual and uneven pipelines, megatron-core's settings."""

from __future__ import annotations

from megatron.trainer.config.args_common import add_flags


def parallel_args(g):
    add_flags(g, {
        "--tensor-model-parallel-size int = 1": None,
        "--pipeline-model-parallel-size int = 1": None,
        "--num-layers-per-virtual-pipeline-stage int": None,
        "--virtual-pipeline-model-parallel-size int": None,
        "--decoder-first-pipeline-num-layers int":
            "transformer layers on the first pipeline stage; the others share the rest evenly "
            "(default: even split over all stages)",
        "--decoder-last-pipeline-num-layers int":
            "transformer layers on the last pipeline stage; the others share the rest evenly "
            "(default: even split over all stages)",
        "--account-for-embedding-in-pipeline-split":
            "count the embedding as one layer when splitting layers over stages",
        "--account-for-loss-in-pipeline-split":
            "count the output layer and loss as one layer when splitting layers over stages",
        "--context-parallel-size int = 1": None,
        "--sequence-parallel": None,
        "--use-distributed-optimizer": None,
        "--overlap-grad-reduce": None,
        "--overlap-param-gather": None,
        "--distributed-backend {nccl,gloo}": None,
        "--distributed-timeout-minutes float = 10": None,
        "--local-rank --local_rank int": None,
        "--no-batch-p2p-comm":
            "megatron-core schedules: unbatched p2p (chosen automatically at PP=2 with virtual "
            "stages, where batched p2p gives wrong gradients)",
        "--batch-p2p-sync":
            "megatron-core schedules: synchronise the device after each batched p2p exchange "
            "(an old PyTorch workaround; it stalls the host each time)",
    })


def validate_virtual_pipeline(args, need):
    pp = args.pipeline_model_parallel_size
    vpp = args.virtual_pipeline_model_parallel_size
    per_stage = args.num_layers_per_virtual_pipeline_stage
    uneven = {flag: value for flag, value in (
        ("--decoder-first-pipeline-num-layers", args.decoder_first_pipeline_num_layers),
        ("--decoder-last-pipeline-num-layers", args.decoder_last_pipeline_num_layers),
    ) if value is not None}
    if per_stage is not None:
        need(pp > 1, "--num-layers-per-virtual-pipeline-stage needs "
             "--pipeline-model-parallel-size > 1")
    if vpp is not None and vpp > 1:
        need(pp > 1, f"--virtual-pipeline-model-parallel-size {vpp} needs "
             "--pipeline-model-parallel-size > 1")
    if uneven:
        need(per_stage is None,
             f"--num-layers-per-virtual-pipeline-stage {per_stage} cannot be combined with "
             f"{' and '.join(uneven)} (the stages hold different numbers of layers); give "
             "--virtual-pipeline-model-parallel-size (chunks per stage) instead")
        _validate_uneven_split(args, need, uneven, vpp if vpp is not None and vpp > 1 else None)
        per_stage = None
    # the embedding and the output layer + loss count as one layer each where asked to
    accounted = [flag for flag, on in (
        ("--account-for-embedding-in-pipeline-split", args.account_for_embedding_in_pipeline_split),
        ("--account-for-loss-in-pipeline-split", args.account_for_loss_in_pipeline_split),
    ) if on]
    layers = args.num_layers + len(accounted)
    counted = f"--num-layers {args.num_layers}" + "".join(f" + 1 ({flag})" for flag in accounted)
    if not uneven:
        need(layers % pp == 0,
             f"{counted} is not divisible by --pipeline-model-parallel-size {pp}")
    if per_stage is not None:
        need(layers % (pp * per_stage) == 0,
             f"{counted} is not divisible by --pipeline-model-parallel-size {pp} x "
             f"--num-layers-per-virtual-pipeline-stage {per_stage}")
        derived = max(1, layers // (pp * per_stage))
        need(vpp is None or vpp == derived,
             f"--virtual-pipeline-model-parallel-size {vpp} contradicts "
             f"--num-layers-per-virtual-pipeline-stage {per_stage} ({derived} chunks)")
        vpp = derived
    elif vpp is not None and not uneven:
        need(layers % (pp * vpp) == 0,
             f"{counted} is not divisible by --pipeline-model-parallel-size {pp} x "
             f"--virtual-pipeline-model-parallel-size {vpp}")
    if vpp is not None and vpp <= 1:
        vpp = None
    args.virtual_pipeline_model_parallel_size = vpp


def _validate_uneven_split(args, need, uneven: dict, vpp):
    """--decoder-first/last-pipeline-num-layers: megatron-core's rules for an uneven split
    (TransformerConfig.__post_init__, get_num_layers_to_build, get_transformer_layer_offset).
    The stages without a given count share the remaining layers evenly, and with virtual
    stages every stage's count divides into `vpp` equal chunks."""
    pp, layers = args.pipeline_model_parallel_size, args.num_layers
    given = " and ".join(f"{flag} {value}" for flag, value in uneven.items())
    need(pp > 1, f"{given}: an uneven split needs --pipeline-model-parallel-size > 1")
    for flag, on in (
        ("--account-for-embedding-in-pipeline-split", args.account_for_embedding_in_pipeline_split),
        ("--account-for-loss-in-pipeline-split", args.account_for_loss_in_pipeline_split),
    ):
        need(not on, f"{given} and {flag} are mutually exclusive")
    for flag, value in uneven.items():
        need(value >= 1, f"{flag} {value} must be >= 1")
        need(vpp is None or value % vpp == 0,
             f"{flag} {value} is not divisible by --virtual-pipeline-model-parallel-size {vpp}")
    if pp <= 1 or min(uneven.values()) < 1:
        return
    rest_layers = layers - sum(uneven.values())
    rest_stages = pp - len(uneven)
    if rest_stages == 0:
        need(rest_layers == 0, f"{given} must add up to --num-layers {layers}: "
             f"--pipeline-model-parallel-size {pp} has no other stage")
        # megatron-core 0.16.1's layer offset then divides by the zero middle stages
        need(vpp is None, f"{given} with --virtual-pipeline-model-parallel-size {vpp} and "
             f"--pipeline-model-parallel-size {pp}: megatron-core cannot place the layers "
             "when both are given; give only one of the two")
        return
    minus = " minus ".join(f"{flag} {value}" for flag, value in uneven.items())
    left = (f"--num-layers {layers} minus {minus} leaves {rest_layers} layers for the "
            f"{rest_stages} remaining stages of --pipeline-model-parallel-size {pp}")
    even = rest_layers > 0 and rest_layers % rest_stages == 0
    need(even, f"{left}: they must divide evenly, at least one layer each")
    if even and vpp is not None:
        per_stage = rest_layers // rest_stages
        need(per_stage % vpp == 0, f"{left}: {per_stage} per stage is not divisible by "
             f"--virtual-pipeline-model-parallel-size {vpp}")


def add_core_extras_args(g):
    add_flags(g, {
        "--check-weight-hash-across-dp-replicas-interval int":
            "every N iterations compare a hash of the weights across data-parallel replicas; "
            "stop naming the ranks if they differ",
        "--overlap-param-gather-with-optimizer-step":
            "start the first model chunk's parameter all-gather in the optimizer step "
            "(distributed optimizer, --overlap-param-gather, virtual stages)",
        "--ckpt-assume-constant-structure":
            "torch_dist saves reuse the first save's plan and metadata (the model and "
            "optimizer structure must not change during the run)",
        "--trust-checkpoint":
            "load a checkpoint that is world-writable or another user's, and legacy files "
            "holding classes beyond the allowed ones (loading unpickles: a crafted checkpoint "
            "runs code; megatron/trainer/checkpoint/checkpoint_trust.py)",
        "--verify-integrity": "write a SHA-256 manifest of each saved checkpoint and check the "
                              "loaded checkpoint against it",
        "--async-strategy {mcore,nvrx} = mcore":
            "writer of --async-save: megatron-core's own (mcore)",
        "--qk-layernorm": "normalize queries and keys per head before the attention scores",
        "--test-mode": "megatron-core's real-time checks: every attention forward compares "
                       "the q/k norm weights across data- and tensor-parallel ranks",
        "--microbatch-group-size-per-virtual-pipeline-stage int":
            "megatron-core's interleaved schedule runs this many consecutive microbatches on "
            "each virtual stage (default: the pipeline size)",
        "--overlap-p2p-communication-warmup-flush":
            "megatron-core's interleaved schedule overlaps its p2p with compute in warm-up "
            "and flush too (unbatched p2p)",
        "--disable-gloo-process-groups":
            "create no gloo twins of megatron-core's process groups",
        "--num-distributed-optimizer-instances int = 1":
            "split the data-parallel ranks into this many groups, each sharding a whole copy "
            "of the optimizer state (megatron-core)",
    })


def validate_core_extras(args, need):
    interval = args.check_weight_hash_across_dp_replicas_interval
    need(interval is None or interval >= 1,
         f"--check-weight-hash-across-dp-replicas-interval {interval} must be >= 1")
    need(not (args.disable_gloo_process_groups and args.use_distributed_optimizer
              and args.ckpt_format == "torch" and (args.save or args.load)),
         "--disable-gloo-process-groups with --use-distributed-optimizer cannot save or load "
         "--ckpt-format torch (megatron-core gathers its optimizer state over gloo); use "
         "torch_dist")
    if args.overlap_param_gather_with_optimizer_step:
        missing = [what for what, ok in (
            ("--use-distributed-optimizer", args.use_distributed_optimizer),
            ("--overlap-param-gather", args.overlap_param_gather),
            ("virtual pipeline stages", args.virtual_pipeline_model_parallel_size is not None),
            ("--ckpt-format torch (megatron-core cannot save it in torch_dist yet)",
             args.ckpt_format == "torch" or not (args.save or args.load)),
            ("megatron-core's schedule (not --use-dpp)", not args.use_dpp)) if not ok]
        need(not missing, "--overlap-param-gather-with-optimizer-step needs "
             + ", ".join(missing))
    need(not args.qk_layernorm or args.model == "gpt",
         "--qk-layernorm: megatron-core's BERT layer specs have no query/key norms")
    if args.test_mode:
        why = [reason for reason, bad in (
            ("it checks only the q/k norms of --qk-layernorm", not args.qk_layernorm),
            ("its checks need the norms' biases (--normalization LayerNorm)",
             args.normalization != "LayerNorm"),
            ("its collectives inside each forward need the ranks in step, not --use-dpp",
             args.use_dpp)) if bad]
        need(not why, "--test-mode: " + "; ".join(why))
    _validate_interleaved_schedule_tuning(args, need)
    need(not args.verify_integrity or args.save or args.load,
         "--verify-integrity needs --save or --load")
    need(args.async_strategy == "mcore", f"--async-strategy {args.async_strategy}: only "
         "mcore (megatron-core's writer); nvrx needs nvidia-resiliency-ext's checkpointing")
    need(not args.ckpt_assume_constant_structure or args.ckpt_format == "torch_dist",
         f"--ckpt-assume-constant-structure caches megatron-core's torch_dist save plan; "
         f"--ckpt-format {args.ckpt_format} has none")


def _validate_interleaved_schedule_tuning(args, need):
    """Settings of megatron-core's interleaved schedule: virtual stages and that schedule
    (DPP orders its tasks by readiness, not in groups)."""
    pp, interleaved = args.pipeline_model_parallel_size, \
        args.virtual_pipeline_model_parallel_size is not None
    group = args.microbatch_group_size_per_virtual_pipeline_stage
    if group is not None:
        flag = f"--microbatch-group-size-per-virtual-pipeline-stage {group}"
        need(interleaved, f"{flag} needs virtual pipeline stages")
        need(not args.use_dpp or group == pp, f"{flag}: --use-dpp runs the microbatches of "
             f"a virtual stage in groups of --pipeline-model-parallel-size {pp}")
        need(group >= pp, f"{flag} is below --pipeline-model-parallel-size {pp}")
    if args.overlap_p2p_communication_warmup_flush:
        flag = "--overlap-p2p-communication-warmup-flush"
        need(interleaved and not args.use_dpp,
             f"{flag} tunes megatron-core's interleaved schedule: needs virtual pipeline "
             "stages and not --use-dpp")
        # overlapped unbatched p2p posts both directions to the one neighbour at once
        need(pp != 2, f"{flag} at --pipeline-model-parallel-size 2: the one neighbour would "
             "match activations and gradients by posting order")


def interleaved_group_problem(args, count: int) -> str | None:
    """Why megatron-core's interleaved schedule refuses `count` microbatches, or None."""
    pp = args.pipeline_model_parallel_size
    group = args.microbatch_group_size_per_virtual_pipeline_stage
    if group is None or args.use_dpp:
        return None if count % pp == 0 else (
            f"a multiple of --pipeline-model-parallel-size {pp}")
    if count < group:
        return f"at least --microbatch-group-size-per-virtual-pipeline-stage {group}"
    if 0 < count % group < pp:
        return (f"a multiple of --microbatch-group-size-per-virtual-pipeline-stage {group} "
                f"or one whose last group has at least --pipeline-model-parallel-size {pp}")
    return None
