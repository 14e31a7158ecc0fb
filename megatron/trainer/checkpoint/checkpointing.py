"""Checkpoints through megatron.core.dist_checkpointing, written atomically.

Layout under --save: `iter_0000010/` (one directory per checkpoint) and
`latest_checkpointed_iteration.txt`. A checkpoint is first written to `iter_0000010.tmp`
and renamed into place only when every rank has finished, and the pointer file is replaced
atomically, so a crash never leaves a half-written checkpoint under a final name. Saving
an iteration that already has a directory swaps the new one in atomically before the old
one is deleted, so the pointer never names a missing directory. A failed save removes its
partial directory and says why (a full disk by name); the writer processes megatron.core
forks die with their rank.

`Checkpointer` carries a run's CheckpointConfig (the flags,
megatron/trainer/checkpoint/checkpoint_config.py) and its asynchronous saves: with --async-save megatron.core writes in a background process and
the checkpoint is published as above only once every rank's write is done; a save that is
still running when the next one starts, or when the run ends, is waited for first. Older
checkpoints go as --save-retain-interval and non-persistent saves say, never another file.

Publishing a finished save is in checkpoint_publish.py, keeping megatron.core's writer
processes in line in checkpoint_writers.py, restoring the schedule, optimizer steps and RNG
in checkpoint_restore.py.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import pickle
import queue
import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
)
from megatron.core.dist_checkpointing.strategies.torch import (
    TorchDistLoadShardedStrategy,
    TorchDistSaveShardedStrategy,
)
from megatron.core.utils import unwrap_model
from torch.distributed.checkpoint.api import CheckpointException

from megatron.dpp.errors import brief
from megatron.trainer.checkpoint import (
    checkpoint_files,
    checkpoint_trust,
    megatron_lm_format,
    torch_checkpoint,
)
from megatron.trainer.checkpoint.checkpoint_config import CheckpointConfig
from megatron.trainer.checkpoint.checkpoint_publish import (
    POINTER,
    CheckpointError,
    _publish,
    _raise_on_rank0_verdict,
    _remove_partial,
    _remove_stale_staging,
    _save_failed,
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
from megatron.trainer.checkpoint.checkpoint_writers import (
    WRITER_CHILDREN,
    _require_psutil,
    _use_results_queue,
    _write_errors_raised,
    _writer_errors_raised_not_logged,
    _writing_with_errors_raised,
)

log = logging.getLogger(__name__)


@dataclass
class TrainingState:
    iteration: int = 0
    consumed_samples: int = 0
    skipped_iterations: int = 0
    # the model's FLOPs so far (Megatron-LM's num_floating_point_operations_so_far)
    floating_point_operations: float = 0.0


def _optimizer_metadata(config: CheckpointConfig) -> dict:
    sharding = config.optimizer_sharding
    return {} if sharding is None else {"distrib_optim_sharding_type": sharding}


def _chunk_keys(model) -> list[str]:
    """The checkpoint's key of each model chunk (Megatron-LM's names)."""
    return ["model"] if len(model) == 1 else [f"model{index}" for index in range(len(model))]


# how a torch_dist checkpoint holds its RNG states (megatron_lm_format.py)
RNG_MEGATRON_LM = "megatron-lm"  # Megatron-LM's layout, which ours writes
RNG_PER_RANK = "per-rank"  # ours before: each rank's dict at (pipeline, tensor, data)


def _sharded_state(model, optimizer, scheduler, state, metadata: dict, loading: bool,
                   rng: str | None = RNG_MEGATRON_LM) -> dict:
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
            model_sharded, is_loading=loading, metadata=metadata
        )
    if scheduler is not None:
        sharded["opt_param_scheduler"] = scheduler.state_dict()
    if rng == RNG_MEGATRON_LM:
        sharded["rng_state"] = megatron_lm_format.rng_sharded_object(
            None if loading else _rng_state())
    elif rng == RNG_PER_RANK:
        sharded["rng_state"] = _rng_per_rank_object()
    sharded["training_state"] = vars(state).copy()
    return sharded


def _rng_state() -> dict:
    return {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def _rng_layout() -> tuple[int, int, int]:
    """(pipeline, tensor, data)-parallel sizes: the shape the RNG states are saved in."""
    return (parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_data_parallel_world_size(with_context_parallel=True))


def _layout_text(layout: tuple[int, ...] | None) -> str:
    if layout is None:
        return "no layout"
    return "PP {} x TP {} x DP {}".format(*("?" if size is None else size for size in layout))


def _rng_per_rank_object() -> ShardedObject:
    """The request for our earlier layout: each rank's RNG state at its (pipeline, tensor,
    data) coordinates."""
    coords = (
        parallel_state.get_pipeline_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_data_parallel_rank(with_context_parallel=True),
    )
    return ShardedObject(checkpoint_files.RNG_KEY, None, _rng_layout(), coords, replica_id=0)


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
    current = _rng_layout()
    if saved == current:
        return kind
    log.info("%s: its RNG states are not restored: saved at %s, this run is %s (the seeds of "
             "--seed continue instead)", path, _layout_text(saved), _layout_text(current))
    return None


@dataclass(frozen=True)
class _PendingSave:
    """An asynchronous save scheduled but not yet published."""

    root: str
    staging: str
    iteration: int


class Checkpointer:
    """Saves and loads the run's checkpoints as its CheckpointConfig says. Every method is
    called on all ranks (they finish asynchronous saves together)."""

    def __init__(self, config: CheckpointConfig, use_gpu: bool):
        if config.persistent_worker and not use_gpu:
            raise CheckpointError(
                "--use-persistent-ckpt-worker needs a CUDA GPU: megatron-core's worker "
                "process selects a CUDA device when it starts (use --async-save alone)")
        if config.optimizer_sharding == "fully_reshardable" and not _fused_adam_available():
            raise CheckpointError(
                "--dist-ckpt-optim-fully-reshardable needs Apex or Transformer Engine: "
                "megatron-core's fully reshardable optimizer state does not load into torch's "
                "Adam (its per-parameter `step`)")
        self.config = config
        self._calls = AsyncCallsQueue(persistent=config.persistent_worker) \
            if config.async_save else None
        self._pending: _PendingSave | None = None
        self._results = None  # the writers' results queue for asynchronous saves
        self._manager = None
        # kept between saves when the structure is constant: megatron-core caches the plan
        self._save_strategy = _torch_dist_save_strategy(config) \
            if config.assume_constant_structure else None

    def save(self, model, optimizer, scheduler, state: TrainingState,
             non_persistent: bool = False) -> str:
        """Save (or, with --async-save, start saving) iteration `state.iteration`; returns the
        checkpoint's final path."""
        config = self.config
        root = config.non_persistent_dir if non_persistent else config.save
        self.wait()  # one save in flight at a time
        iteration = state.iteration
        _use_results_queue(queue.Queue() if self._calls is None else self._async_results_queue())
        final = _save(root, model, optimizer, scheduler, state, config, non_persistent,
                      self._calls, self._save_strategy)
        if self._calls is not None:
            self._pending = _PendingSave(root, final + ".tmp", iteration)
        return final

    def load(self, model, optimizer, scheduler) -> TrainingState:
        """The latest of --load's checkpoints and, with non-persistent saves, of theirs."""
        return load_checkpoint(load_root(self.config), model, optimizer, scheduler, self.config)

    def poll(self) -> None:
        """Publish an asynchronous save whose writes are done on every rank (no waiting)."""
        self._finalize(blocking=False)

    def wait(self) -> None:
        """Wait for the asynchronous save in flight, if any, and publish it."""
        self._finalize(blocking=True)

    def close(self, failed: bool = False) -> None:
        """After the run: wait for the last save; after an error, stop its writer instead
        (the checkpoint stays unpublished under its staging name)."""
        if self._calls is None:
            return
        try:
            if not failed:
                self.wait()
            self._calls.close(abort=failed)
        finally:
            if self._manager is not None:
                self._manager.shutdown()
                self._manager = None

    def _finalize(self, blocking: bool) -> None:
        pending = self._pending
        if pending is None:
            return
        try:
            with _writer_errors_raised_not_logged():
                done = self._calls.maybe_finalize_async_calls(blocking=blocking)
        except BaseException as error:
            self._pending = None
            if not isinstance(error, Exception | CheckpointException):
                raise
            raise _save_failed(error, pending.root, pending.staging, pending.iteration,
                               dist.get_rank() == 0) from error
        if done:
            self._pending = None

    def _async_results_queue(self):
        """Where the writer processes hand their results to this rank's finalisation: a
        queue the forked temporary worker inherits, or for the spawned persistent worker a
        queue server forked from this rank (so it dies with it)."""
        if self._results is None:
            if self.config.persistent_worker:
                import multiprocessing

                with WRITER_CHILDREN.die_with_this_process():
                    self._manager = multiprocessing.get_context("fork").Manager()
                self._results = self._manager.Queue()
            else:
                import multiprocessing

                self._results = multiprocessing.get_context("fork").Queue()
        return self._results


