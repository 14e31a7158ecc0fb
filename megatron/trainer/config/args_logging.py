"""Save/load locations, logging, tracing, profiling, TensorBoard and W&B flags."""

from __future__ import annotations

from megatron.trainer.config.args_common import add_flags


def io_args(g):
    add_flags(g, {
        "--save str": None,
        "--load str": None,
        "--save-interval int": None,
        "--no-load-optim": None,
        "--no-load-rng": None,
        "--no-save-optim": None,
        "--finetune": None,
        "--eval-interval int = 1000": None,
        "--eval-iters int = 100": None,
        "--log-interval int = 100": None,
        "--tensorboard-dir str": None,
        "--log-throughput": None,
        "--timing-log-level int {0,1,2} = 0":
            "timers recorded: 0 the iteration time; 1 also forward-backward, optimizer and "
            "megatron-core's level-1 timers; 2 also its per-microbatch compute and p2p timers "
            "(each timer synchronises the GPU)",
        "--trace": "record per-rank pipeline spans (docs/profiling.md)",
        "--trace-dir str": "where --trace writes trace-rank<R>.jsonl (default: traces)",
        "--trace-iters int": dict(nargs="+", metavar="N", help="iterations to trace, counted "
                                  "from 1 (default: all)"),
        "--manual-gc": "Python's garbage collector only at start, every --manual-gc-interval "
                       "iterations and around evaluation",
        "--manual-gc-interval int = 0":
            "iterations between collections with --manual-gc (0: none)",
        "--no-manual-gc-eval": dict(dest="manual_gc_eval", action="store_false",
                                    help="with --manual-gc, no collection around evaluation"),
        "--profile": "profile iterations [--profile-step-start, --profile-step-end)",
        "--use-pytorch-profiler":
            "--profile with torch.profiler (else cudaProfilerStart/Stop for nsys)",
        "--profile-step-start int = 10": None,
        "--profile-step-end int = 12": None,
        "--profile-ranks int": dict(nargs="+", default=[0]),
        "--profile-dir str": "torch.profiler output (default: --tensorboard-dir, else profile)",
        "--record-memory-history":
            "the ranks of --profile-ranks record the CUDA allocator's history and write its "
            "snapshot after the first iteration, every --log-interval and at the end "
            "(docs/profiling.md)",
        "--memory-snapshot-path str = snapshot.pickle":
            "--record-memory-history's snapshot; each rank writes <path>-rank<R><suffix>",
    })


def validate_trace(args, need):
    for flag, value in (("--trace-dir", args.trace_dir), ("--trace-iters", args.trace_iters)):
        need(args.trace or value is None, f"{flag} needs --trace")
    bad = [n for n in args.trace_iters or [] if n < 1]
    need(not bad, f"--trace-iters {' '.join(map(str, bad))}: iterations count from 1")
    need(args.record_memory_history or args.memory_snapshot_path == "snapshot.pickle",
         "--memory-snapshot-path needs --record-memory-history")
    need(args.manual_gc_interval >= 0,
         f"--manual-gc-interval {args.manual_gc_interval} must be >= 0")
    need(1 <= args.profile_step_start < args.profile_step_end,
         f"--profile-step-start {args.profile_step_start} and --profile-step-end "
         f"{args.profile_step_end}: need 1 <= start < end (iterations count from 1)")


def add_logging_args(g):
    """Megatron-LM's logging flags; configs.LoggingConfig holds them and their rules,
    megatron/trainer/run/metrics.py writes what they ask for."""
    add_flags(g, {
        "--log-timers-to-tensorboard":
            "the --timing-log-level timers as timers/<name> (ms per iteration)",
        "--log-memory-to-tensorboard":
            "the reporting rank's memory: CUDA allocator figures on GPU, the process's peak "
            "resident set on CPU",
        "--log-num-zeros-in-grad":
            "count the zero entries of the gradient (iteration line and board)",
        "--log-params-norm":
            "L2 norm of all parameters, each counted once (iteration line and board)",
        "--log-validation-ppl-to-tensorboard":
            "validation perplexity exp(loss) next to each validation loss",
        "--wandb-project str":
            "log the scalars to this Weights & Biases project too (needs wandb)",
        "--wandb-exp-name str": "the W&B run's name",
        "--wandb-entity str": "the W&B team or user",
        "--wandb-save-dir str": "W&B's local files (default: --save/wandb, else wandb)",
    })
