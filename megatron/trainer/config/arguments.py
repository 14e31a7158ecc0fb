"""Command-line flags with Megatron-LM's names, and their validation.

`parse_args()` returns an argparse Namespace, as Megatron users expect; `validate_args`
fills derived values and stops with one message naming every inconsistent flag. Each
topic's flags and their checks live in args_<topic>.py; this module builds the parser from
them in a fixed group order (docs/flags.md follows it) and runs the checks.
"""

from __future__ import annotations

import argparse
import os
import sys

from megatron.trainer.config.args_checkpoint import (
    add_checkpoint_args,
    add_checkpoint_args_and_eval_args,
    apply_checkpoint_args,
    validate_checkpoint_args_and_eval,
    validate_checkpointing,
)
from megatron.trainer.config.args_common import (
    ArgumentError,
    cuda_available,
    is_number,
    one_line,
)
from megatron.trainer.config.args_data import (
    add_fim_args,
    add_variable_length_args,
    data_args,
    validate_data,
    validate_fim,
    validate_variable_lengths,
)
from megatron.trainer.config.args_dpp import (
    dpp_args,
    fast_path_args,
    resolve_fast_path,
    validate_cuda_graphs,
    validate_dpp,
)
from megatron.trainer.config.args_emulation import emulation_args, validate_emulation
from megatron.trainer.config.args_logging import add_logging_args, io_args, validate_trace
from megatron.trainer.config.args_megatron_lm import (
    add_megatron_lm_args,
    add_rerun_args,
    resolve_megatron_lm_aliases,
    validate_megatron_lm_flags,
    validate_reruns,
)
from megatron.trainer.config.args_model import (
    add_embedding_wgrad_args,
    add_mla_args,
    model_args,
    precision_args,
    validate_embedding_wgrad,
    validate_mla,
    validate_precision,
)
from megatron.trainer.config.args_parallel import (
    add_core_extras_args,
    parallel_args,
    validate_core_extras,
    validate_virtual_pipeline,
)
from megatron.trainer.config.args_training import (
    add_batch_schedule_args,
    batch_and_schedule_args,
    resolve_step_batch_schedule,
    validate_batch,
    validate_microbatches,
    validate_schedule,
    validate_step_batch_schedule,
)
from megatron.trainer.config.configs import LoggingConfig, ModelConfig, ParallelConfig


class FlagParser(argparse.ArgumentParser):
    """argparse's own errors (a value of the wrong type, a missing value) as ArgumentError:
    one line naming the flag, which the entry points print once per rank and the launch
    scripts once per job, instead of the whole usage on every rank."""

    def error(self, message):
        raise ArgumentError(f"{message} (--help lists the flags)")


def build_parser(extra_args_provider=None) -> argparse.ArgumentParser:
    parser = FlagParser(
        description="MegatronDPP trainer", allow_abbrev=False, conflict_handler="error"
    )
    model_args(parser.add_argument_group("model"))
    batch_and_schedule_args(parser.add_argument_group("training"))
    precision_args(parser.add_argument_group("precision"))
    parallel_args(parser.add_argument_group("parallelism"))
    data_args(parser.add_argument_group("data"))
    io_args(parser.add_argument_group("checkpoints and logging"))
    add_checkpoint_args(parser.add_argument_group("checkpoint format and behaviour"))
    dpp_args(parser.add_argument_group("dynamic pipeline (DPP)"))
    fast_path_args(parser.add_argument_group("fast path defaults (fast_path.py)"))
    emulation_args(parser.add_argument_group("emulated links and stragglers (docs/two_pods.md)"))
    add_logging_args(parser.add_argument_group("logging: TensorBoard and W&B"))
    add_megatron_lm_args(parser.add_argument_group("further Megatron-LM flags"))
    add_variable_length_args(parser)
    add_batch_schedule_args(parser.add_argument_group("step batch-size schedule"))
    add_core_extras_args(parser.add_argument_group(
        "megatron-core settings and checks of Megatron-LM's functional tests"))
    add_fim_args(parser.add_argument_group("fill-in-the-middle data (GPT)"))
    add_rerun_args(parser.add_argument_group("rerun state machine (result validation)"))
    add_checkpoint_args_and_eval_args(parser.add_argument_group(
        "checkpoint arguments, format detection and evaluation batch size"))
    add_embedding_wgrad_args(parser.add_argument_group("deferred output-layer weight gradients"))
    add_mla_args(parser.add_argument_group("multi-latent attention (MLA)"))
    if extra_args_provider is not None:
        extra_args_provider(parser)
    return parser