def load_root(config: CheckpointConfig) -> str:
    """--load, or the non-persistent checkpoints' directory where its latest is newer."""
    root = config.load
    if config.non_persistent_dir is not None:
        persistent = latest_iteration(root)
        non_persistent = latest_iteration(config.non_persistent_dir)
        if non_persistent is not None and (persistent is None or non_persistent >= persistent):
            root = config.non_persistent_dir
    return root


def _fused_adam_available() -> bool:
    from megatron.core.optimizer import distrib_optimizer

    return bool(getattr(distrib_optimizer, "HAVE_APEX_OR_TE", False))


def save_checkpoint(root: str, model, optimizer, scheduler, state: TrainingState,
                    config: CheckpointConfig) -> str:
    """Save synchronously (whatever --async-save says) and publish."""
    _use_results_queue(queue.Queue())
    return _save(root, model, optimizer, scheduler, state, config, False, None)


def _save(root: str, model, optimizer, scheduler, state: TrainingState,
          config: CheckpointConfig, non_persistent: bool, calls: AsyncCallsQueue | None,
          strategy=None) -> str:
    _require_psutil()
    iteration = state.iteration  # the loop goes on while an asynchronous save is written
    final = checkpoint_dir(root, iteration)
    staging = final + ".tmp"
    rank0 = dist.get_rank() == 0
    _refuse_non_finite(model, root, final)
    try:
        if rank0:
            os.makedirs(root, exist_ok=True)
            _remove_stale_staging(root)
            os.makedirs(staging)
        dist.barrier()
        optimizer = optimizer if config.save_optim else None
        with WRITER_CHILDREN.die_with_this_process(), _writer_errors_raised_not_logged():
            if config.format == "torch":
                model_states = {key: chunk.state_dict_for_save_checkpoint() for key, chunk in
                                zip(_chunk_keys(model), unwrap_model(model), strict=True)}
                torch_checkpoint.save(staging, model_states, optimizer, scheduler, _rng_state(),
                                      vars(state).copy(), config.distributed_optimizer,
                                      config.run_args)
                request = None
            else:
                request = _save_torch_dist(staging, model, optimizer, scheduler, state, config,
                                           asynchronous=calls is not None, strategy=strategy)

        def publish():
            dist.barrier()
            if rank0:
                _publish(root, staging, final, iteration, config, non_persistent)
            dist.barrier()
            log.info("saved checkpoint at iteration %d to %s", iteration, final)

        if request is None:
            publish()
        else:
            request.add_finalize_fn(publish)
            if config.async_cpu_shm:
                request = _staged_in_shared_memory(request)
            with WRITER_CHILDREN.die_with_this_process():
                calls.schedule_async_request(request)
            log.info("saving checkpoint at iteration %d to %s in the background",
                     iteration, staging)
    except BaseException as error:
        if not isinstance(error, Exception | CheckpointException):
            _remove_partial(staging, rank0)  # an interrupt: no message of ours
            raise
        raise _save_failed(error, root, staging, iteration, rank0) from error
    return final


