"""Typed, frozen configurations of the trainer's components, built once from the parsed
flags (`from_args`); a component reads its own configuration, not the argparse Namespace.

So far: logging (TensorBoard, W&B, timers) and the tokenizer.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WandbConfig:
    project: str
    exp_name: str
    entity: str | None
    save_dir: str


@dataclass(frozen=True)
class LoggingConfig:
    """What the reporting rank writes at each log interval and after each validation."""

    interval: int
    tensorboard_dir: str | None
    throughput: bool
    timing_level: int  # timers recorded: 0 iteration time, 1 + phases, 2 + per-microbatch
    timers_to_tensorboard: bool
    memory_to_tensorboard: bool
    num_zeros_in_grad: bool
    params_norm: bool
    validation_ppl: bool
    wandb: WandbConfig | None

    @property
    def writes_scalars(self) -> bool:
        return self.tensorboard_dir is not None or self.wandb is not None

    @classmethod
    def from_args(cls, args) -> LoggingConfig:
        wandb = None
        if args.wandb_project:
            # Megatron-LM's default place for W&B's files
            save_dir = args.wandb_save_dir or (
                os.path.join(args.save, "wandb") if args.save else "wandb")
            wandb = WandbConfig(args.wandb_project, args.wandb_exp_name, args.wandb_entity,
                                save_dir)
        return cls(
            interval=args.log_interval,
            tensorboard_dir=args.tensorboard_dir,
            throughput=args.log_throughput,
            timing_level=args.timing_log_level,
            timers_to_tensorboard=args.log_timers_to_tensorboard,
            memory_to_tensorboard=args.log_memory_to_tensorboard,
            num_zeros_in_grad=args.log_num_zeros_in_grad,
            params_norm=args.log_params_norm,
            validation_ppl=args.log_validation_ppl_to_tensorboard,
            wandb=wandb,
        )


@dataclass(frozen=True)
class TokenizerConfig:
    """--tokenizer-type (after the per-model default) and the files it reads."""

    tokenizer_type: str
    vocab_file: str | None = None
    merge_file: str | None = None
    tokenizer_model: str | None = None
    vocab_size: int | None = None
    # tokens the run needs (--fim-data's sentinels): added where the tokenizer can add
    # tokens (GPT-2 BPE, HF), else the model must hold them
    special_tokens: tuple[str, ...] = ()

    @classmethod
    def from_args(cls, args) -> TokenizerConfig:
        from megatron.trainer.data.fim import FimConfig

        fim = FimConfig.from_args(args)
        return cls(args.tokenizer_type, args.vocab_file, args.merge_file,
                   args.tokenizer_model, args.vocab_size,
                   fim.sentinels if fim is not None else ())

    def build(self):
        from megatron.trainer.data.tokenizer import build_tokenizer

        tokenizer = build_tokenizer(self.tokenizer_type, vocab_file=self.vocab_file,
                                    merge_file=self.merge_file,
                                    tokenizer_model=self.tokenizer_model,
                                    vocab_size=self.vocab_size)
        added = tokenizer.add_special_tokens(self.special_tokens)
        if added:
            log.info(
                "tokenizer: added %s as ids %s (vocabulary size %d)", " ".join(added),
                " ".join(str(tokenizer.vocab[token]) for token in added), tokenizer.vocab_size)
        return tokenizer
