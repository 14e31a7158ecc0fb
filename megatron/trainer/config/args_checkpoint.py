"""Checkpoint flags: format, behaviour, stored arguments, format detection, eval batch size."""

from __future__ import annotations

from megatron.trainer.config.args_common import add_flags

CKPT_FORMATS = ("torch_dist", "torch")


DIST_CKPT_STRICTNESS = (
    "assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected", "raise_all",
    "return_unexpected", "return_all", "ignore_all",
)


def add_checkpoint_args(g):
    """Megatron-LM's checkpoint flags; megatron/trainer/checkpoint/checkpoint_config.py says
    what each does here."""
    add_flags(g, {
        "--ckpt-format str": dict(
            default="torch_dist", choices=[*CKPT_FORMATS, "torch_dcp", "fsdp_dtensor"],
            help="torch_dist: megatron.core.dist_checkpointing (sharded, reshardable); "
                 "torch: one torch.save file per model-parallel rank (Megatron-LM's legacy "
                 "layout). --load reads either"),
        "--async-save": "write torch_dist checkpoints in a background process (megatron.core's "
                        "AsyncCallsQueue); published once every rank is done",
        "--use-persistent-ckpt-worker":
            "--async-save through one long-lived writer process per rank (GPU only)",
        "--dist-ckpt-strictness str": dict(
            default="assume_ok_unexpected", choices=DIST_CKPT_STRICTNESS,
            help="key mismatches between a torch_dist checkpoint and the model (megatron."
                 "core's StrictHandling; 'unexpected': asked for but absent from the "
                 "checkpoint, 'missing': in the checkpoint but not asked for)"),
        "--ckpt-fully-parallel-save": dict(
            default=True, help="spread the writes of replicated tensors over the data-"
                               "parallel ranks (the default)"),
        "--no-ckpt-fully-parallel-save": dict(
            dest="ckpt_fully_parallel_save", action="store_false",
            help="data-parallel rank 0 writes every replicated tensor"),
        "--ckpt-fully-parallel-load":
            "each data-parallel rank reads a share of a torch_dist checkpoint and they "
            "exchange the rest",
        "--dist-ckpt-optim-fully-reshardable":
            "distributed optimizer state saved fully reshardable (TP/PP/DP) instead of "
            "data-parallel reshardable",
        "--use-checkpoint-opt_param-scheduler":
            "take the lr / weight-decay schedule from the checkpoint",
        "--override-opt_param-scheduler":
            "take the lr / weight-decay schedule from the flags, not the checkpoint",
        "--save-retain-interval int":
            "after each save, delete the previous checkpoint unless its iteration is a "
            "multiple of this",
        "--non-persistent-save-interval int":
            "iterations between non-persistent saves (only the latest is kept)",
        "--non-persistent-ckpt-type {global,local,in_memory}": None,
        "--non-persistent-global-ckpt-dir str":
            "where non-persistent global checkpoints go (default: SAVE/non_persistent)",
    })


def validate_checkpointing(args, need):
    fmt = args.ckpt_format
    need(fmt in CKPT_FORMATS, f"--ckpt-format {fmt}: only torch_dist and torch are supported "
         f"({fmt} is Megatron-LM's format for its FSDP, which this trainer does not run)")
    need(not args.async_save or fmt == "torch_dist",
         f"--async-save needs --ckpt-format torch_dist (megatron.core writes only distributed "
         f"checkpoints asynchronously), not {fmt}")
    need(not args.use_persistent_ckpt_worker or args.async_save,
         "--use-persistent-ckpt-worker needs --async-save (the worker writes asynchronous saves)")
    need(not (args.use_checkpoint_opt_param_scheduler and args.override_opt_param_scheduler),
         "--use-checkpoint-opt_param-scheduler and --override-opt_param-scheduler are mutually "
         "exclusive")
    for flag, value in (("--save-retain-interval", args.save_retain_interval),
                        ("--non-persistent-save-interval", args.non_persistent_save_interval)):
        if value is not None:
            need(value >= 1, f"{flag} {value} must be >= 1")
            need(args.save is not None, f"{flag} {value} needs --save DIR")
    kind = args.non_persistent_ckpt_type
    need(kind in (None, "global"), f"--non-persistent-ckpt-type {kind}: only global is "
         "supported (local and in_memory need nvidia-resiliency-ext's checkpoint manager)")
    need(args.non_persistent_save_interval is None or kind is not None,
         "--non-persistent-save-interval needs --non-persistent-ckpt-type global")
    need(args.non_persistent_global_ckpt_dir is None or kind == "global",
         "--non-persistent-global-ckpt-dir needs --non-persistent-ckpt-type global")