def _refuse_non_finite(model, root: str, final: str) -> None:
    """No checkpoint of parameters holding NaN or Inf is published (it would become the
    one to resume from): every rank counts its own, one all-reduce sums them."""
    params = [param for chunk in unwrap_model(model) for param in chunk.parameters()]
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    count = torch.zeros(1, dtype=torch.int64, device=device)
    if params:  # one device sync for all of them
        count += torch.stack([torch.isfinite(p).all() for p in params]).logical_not().sum().to(
            device)
    dist.all_reduce(count)
    if count.item():
        message = (f"not saving {final}: {count.item()} parameter tensors hold NaN or Inf "
                   "(the run diverged)")
        with contextlib.suppress(OSError, CheckpointError):
            latest = latest_iteration(root)
            if latest is not None:
                message += f"; {os.path.join(root, POINTER)} still names iteration {latest}"
        raise CheckpointError(message)


def _save_torch_dist(staging: str, model, optimizer, scheduler, state: TrainingState,
                     config: CheckpointConfig, asynchronous: bool, strategy=None):
    """megatron.core's save; with `asynchronous` the AsyncRequest that writes the shards.
    `strategy`: one kept between saves (--ckpt-assume-constant-structure), else a new one."""
    metadata = _optimizer_metadata(config)
    sharded = _sharded_state(model, optimizer, scheduler, state, metadata, False)
    # common state (written once, by rank 0): what Megatron-LM's trainer reads too
    sharded.update(megatron_lm_format.common_entries(
        state.iteration, state.consumed_samples, state.floating_point_operations,
        config.run_args))
    strategy = strategy or _torch_dist_save_strategy(config)
    options = {}
    if asynchronous and "async_strategy" in _SAVE_PARAMETERS:
        # megatron-core >= 0.17 defaults to NVRx's writer; 0.16 has only its own
        options["async_strategy"] = config.async_strategy
    with contextlib.nullcontext() if asynchronous else _write_errors_raised():
        request = dist_checkpointing.save(
            sharded, staging, strategy, async_sharded_save=asynchronous,
            content_metadata=metadata or None,
            # a constant structure was validated by the first save
            validate_access_integrity=not config.assume_constant_structure, **options)
    if asynchronous and request.async_fn is not None:
        # the writer process (forked, or spawned for the persistent worker) raises them too
        request = request._replace(
            async_fn=functools.partial(_writing_with_errors_raised, request.async_fn))
    return request


