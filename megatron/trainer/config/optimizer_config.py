"""The optimizer's and the lr / weight-decay schedule's flags as a frozen dataclass, named as
the flags (configs.py's convention), and the schedule's lengths in samples as Megatron
counts them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class OptimizerConfig:
    """megatron-core's optimizer (Adam / SGD, gradient clipping, --decoupled-lr's own groups),
    its DDP wrapping's reduction and gather options, and the lr / weight-decay schedule."""

    optimizer: str
    lr: float | None
    min_lr: float
    decoupled_lr: float | None  # the embedding's and the output layer's own lr
    decoupled_min_lr: float | None
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    adam_eps: float
    sgd_momentum: float
    clip_grad: float
    lr_decay_iters: int | None
    lr_decay_samples: int | None
    lr_decay_style: str
    lr_warmup_fraction: float | None
    lr_warmup_samples: int
    lr_warmup_iters: int
    lr_warmup_init: float
    start_weight_decay: float | None
    end_weight_decay: float | None
    weight_decay_incr_style: str
    use_checkpoint_opt_param_scheduler: bool
    override_opt_param_scheduler: bool
    overlap_param_gather_with_optimizer_step: bool
    ddp_average_in_collective: bool
    disable_gloo_process_groups: bool

    @classmethod
    def from_args(cls, args) -> OptimizerConfig:
        return cls(**{flag.name: getattr(args, flag.name) for flag in dataclasses.fields(cls)})

    def schedule_samples(self, global_batch_size: int, train_iters: int) -> tuple[int, int]:
        """(warm-up, decay) lengths in samples: steps are counted in samples, as in Megatron,
        so a batch-size ramp-up keeps the lr schedule in place."""
        decay_iters = self.lr_decay_iters or train_iters
        decay_samples = self.lr_decay_samples or decay_iters * global_batch_size
        if self.lr_warmup_fraction is not None:
            return int(self.lr_warmup_fraction * decay_samples), decay_samples
        return (self.lr_warmup_samples or self.lr_warmup_iters * global_batch_size,
                decay_samples)
