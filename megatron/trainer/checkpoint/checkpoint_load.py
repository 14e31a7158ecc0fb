"""Loading a checkpoint: the latest under --load (or the non-persistent ones'), in whichever
format it was written (ours, torch or torch_dist, or Megatron-LM's), checked before it is
read (trust, integrity, files), with the schedule, optimizer steps and RNG restored
(checkpoint_restore.py)."""

from __future__ import annotations

import functools
import logging
import os
import pickle

import torch
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
)
from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy
from megatron.core.utils import unwrap_model
from torch.distributed.checkpoint.api import CheckpointException

from megatron.dpp.errors import brief
from megatron.trainer.checkpoint import (
    checkpoint_files,
    checkpoint_state,
    checkpoint_trust,
    megatron_lm_format,
    torch_checkpoint,
)
from megatron.trainer.checkpoint.checkpoint_config import CheckpointConfig
from megatron.trainer.checkpoint.checkpoint_publish import (
    POINTER,
    CheckpointError,
    _raise_on_rank0_verdict,
    _verify_on_rank0,
    checkpoint_dir,
    latest_iteration,
)
from megatron.trainer.checkpoint.checkpoint_restore import (
    _align_lr_bounds,
    _check_schedule,
    _create_adam_states,
    _drop_adam_steps,
    _restore_adam_steps,
    _restore_rng,
)
from megatron.trainer.checkpoint.checkpoint_state import (
    RNG_MEGATRON_LM,
    RNG_PER_RANK,
    TrainingState,
    chunk_keys,
    layout_text,
    optimizer_metadata,
    rng_layout,
)

# the checkpoint's log lines under one logger name, loading's as saving's
log = logging.getLogger("megatron.trainer.checkpoint.checkpointing")


def load_root(config: CheckpointConfig) -> str:
    """--load, or the non-persistent checkpoints' directory where its latest is newer."""
    root = config.load
    if config.non_persistent_dir is not None:
        persistent = latest_iteration(root)
        non_persistent = latest_iteration(config.non_persistent_dir)
        if non_persistent is not None and (persistent is None or non_persistent >= persistent):
            root = config.non_persistent_dir
    return root


def load_checkpoint(root: str, model, optimizer, scheduler,
                    config: CheckpointConfig) -> TrainingState:
    """Restore model, optimizer, scheduler, RNG and data position from the latest
    checkpoint under `root`, in whichever format it was saved; a fresh TrainingState when
    there is none."""
    iteration = latest_iteration(root)
    if iteration is None:
        log.warning("no checkpoint under %s (no %s); starting from scratch", root, POINTER)
        return TrainingState()
    path = checkpoint_dir(root, iteration)
    if not os.path.isdir(path):
        raise CheckpointError(f"{root}/{POINTER} names iteration {iteration} but {path} is missing")
    if not config.trust:
        _raise_on_rank0_verdict(path, functools.partial(checkpoint_trust.untrusted_problem, root))
    if config.verify_integrity:
        _verify_on_rank0(path)
    load_optim = optimizer is not None and config.load_optim and not config.finetune
    torch_format = checkpoint_format(path, config) == "torch"
    if not torch_format:
        _raise_on_rank0_verdict(path, checkpoint_files.torch_dist_problem)
    with torch.no_grad():
        sharding = None
        if torch_format:
            loaded = _read_torch_format(path, config.trust)
        else:
            loaded, sharding = _read_torch_dist(path, model, optimizer if load_optim else None,
                                                scheduler, config)
        for key, chunk in zip(chunk_keys(model), unwrap_model(model), strict=True):
            chunk.load_state_dict(loaded[key])
        # in no_grad: the distributed optimizer copies into views of the parameters
        if load_optim:
            # these layouts hold each parameter's Adam moments but not torch Adam's `step`
            # (it is in the param groups), which megatron.core expects: restored below
            if sharding == "fully_reshardable":
                _drop_adam_steps(optimizer)
            source = config.scheduler_source
            if scheduler is None:
                source = "checkpoint"  # nothing to agree with: restored as saved
            else:
                _check_schedule(scheduler, loaded["opt_param_scheduler"], optimizer,
                                loaded["optimizer"], path, source)
            _align_lr_bounds(optimizer, loaded["optimizer"], source)
            optimizer.load_state_dict(loaded["optimizer"])
            if torch_format and config.distributed_optimizer:
                _drop_adam_steps(optimizer)
                torch_checkpoint.load_distributed_optimizer(path, optimizer)
            if config.distributed_optimizer:
                _restore_adam_steps(optimizer)
            if scheduler is not None:
                scheduler.load_state_dict(loaded["opt_param_scheduler"])
    if torch_format and config.load_rng and not config.finetune:
        _restore_rng(torch_checkpoint.rng_state_of_this_rank(loaded))
    elif "rng_state" in loaded:  # torch_dist: requested where its layout is this run's
        _restore_rng(megatron_lm_format.rng_of_this_rank(loaded["rng_state"]))
    if torch_format or not megatron_lm_format.written_by_megatron_lm(loaded):
        state = TrainingState(**loaded["training_state"])
    else:
        state = TrainingState(**megatron_lm_format.training_state(loaded, path))
    if config.finetune:
        state = TrainingState()
    log.info("loaded checkpoint %s (iteration %d)", path, iteration)
    return state


