"""Checkpoint flags: format, behaviour, stored arguments, format detection, eval batch size."""

from __future__ import annotations

CKPT_FORMATS = ("torch_dist", "torch")


DIST_CKPT_STRICTNESS = (
    "assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected", "raise_all",
    "return_unexpected", "return_all", "ignore_all",
)


def add_checkpoint_args(g):
    """Megatron-LM's checkpoint flags; megatron/trainer/checkpoint/checkpoint_config.py says
    what each does here."""
    g.add_argument("--ckpt-format", default="torch_dist",
                   choices=[*CKPT_FORMATS, "torch_dcp", "fsdp_dtensor"],
                   help="torch_dist: megatron.core.dist_checkpointing (sharded, reshardable); "
                        "torch: one torch.save file per model-parallel rank (Megatron-LM's "
                        "legacy layout). --load reads either")
    g.add_argument("--async-save", action="store_true",
                   help="write torch_dist checkpoints in a background process "
                        "(megatron.core's AsyncCallsQueue); published once every rank is done")
    g.add_argument("--use-persistent-ckpt-worker", action="store_true",
                   help="--async-save through one long-lived writer process per rank (GPU only)")
    g.add_argument("--dist-ckpt-strictness", default="assume_ok_unexpected",
                   choices=DIST_CKPT_STRICTNESS,
                   help="key mismatches between a torch_dist checkpoint and the model "
                        "(megatron.core's StrictHandling; 'unexpected': asked for but absent "
                        "from the checkpoint, 'missing': in the checkpoint but not asked for)")
    g.add_argument("--ckpt-fully-parallel-save", dest="ckpt_fully_parallel_save",
                   action="store_true", default=True,
                   help="spread the writes of replicated tensors over the data-parallel ranks "
                        "(the default)")
    g.add_argument("--no-ckpt-fully-parallel-save", dest="ckpt_fully_parallel_save",
                   action="store_false",
                   help="data-parallel rank 0 writes every replicated tensor")
    g.add_argument("--ckpt-fully-parallel-load", action="store_true",
                   help="each data-parallel rank reads a share of a torch_dist checkpoint and "
                        "they exchange the rest")
    g.add_argument("--dist-ckpt-optim-fully-reshardable", action="store_true",
                   help="distributed optimizer state saved fully reshardable (TP/PP/DP) "
                        "instead of data-parallel reshardable")
    g.add_argument("--use-checkpoint-opt_param-scheduler", action="store_true",
                   help="take the lr / weight-decay schedule from the checkpoint")
    g.add_argument("--override-opt_param-scheduler", action="store_true",
                   help="take the lr / weight-decay schedule from the flags, not the checkpoint")
    g.add_argument("--save-retain-interval", type=int, default=None,
                   help="after each save, delete the previous checkpoint unless its iteration "
                        "is a multiple of this")
    g.add_argument("--non-persistent-save-interval", type=int, default=None,
                   help="iterations between non-persistent saves (only the latest is kept)")
    g.add_argument("--non-persistent-ckpt-type", default=None,
                   choices=["global", "local", "in_memory"])
    g.add_argument("--non-persistent-global-ckpt-dir", default=None,
                   help="where non-persistent global checkpoints go (default: SAVE/non_persistent)")


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
    g.add_argument("--use-checkpoint-args", action="store_true",
                   help="on --load, the checkpoint's model arguments (layers, sizes, heads, "
                        "normalization, position embedding, ...) replace or fill in the "
                        "command line's, as in Megatron-LM; each change is logged")
    g.add_argument("--use-mp-args-from-checkpoint-args", action="store_true",
                   help="with --use-checkpoint-args, also the tensor, pipeline and virtual "
                        "pipeline sizes")
    g.add_argument("--no-use-tokenizer-model-from-checkpoint-args", action="store_false",
                   dest="use_tokenizer_model_from_checkpoint_args",
                   help="with --use-checkpoint-args, keep the command line's tokenizer type "
                        "and model (default: the checkpoint's)")
    g.add_argument("--auto-detect-ckpt-format", action="store_true",
                   help="--load reads a checkpoint in either format; without it "
                        "--ckpt-format torch reads only torch-format checkpoints (torch_dist, "
                        "the default, detects either, as in Megatron-LM)")
    g.add_argument("--async-ckpt-use-cpu-shm", action="store_true",
                   help="--async-save: copy the tensors to write into CPU shared memory in "
                        "the training process, so the writer process gets no CUDA IPC handles")
    g.add_argument("--eval-global-batch-size", type=int, default=None,
                   help="samples per evaluation iteration (default: --global-batch-size)")


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
    need(not args.variable_seq_lengths,
         "--eval-global-batch-size with --variable-seq-lengths: evaluation reads the "
         "documents in the training global batch's plan")