def add_checkpoint_args_and_eval_args(g):
    """Megatron-LM's flags for taking the model's arguments from the checkpoint
    (megatron/trainer/checkpoint/checkpoint_args.py), detecting the checkpoint format on load,
    staging asynchronous saves in shared memory, and evaluation's batch size."""
    add_flags(g, {
        "--use-checkpoint-args":
            "on --load, the checkpoint's model arguments (layers, sizes, heads, normalization, "
            "position embedding, ...) replace or fill in the command line's, as in "
            "Megatron-LM; each change is logged",
        "--use-mp-args-from-checkpoint-args":
            "with --use-checkpoint-args, also the tensor, pipeline and virtual pipeline sizes",
        "--no-use-tokenizer-model-from-checkpoint-args": dict(
            dest="use_tokenizer_model_from_checkpoint_args", action="store_false",
            help="with --use-checkpoint-args, keep the command line's tokenizer type and "
                 "model (default: the checkpoint's)"),
        "--auto-detect-ckpt-format":
            "--load reads a checkpoint in either format; without it --ckpt-format torch reads "
            "only torch-format checkpoints (torch_dist, the default, detects either, as in "
            "Megatron-LM)",
        "--async-ckpt-use-cpu-shm":
            "--async-save: copy the tensors to write into CPU shared memory in the training "
            "process, so the writer process gets no CUDA IPC handles",
        "--eval-global-batch-size int":
            "samples per evaluation iteration (default: --global-batch-size)",
    })


def apply_checkpoint_args(args) -> None:
    """--use-checkpoint-args: before validation, as in Megatron-LM."""
    if args.use_checkpoint_args and args.load is not None:
        from megatron.trainer.checkpoint.checkpoint_args import apply_checkpoint_args

        apply_checkpoint_args(args)


def validate_checkpoint_args_and_eval(args, need):
    need(not args.use_checkpoint_args or args.load is not None,
         "--use-checkpoint-args needs --load DIR (the checkpoint holding the arguments)")
    need(not args.use_mp_args_from_checkpoint_args or args.use_checkpoint_args,
         "--use-mp-args-from-checkpoint-args needs --use-checkpoint-args")
    need(not args.async_ckpt_use_cpu_shm or args.async_save,
         "--async-ckpt-use-cpu-shm stages the tensors of --async-save; give --async-save "
         "(a synchronous save writes from the training process itself)")
    batch = args.eval_global_batch_size
    if batch is None:
        return
    rows = args.micro_batch_size * args.data_parallel_size
    need(batch >= 1 and batch % rows == 0,
         f"--eval-global-batch-size {batch} is not a multiple of --micro-batch-size "
         f"{args.micro_batch_size} x data-parallel size {args.data_parallel_size}")
    pp = args.pipeline_model_parallel_size
    if args.virtual_pipeline_model_parallel_size is not None and batch % rows == 0:
        need((batch // rows) % pp == 0,
             f"--eval-global-batch-size {batch}: {batch // rows} microbatches, not a multiple "
             f"of --pipeline-model-parallel-size {pp} (virtual stages run them in groups of it)")
