"""Checkpoints through megatron.core.dist_checkpointing, written atomically.

Layout under --save: `iter_0000010/` (one directory per checkpoint) and
`latest_checkpointed_iteration.txt`. A checkpoint is first written to `iter_0000010.tmp`
and renamed into place only when every rank has finished, and the pointer file is replaced
atomically, so a crash never leaves a half-written checkpoint under a final name.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.utils import unwrap_model

log = logging.getLogger(__name__)

POINTER = "latest_checkpointed_iteration.txt"


class CheckpointError(RuntimeError):
    pass


@dataclass
class TrainingState:
    iteration: int = 0
    consumed_samples: int = 0
    skipped_iterations: int = 0


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def _optimizer_metadata(args) -> dict:
    return {"distrib_optim_sharding_type": "dp_reshardable"} if args.use_distributed_optimizer else {}


def _chunk_keys(model) -> list[str]:
    """The checkpoint's key of each model chunk (Megatron-LM's names)."""
    return ["model"] if len(model) == 1 else [f"model{index}" for index in range(len(model))]


def _sharded_state(model, optimizer, scheduler, state, args, loading: bool) -> dict:
    # the bare models (no DDP / Float16Module wrapper): their keys are what load_state_dict
    # expects and do not change with the precision
    model = unwrap_model(model)
    sharded = {}
    for key, chunk in zip(_chunk_keys(model), model, strict=True):
        sharded[key] = chunk.sharded_state_dict()
    if optimizer is not None:
        # the optimizer finds its parameters among the chunks' sharded tensors; each chunk
        # keeps its own dict (their local names repeat: every chunk numbers its layers from 0)
        model_sharded = {key: sharded[key] for key in _chunk_keys(model)}
        sharded["optimizer"] = optimizer.sharded_state_dict(
            model_sharded, is_loading=loading, metadata=_optimizer_metadata(args)
        )
    if scheduler is not None:
        sharded["opt_param_scheduler"] = scheduler.state_dict()
    sharded["rng_state"] = _rng_sharded_object()
    sharded["training_state"] = vars(state).copy()
    sharded["checkpoint_version"] = 1
    return sharded


def _rng_sharded_object() -> ShardedObject:
    """Each rank's RNG state, keyed by its (pipeline, tensor, data) coordinates."""
    rng = {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    coords = (
        parallel_state.get_pipeline_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_data_parallel_rank(with_context_parallel=True),
    )
    shape = (
        parallel_state.get_pipeline_model_parallel_world_size(),
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_data_parallel_world_size(with_context_parallel=True),
    )
    return ShardedObject("rng_state", rng, shape, coords, replica_id=0)


def save_checkpoint(root: str, model, optimizer, scheduler, state: TrainingState, args) -> str:
    _require_psutil()
    final = checkpoint_dir(root, state.iteration)
    staging = final + ".tmp"
    rank0 = dist.get_rank() == 0
    if rank0:
        os.makedirs(root, exist_ok=True)
        # only this job's own staging name for this iteration, left by an earlier crash
        if os.path.isdir(staging):
            shutil.rmtree(staging)
        os.makedirs(staging)
    dist.barrier()
    no_optim = args.no_save_optim
    sharded = _sharded_state(model, None if no_optim else optimizer, scheduler, state, args, False)
    dist_checkpointing.save(sharded, staging)
    dist.barrier()
    if rank0:
        if os.path.isdir(final):
            shutil.rmtree(final)
        os.replace(staging, final)
        _write_pointer(root, state.iteration)
    dist.barrier()
    log.info("saved checkpoint at iteration %d to %s", state.iteration, final)
    return final


def _require_psutil() -> None:
    """dist_checkpointing's writer processes import psutil; without it they die and the
    save waits for them until the job times out, so fail here with the fix instead."""
    try:
        import psutil  # noqa: F401
    except ImportError as error:
        raise CheckpointError("saving checkpoints needs psutil: pip install psutil") from error


def _write_pointer(root: str, iteration: int) -> None:
    tmp = os.path.join(root, POINTER + ".tmp")
    with open(tmp, "w") as handle:
        handle.write(f"{iteration}\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, os.path.join(root, POINTER))


def latest_iteration(root: str) -> int | None:
    pointer = os.path.join(root, POINTER)
    if not os.path.exists(pointer):
        return None
    text = open(pointer).read().strip()
    if not text.isdigit():
        raise CheckpointError(f"{pointer}: expected an iteration number, found {text!r}")
    return int(text)


def load_checkpoint(root: str, model, optimizer, scheduler, args) -> TrainingState:
    """Restore model, optimizer, scheduler, RNG and data position from the latest
    checkpoint under `root`; a fresh TrainingState when there is none."""
    iteration = latest_iteration(root)
    if iteration is None:
        log.warning("no checkpoint under %s (no %s); starting from scratch", root, POINTER)
        return TrainingState()
    path = checkpoint_dir(root, iteration)
    if not os.path.isdir(path):
        raise CheckpointError(f"{root}/{POINTER} names iteration {iteration} but {path} is missing")
    load_optim = optimizer is not None and not args.no_load_optim and not args.finetune
    if load_optim and args.use_distributed_optimizer:
        _create_adam_states(optimizer)
    with torch.no_grad():
        sharded = _sharded_state(
            model, optimizer if load_optim else None, scheduler, TrainingState(), args, True
        )
        loaded = dist_checkpointing.load(sharded, path)
        for key, chunk in zip(_chunk_keys(model), unwrap_model(model), strict=True):
            chunk.load_state_dict(loaded[key])
        # in no_grad: the distributed optimizer copies into views of the parameters
        if load_optim:
            optimizer.load_state_dict(loaded["optimizer"])
            if args.use_distributed_optimizer:
                _restore_adam_steps(optimizer)
            if scheduler is not None:
                scheduler.load_state_dict(loaded["opt_param_scheduler"])
    if not args.no_load_rng and not args.finetune:
        _restore_rng(loaded["rng_state"])
    state = TrainingState(**loaded["training_state"])
    if args.finetune:
        state = TrainingState()
    log.info("loaded checkpoint %s (iteration %d)", path, iteration)
    return state


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
                if "step" in adam.state[param]:
                    adam.state[param]["step"] = torch.tensor(float(group["step"]))


def _restore_rng(rng: dict) -> None:
    random.setstate(rng["random"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(rng["tracker"])