def parse_args(argv=None, extra_args_provider=None, world_size=None,
               model: str = "gpt") -> argparse.Namespace:
    """`model` ("gpt" or "bert", the entry point) picks the defaults that differ by model,
    as Megatron-LM's pretrain_gpt.py and pretrain_bert.py do (the tokenizer)."""
    parser = build_parser(extra_args_provider)
    args, unknown = parser.parse_known_args(attach_negative_numbers(argv))
    if unknown:
        raise ArgumentError(f"unknown flags: {' '.join(unknown)}")
    apply_checkpoint_args(args)
    world = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    validate_args(args, world, model)
    return args


def attach_negative_numbers(argv):
    """`--lr -1e-3` as `--lr=-1e-3`: argparse takes a word starting with '-' for a flag
    unless it looks like -1 or -.5, so a value such as -1e-3 would be "expected one
    argument" rather than the range check's message."""
    attached = []
    for word in sys.argv[1:] if argv is None else argv:
        previous = attached[-1] if attached else ""
        if (word.startswith("-") and is_number(word) and previous.startswith("--")
                and "=" not in previous):
            attached[-1] = f"{previous}={word}"
        else:
            attached.append(word)
    return attached


def validate_args(args, world_size: int, model: str = "gpt") -> None:
    """Fill derived values; raise ArgumentError listing every problem found."""
    args.model = model
    _require_model_shape(args)
    _check_ranges(args)
    resolve_fast_path(args)
    problems: list[str] = []

    def need(ok: bool, message: str):
        if not ok:
            problems.append(message)

    tp, pp, cp = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                  args.context_parallel_size)
    args.world_size = world_size
    args.data_parallel_size = max(1, world_size // (tp * pp * cp))
    ParallelConfig.rules(args, need)

    need(args.num_attention_heads % tp == 0,
         f"--tensor-model-parallel-size {tp} does not divide --num-attention-heads "
         f"{args.num_attention_heads}")
    if args.num_query_groups is None or not args.group_query_attention:
        args.num_query_groups = args.num_attention_heads
    need(args.num_attention_heads % args.num_query_groups == 0 and args.num_query_groups % tp == 0,
         f"--num-query-groups {args.num_query_groups} must divide --num-attention-heads "
         f"{args.num_attention_heads} and be divisible by --tensor-model-parallel-size {tp}")
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = (
            int(8 * args.hidden_size / 3 / 64 + 0.999) * 64 if args.swiglu else 4 * args.hidden_size
        )
    if args.kv_channels is None:
        args.kv_channels = args.hidden_size // args.num_attention_heads
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.use_rotary_position_embeddings:
        args.position_embedding_type = "rope"
    ModelConfig.rules(args, need)

    resolve_megatron_lm_aliases(args, need)
    validate_virtual_pipeline(args, need)
    resolve_step_batch_schedule(args, need)
    ramp_sound = validate_batch(args, need)
    validate_precision(args, need)
    validate_schedule(args, need)
    validate_step_batch_schedule(args, need)
    if ramp_sound and args.train_iters is not None:
        validate_microbatches(args, need)
    validate_data(args, need)
    validate_megatron_lm_flags(args, need)
    LoggingConfig.rules(args, need)
    validate_core_extras(args, need)
    validate_reruns(args, need)
    validate_embedding_wgrad(args, need)
    validate_mla(args, need)
    validate_dpp(args, need)
    validate_emulation(args, need)
    validate_variable_lengths(args, need)
    validate_trace(args, need)
    validate_fim(args, need)

    if args.sequence_parallel and tp == 1:
        args.sequence_parallel = False
    if args.recompute_activations:
        args.recompute_granularity = "selective"
    need(args.recompute_granularity != "full" or args.recompute_method is not None,
         "--recompute-granularity full needs --recompute-method uniform|block")
    if args.distributed_backend is None:
        args.distributed_backend = "nccl" if cuda_available() else "gloo"
    need(args.save_interval is None or args.save is not None,
         f"--save-interval {args.save_interval} needs --save DIR")
    validate_cuda_graphs(args, need)
    validate_checkpointing(args, need)
    validate_checkpoint_args_and_eval(args, need)
    if problems:
        raise ArgumentError(one_line(problems))


# flags that take numbers within a range (None, not given, passes)
_AT_LEAST_ONE = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "kv_channels",
    "num_query_groups", "seq_length", "max_position_embeddings", "vocab_size",
    "make_vocab_size_divisible_by", "micro_batch_size", "global_batch_size", "train_iters",
    "train_samples", "lr_decay_iters", "lr_decay_samples", "tensor_model_parallel_size",
    "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
    "num_layers_per_virtual_pipeline_stage", "context_parallel_size", "recompute_num_layers",
    "log_interval", "save_interval", "exit_interval", "hysteresis", "rotary_base",
)