def _torch_dist_save_strategy(config: CheckpointConfig):
    """With a constant structure, megatron-core reuses the first save's plan, metadata and
    (fully parallel) shard distribution in later saves by the same strategy object."""
    constant = config.assume_constant_structure
    strategy = TorchDistSaveShardedStrategy("torch_dist", 1, cached_metadata=constant)
    if config.fully_parallel_save:
        strategy = FullyParallelSaveStrategyWrapper(
            strategy, parallel_state.get_data_parallel_group(with_context_parallel=True),
            do_cache_distribution=constant)
    return strategy


_SAVE_PARAMETERS = inspect.signature(dist_checkpointing.save).parameters


def _staged_in_shared_memory(request):
    """--async-ckpt-use-cpu-shm: the request with every tensor it writes copied, here in the
    training process, into CPU shared memory (one segment per tensor: the writer saves a
    tensor's whole storage) and no staging left for the writer process, which then never
    receives a CUDA tensor (megatron-core's persistent worker would otherwise open CUDA IPC
    handles and copy to the host itself)."""
    if request.preload_fn is None:  # nothing to write on this rank
        return request
    rank, buckets, results = request.async_fn_args  # declared: core_overrides.ASYNC_WRITE_BUCKETS
    staged = []
    for filename, storage_key, (bytes_data, tensor_data) in buckets:
        copies = []
        for item, tensor in tensor_data:
            copy = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu").share_memory_()
            copies.append((item, copy.copy_(tensor.detach())))
        staged.append((filename, storage_key, (bytes_data, copies)))
    return request._replace(async_fn_args=[rank, staged, results], preload_fn=None)


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
        for key, chunk in zip(_chunk_keys(model), unwrap_model(model), strict=True):
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
        metadata = _optimizer_metadata(config)
    if optimizer is not None and config.distributed_optimizer:
        _create_adam_states(optimizer)
    sharded = _sharded_state(model, optimizer, scheduler, TrainingState(), metadata, True,
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


