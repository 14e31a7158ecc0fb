"""A loaded checkpoint's schedule checked; its optimizer state, Adam steps and RNG restored."""

from __future__ import annotations

import random

import numpy as np
import torch
from megatron.core import tensor_parallel

from megatron.trainer.checkpoint.checkpoint_publish import CheckpointError

# the scheduler's settings a checkpoint holds, and the flags that set them
_SCHEDULE_SETTINGS = (
    ("max_lr", "--lr"), ("min_lr", "--min-lr"),
    ("lr_warmup_steps", "--lr-warmup-iters/-samples/-fraction (in samples)"),
    ("lr_decay_steps", "--lr-decay-iters/-samples or --train-iters (in samples)"),
    ("lr_decay_style", "--lr-decay-style"), ("start_wd", "--start-weight-decay"),
    ("end_wd", "--end-weight-decay"),
    ("wd_incr_steps", "--train-iters x --global-batch-size (weight-decay steps)"),
    ("wd_incr_style", "--weight-decay-incr-style"),
)


def _check_schedule(scheduler, saved: dict, optimizer, saved_optimizer: dict, path: str,
                    source: str | None) -> None:
    """The lr / weight-decay schedule: with neither --use-checkpoint-opt_param-scheduler
    (`source` "checkpoint") nor --override-opt_param-scheduler ("flags") the flags must
    agree with the checkpoint, as in Megatron-LM (the step count always comes from it).
    Checked before the optimizer loads: megatron-core >= 0.19 cannot pair param groups
    whose lr bounds differ, and would fail first without naming the flag."""
    if source is not None:
        return
    differences = [f"{flag} {getattr(scheduler, name)} vs {saved[name]}"
                   for name, flag in _SCHEDULE_SETTINGS
                   if name in saved and getattr(scheduler, name) != saved[name]]
    differences += sorted({
        f"--decoupled-lr/--decoupled-min-lr {_bounds_text(ours)} vs {_bounds_text(theirs)}"
        for ours, theirs in _paired_param_groups(optimizer, saved_optimizer)
        if ours.get("is_decoupled_lr") and _bounds(ours) != _bounds(theirs)})
    if differences:
        raise CheckpointError(
            f"{path}: the lr / weight-decay schedule of the flags differs from the "
            f"checkpoint's ({'; '.join(differences)}): give "
            "--use-checkpoint-opt_param-scheduler to continue the checkpoint's or "
            "--override-opt_param-scheduler to use the flags'")


# megatron-core sets these on each param group from --lr/--min-lr, or for the embedding and
# output layer from --decoupled-lr/--decoupled-min-lr; its scheduler reads them from there
_LR_BOUNDS = ("max_lr", "min_lr")
# what else tells param groups apart (megatron-core's identifier keys of 0.16 and its
# `default_config`: False where an lr is overridden)
_GROUP_STRUCTURE = ("wd_mult", "lr_mult", "is_expert_parallel", "default_config")


def _align_lr_bounds(optimizer, saved_optimizer: dict, source: str | None) -> None:
    """Every megatron-core release loads the saved lr bounds into the param groups, and
    0.19 also pairs current and saved groups by a key that includes them. So before the
    load both sides get the bounds the schedule goes on with: the checkpoint's
    (--use-checkpoint-opt_param-scheduler) or the flags' (otherwise: they agree, or
    --override-opt_param-scheduler asks for them). The saved groups also take this run's
    is_decoupled_lr (optimizer.mark_decoupled_groups; older checkpoints lack it)."""
    for ours, theirs in _paired_param_groups(optimizer, saved_optimizer):
        if "is_decoupled_lr" in ours:
            theirs["is_decoupled_lr"] = ours["is_decoupled_lr"]
        if source == "checkpoint":
            ours.update(_bounds(theirs))
        else:
            theirs.update(_bounds(ours))


def _paired_param_groups(optimizer, saved_optimizer: dict) -> list[tuple[dict, dict]]:
    """This run's and the checkpoint's param groups side by side. megatron-core builds them
    in the same order for the same model, so they pair by position where their number and
    everything but the lr bounds agree; otherwise none are paired (and megatron-core's load
    names the difference)."""
    current, saved = optimizer.param_groups, list(_saved_param_groups(saved_optimizer))
    if len(current) != len(saved):
        return []
    pairs = list(zip(current, saved, strict=True))
    if any(ours.get(key) != theirs.get(key) for ours, theirs in pairs
           for key in _GROUP_STRUCTURE):
        return []
    return pairs


def _bounds(group: dict) -> dict[str, float]:
    return {key: group[key] for key in _LR_BOUNDS if group.get(key) is not None}


def _bounds_text(group: dict) -> str:
    return "/".join(str(group.get(key)) for key in _LR_BOUNDS)


def _saved_param_groups(state):
    """The param groups in an optimizer's saved state, however megatron.core nests it
    (chained, mixed precision, distributed)."""
    if isinstance(state, dict):
        for key, value in state.items():
            if key == "param_groups" and isinstance(value, list):
                yield from (group for group in value if isinstance(group, dict))
            else:
                yield from _saved_param_groups(value)
    elif isinstance(state, list | tuple):
        for value in state:
            yield from _saved_param_groups(value)


def _create_adam_states(optimizer) -> None:
    """torch's Adam creates its per-parameter state on the first step, but the distributed
    optimizer's loading state dict reads `step` from every entry (without TE/apex). Zeros
    as placeholders, replaced by the load; parameters are left untouched."""
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        adam = inner.optimizer
        if not isinstance(adam, torch.optim.Adam | torch.optim.AdamW):
            continue
        for group in adam.param_groups:
            for param in group["params"]:
                state = adam.state[param]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(param)
                    state["exp_avg_sq"] = torch.zeros_like(param)


def _adams(optimizer):
    """The torch Adam / AdamW optimizers inside a megatron.core optimizer."""
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(inner.optimizer, torch.optim.Adam | torch.optim.AdamW):
            yield inner.optimizer


def _drop_adam_steps(optimizer) -> None:
    for adam in _adams(optimizer):
        for state in adam.state.values():
            state.pop("step", None)


def _restore_adam_steps(optimizer) -> None:
    """The distributed optimizer restores Adam's step count into its param groups, but then
    copies the placeholder `step` of `_create_adam_states` back into every parameter's state,
    and all of them share one tensor (torch's foreach Adam would add 1 per parameter). Give
    each parameter its own step from the param group."""
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        adam = inner.optimizer
        if not isinstance(adam, torch.optim.Adam | torch.optim.AdamW):
            continue
        for group in adam.param_groups:
            if group.get("step") is None:
                continue
            for param in group["params"]:
                if adam.state[param]:
                    adam.state[param]["step"] = torch.tensor(float(group["step"]))


def _restore_rng(rng: dict) -> None:
    random.setstate(rng["random"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(rng["tracker"])
