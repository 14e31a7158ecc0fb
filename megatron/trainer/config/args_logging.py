"""Save/load locations, logging, tracing, profiling, TensorBoard and W&B flags."""

from __future__ import annotations


def io_args(g):
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--no-save-optim", action="store_true")
    g.add_argument("--finetune", action="store_true")
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--log-throughput", action="store_true")
    g.add_argument("--timing-log-level", type=int, default=0, choices=[0, 1, 2],
                   help="timers recorded: 0 the iteration time; 1 also forward-backward, "
                        "optimizer and megatron-core's level-1 timers; 2 also its per-"
                        "microbatch compute and p2p timers (each timer synchronises the GPU)")
    g.add_argument("--trace", action="store_true",
                   help="record per-rank pipeline spans (docs/profiling.md)")
    g.add_argument("--trace-dir", default=None,
                   help="where --trace writes trace-rank<R>.jsonl (default: traces)")
    g.add_argument("--trace-iters", type=int, nargs="+", default=None, metavar="N",
                   help="iterations to trace, counted from 1 (default: all)")
    g.add_argument("--manual-gc", action="store_true",
                   help="Python's garbage collector only at start, every "
                        "--manual-gc-interval iterations and around evaluation")
    g.add_argument("--manual-gc-interval", type=int, default=0,
                   help="iterations between collections with --manual-gc (0: none)")
    g.add_argument("--no-manual-gc-eval", dest="manual_gc_eval", action="store_false",
                   help="with --manual-gc, no collection around evaluation")
    g.add_argument("--profile", action="store_true",
                   help="profile iterations [--profile-step-start, --profile-step-end)")
    g.add_argument("--use-pytorch-profiler", action="store_true",
                   help="--profile with torch.profiler (else cudaProfilerStart/Stop for nsys)")
    g.add_argument("--profile-step-start", type=int, default=10)
    g.add_argument("--profile-step-end", type=int, default=12)
    g.add_argument("--profile-ranks", type=int, nargs="+", default=[0])
    g.add_argument("--profile-dir", default=None,
                   help="torch.profiler output (default: --tensorboard-dir, else profile)")


def validate_trace(args, need):
    for flag, value in (("--trace-dir", args.trace_dir), ("--trace-iters", args.trace_iters)):
        need(args.trace or value is None, f"{flag} needs --trace")
    bad = [n for n in args.trace_iters or [] if n < 1]
    need(not bad, f"--trace-iters {' '.join(map(str, bad))}: iterations count from 1")
    need(args.manual_gc_interval >= 0,
         f"--manual-gc-interval {args.manual_gc_interval} must be >= 0")
    need(1 <= args.profile_step_start < args.profile_step_end,
         f"--profile-step-start {args.profile_step_start} and --profile-step-end "
         f"{args.profile_step_end}: need 1 <= start < end (iterations count from 1)")


def add_logging_args(g):
    """Megatron-LM's logging flags; megatron/trainer/logging_config.py turns them into a
    LoggingConfig, megatron/trainer/run/metrics.py writes what they ask for."""
    g.add_argument("--log-timers-to-tensorboard", action="store_true",
                   help="the --timing-log-level timers as timers/<name> (ms per iteration)")
    g.add_argument("--log-memory-to-tensorboard", action="store_true",
                   help="the reporting rank's memory: CUDA allocator figures on GPU, the "
                        "process's peak resident set on CPU")
    g.add_argument("--log-num-zeros-in-grad", action="store_true",
                   help="count the zero entries of the gradient (iteration line and board)")
    g.add_argument("--log-params-norm", action="store_true",
                   help="L2 norm of all parameters, each counted once (iteration line and board)")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true",
                   help="validation perplexity exp(loss) next to each validation loss")
    g.add_argument("--wandb-project", default=None,
                   help="log the scalars to this Weights & Biases project too (needs wandb)")
    g.add_argument("--wandb-exp-name", default=None, help="the W&B run's name")
    g.add_argument("--wandb-entity", default=None, help="the W&B team or user")
    g.add_argument("--wandb-save-dir", default=None,
                   help="W&B's local files (default: --save/wandb, else wandb)")


def validate_logging(args, need):
    board_flags = [flag for flag, on in (
        ("--log-timers-to-tensorboard", args.log_timers_to_tensorboard),
        ("--log-memory-to-tensorboard", args.log_memory_to_tensorboard),
        ("--log-validation-ppl-to-tensorboard", args.log_validation_ppl_to_tensorboard),
    ) if on]
    need(not board_flags or args.tensorboard_dir or args.wandb_project,
         f"{' '.join(board_flags)} need --tensorboard-dir DIR (or --wandb-project)")
    wandb_flags = [flag for flag, value in (
        ("--wandb-exp-name", args.wandb_exp_name), ("--wandb-entity", args.wandb_entity),
        ("--wandb-save-dir", args.wandb_save_dir)) if value is not None]
    if args.wandb_project is None:
        need(not wandb_flags, f"{' '.join(wandb_flags)} need --wandb-project")
        return
    need(bool(args.wandb_exp_name), f"--wandb-project {args.wandb_project} needs "
         "--wandb-exp-name NAME")