_AT_LEAST_ZERO = (
    "lr", "min_lr", "lr_warmup_iters", "lr_warmup_samples", "lr_warmup_init", "weight_decay",
    "start_weight_decay", "end_weight_decay", "clip_grad", "sgd_momentum", "seed",
    "eval_iters", "eval_interval", "num_workers", "min_loss_scale", "num_tokentypes",
)


_ABOVE_ZERO = (
    "dpp_timeout", "distributed_timeout_minutes", "adam_eps", "norm_epsilon",
    "init_method_std", "initial_loss_scale", "loss_scale", "loss_scale_window",
)


_FROM_ZERO_BELOW_ONE = ("hidden_dropout", "attention_dropout", "adam_beta1", "adam_beta2")


_FROM_ZERO_TO_ONE = ("lr_warmup_fraction", "mask_prob", "short_seq_prob")


def _check_ranges(args) -> None:
    """Numbers outside their range, all named at once, before anything divides by them."""
    problems = []
    for names, ok, wanted in (
        (_AT_LEAST_ONE, lambda v: v >= 1, "must be >= 1"),
        (_AT_LEAST_ZERO, lambda v: v >= 0, "must be >= 0"),
        (_ABOVE_ZERO, lambda v: v > 0, "must be > 0"),
        (_FROM_ZERO_BELOW_ONE, lambda v: 0 <= v < 1, "must be in [0, 1)"),
        (_FROM_ZERO_TO_ONE, lambda v: 0 <= v <= 1, "must be in [0, 1]"),
    ):
        for name in names:
            value = getattr(args, name)
            if value is not None and not ok(value):
                problems.append(f"--{name.replace('_', '-')} {value} {wanted}")
    if not 0 < args.rotary_percent <= 1:
        problems.append(f"--rotary-percent {args.rotary_percent} must be in (0, 1]")
    if args.rampup_batch_size is not None and min(args.rampup_batch_size) < 1:
        problems.append(f"--rampup-batch-size {' '.join(map(str, args.rampup_batch_size))}: "
                        "start, increment and samples must be >= 1")
    # numpy seeds each pipeline stage with --seed + 100 x its rank (initialize.set_seeds)
    top = 2**32 - 100 * args.pipeline_model_parallel_size
    if args.seed >= top:
        problems.append(f"--seed {args.seed} must be below {top} (numpy's seeds are 32-bit, and "
                        "each pipeline stage adds 100 x its rank)")
    if problems:
        raise ArgumentError(one_line(problems))


# without --use-checkpoint-args the command line must give these (Megatron-LM checks them in
# validation too, so that a checkpoint can supply them)
_MODEL_SHAPE_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "seq_length")


def _require_model_shape(args) -> None:
    missing = [f"--{name.replace('_', '-')}" for name in _MODEL_SHAPE_FLAGS
               if getattr(args, name) is None]
    if missing:
        source = (f" (--use-checkpoint-args found no checkpoint holding them under --load "
                  f"{args.load})" if args.use_checkpoint_args and args.load else
                  " (or --use-checkpoint-args with a --load checkpoint that holds them)")
        raise ArgumentError(f"the following arguments are required: {', '.join(missing)}"
                            + source)
