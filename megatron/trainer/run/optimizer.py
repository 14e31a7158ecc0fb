"""Model wrapping (mixed precision, DDP), megatron.core's optimizer and lr/wd scheduler, from
the run's typed configurations (`configs`, config/configs.py's TrainerConfigs)."""

from __future__ import annotations

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer.module import Float16Module


def wrap_model_chunks(chunks, configs, config, device) -> list[torch.nn.Module]:
    """Move to the device, cast for fp16/bf16, wrap in megatron.core's DDP (which owns the
    contiguous gradient buffers, also at data-parallel size 1)."""
    parallel, precision = configs.parallel, configs.precision
    wrapped = []
    ddp_config = DistributedDataParallelConfig(
        **{name: getattr(parallel, name) for name in (
            "overlap_grad_reduce", "overlap_param_gather", "use_distributed_optimizer",
            "num_distributed_optimizer_instances")},
        grad_reduce_in_fp32=precision.accumulate_allreduce_grads_in_fp32,
        average_in_collective=configs.optimizer.ddp_average_in_collective,
        # through the rerun state machine of --rerun-mode (reruns.py)
        check_for_nan_in_grad=configs.reruns.checks_gradients,
        bucket_size=None,
    )
    for index, chunk in enumerate(chunks):
        chunk.to(device)
        if precision.fp16 or precision.bf16:
            chunk = Float16Module(config, chunk)
        chunk = DistributedDataParallel(
            config=config,
            ddp_config=ddp_config,
            module=chunk,
            # the first chunk's all-gather starts in the optimizer step, all of it at once
            disable_bucketing=(index > 0
                               or configs.optimizer.overlap_param_gather_with_optimizer_step),
        )
        chunk.broadcast_params()
        wrapped.append(chunk)
    return wrapped


# OptimizerConfig's fields that take the value of the same name, by topic of `configs`
# (decoupled_lr / decoupled_min_lr: the embedding's and the output layer's own lr,
# megatron-core's param groups)
_OPTIMIZER_FIELDS = {
    "optimizer": ("optimizer", "lr", "min_lr", "decoupled_lr", "decoupled_min_lr",
                  "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "sgd_momentum",
                  "clip_grad", "overlap_param_gather_with_optimizer_step"),
    "logging": ("log_num_zeros_in_grad",),
    "precision": ("fp16", "bf16", "params_dtype", "loss_scale", "initial_loss_scale",
                  "min_loss_scale", "loss_scale_window", "hysteresis"),
    "parallel": ("use_distributed_optimizer", "overlap_param_gather"),
}


def build_optimizer(model_chunks, configs, timers=None):
    """`timers`: megatron-core's optimizer times its phases at level 1 (timers.py)."""
    config = OptimizerConfig(**{name: getattr(getattr(configs, topic), name)
                                for topic, names in _OPTIMIZER_FIELDS.items() for name in names},
                             timers=timers)
    optimizer = get_megatron_optimizer(
        config, model_chunks,
        use_gloo_process_groups=not configs.optimizer.disable_gloo_process_groups)
    if configs.optimizer.decoupled_lr is not None:
        mark_decoupled_groups(optimizer)
    return optimizer


def mark_decoupled_groups(optimizer) -> None:
    """megatron-core gives the embedding and output layer their own param group under
    --decoupled-lr (its only lr override here: `default_config` False) but leaves the
    group's is_decoupled_lr, one of the keys it tells groups apart by on load, False: 0.16
    then paired it with the plain group of the same weight decay and could not load the
    checkpoint; the flag set, saved and current groups pair one to one."""
    for group in optimizer.param_groups:
        if not group.get("default_config", True):
            group["is_decoupled_lr"] = True


def build_scheduler(optimizer, configs) -> OptimizerParamScheduler:
    """Steps are counted in samples, as in Megatron, so a batch-size ramp-up keeps the lr
    schedule in place."""
    flags = configs.optimizer
    gbs, train_iters = configs.schedule.global_batch_size, configs.schedule.train_iters
    warmup_samples, decay_samples = flags.schedule_samples(gbs, train_iters)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=flags.lr_warmup_init,
        max_lr=flags.lr,
        min_lr=flags.min_lr,
        lr_warmup_steps=warmup_samples,
        lr_decay_steps=decay_samples,
        lr_decay_style=flags.lr_decay_style,
        start_wd=flags.start_weight_decay,
        end_wd=flags.end_weight_decay,
        wd_incr_steps=train_iters * gbs,
        wd_incr_style=flags.weight_decay_incr_style,
        # Megatron-LM's defaults: neither, so a checkpoint's schedule must match the flags
        use_checkpoint_opt_param_scheduler=flags.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=flags.override_opt_param_scheduler,
    )