def checkpoint_format(path: str, config: CheckpointConfig) -> str:
    """"torch" or "torch_dist": what the checkpoint at `path` is. As in Megatron-LM,
    --ckpt-format torch reads only torch-format checkpoints unless --auto-detect-ckpt-format
    (torch_dist, the default, reads either)."""
    found = "torch" if torch_checkpoint.is_torch_format(path) else "torch_dist"
    if found != config.format:
        if config.format == "torch" and not config.auto_detect_format:
            raise CheckpointError(
                f"{path} is a torch_dist checkpoint but --ckpt-format torch reads only "
                "torch-format ones: give --auto-detect-ckpt-format (or --ckpt-format "
                "torch_dist)")
        log.info("%s is a %s checkpoint, read as such (--ckpt-format %s is what this run "
                 "saves)", path, found, config.format)
    return found


def _read_torch_format(path: str, trusted: bool) -> dict:
    try:
        return torch_checkpoint.load(path, trusted)
    except pickle.UnpicklingError as error:
        refused = checkpoint_trust.refused_global(error)
        if refused is None:
            raise CheckpointError(f"loading {path} failed: {brief(error)}") from error
        raise CheckpointError(
            f"loading {path}: a file in it holds {refused}, which loading does not build (a "
            "crafted pickle runs code): check the checkpoint and give "
            f"{checkpoint_trust.TRUST_FLAG} to load it anyway") from error
    except (OSError, RuntimeError, EOFError, ValueError) as error:
        raise CheckpointError(f"loading {path} failed: {brief(error)}") from error


def _read_torch_dist(path: str, model, optimizer, scheduler,
                     config: CheckpointConfig) -> tuple[dict, str | None]:
    """megatron.core's load with the flags' strictness and strategy, and the distributed
    optimizer's layout. Its state is requested in the layout it was saved in (the
    checkpoint's content metadata), whatever --dist-ckpt-optim-fully-reshardable says now."""
    common = _read_common_state(path)
    if megatron_lm_format.written_by_megatron_lm(common):
        megatron_lm_format.check_version(common, path)  # before anything is loaded
        log.info("%s was written by Megatron-LM's trainer (checkpoint_version %s, its flags an "
                 "argparse.Namespace): iteration %s and the data position are read from its "
                 "common state", path, common.get("checkpoint_version"), common.get("iteration"))
    metadata = dist_checkpointing.load_content_metadata(preloaded_state_dict=common)
    if metadata is None:  # written before the metadata was stored: the flags' layout
        metadata = optimizer_metadata(config)
    if optimizer is not None and config.distributed_optimizer:
        _create_adam_states(optimizer)
    sharded = checkpoint_state.sharded_state(model, optimizer, scheduler, TrainingState(), metadata, True,
                             rng=_rng_to_restore(path, common, config))
    strategy = TorchDistLoadShardedStrategy()
    if config.fully_parallel_load:
        strategy = FullyParallelLoadStrategyWrapper(
            strategy, parallel_state.get_data_parallel_group(with_context_parallel=True))
    try:
        loaded = dist_checkpointing.load(sharded, path, strategy, strict=config.strictness)
    except (Exception, CheckpointException) as error:
        raise CheckpointError(checkpoint_files.load_failure(
            path, error, config.strictness, _saved_args(path), config.run_args)) from error
    if config.strictness.startswith("return_"):
        loaded, missing, unexpected = loaded
        if missing or unexpected:
            log.warning("%s: keys the model did not ask for (missing): %s; keys it asked for "
                        "that the checkpoint lacks (unexpected): %s", path,
                        sorted(missing) or "none", sorted(unexpected) or "none")
    return loaded, metadata.get("distrib_optim_sharding_type")


def _read_common_state(path: str) -> dict:
    """The checkpoint's common state, read safely (checkpoint_trust.load_common_state)."""
    try:
        return checkpoint_trust.load_common_state(path)
    except checkpoint_trust.CommonStateRefused as error:
        raise CheckpointError(f"loading {path}: {error}") from error
    except Exception as error:
        common = os.path.join(path, checkpoint_files.COMMON_FILE)
        raise CheckpointError(f"{common} is unreadable: {type(error).__name__}: "
                              f"{brief(error)}") from error


def _saved_args(path: str) -> dict | None:
    """The flags saved in the checkpoint's common state, where they can be read."""
    try:
        saved = checkpoint_trust.load_common_state(path).get("args")
    except Exception:  # the load failed already: its error is the one reported
        return None
    return vars(saved) if hasattr(saved, "__dict__") else saved




def _rng_to_restore(path: str, common: dict, config: CheckpointConfig) -> str | None:
    """How to load the RNG states (RNG_MEGATRON_LM, RNG_PER_RANK), or None: when asked for,
    and saved in this run's parallel layout (each rank's own state; at another layout there
    is none that belongs to a rank, and the run goes on with its own seeds, as
    Megatron-LM's, which also skips them)."""
    if not config.load_rng or config.finetune:
        return None
    saved = checkpoint_files.saved_rng_layout(path)
    kind = RNG_PER_RANK
    if saved is not None and len(saved) == 2:  # Megatron-LM's (PP, TP); DP from its flags
        kind, saved = RNG_MEGATRON_LM, (*saved, megatron_lm_format.saved_data_parallel_size(common))
    current = rng_layout()
    if saved == current:
        return kind
    log.info("%s: its RNG states are not restored: saved at %s, this run is %s (the seeds of "
             "--seed continue instead)", path, layout_text(saved), layout_text(current))
    return None
