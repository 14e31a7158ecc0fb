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

What a checkpoint holds is in checkpoint_state.py, loading one in checkpoint_load.py
(restoring the schedule, optimizer steps and RNG in checkpoint_restore.py), publishing a
finished save in checkpoint_publish.py, keeping megatron.core's writer processes in line in
checkpoint_writers.py.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import queue
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelSaveStrategyWrapper,
)
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from megatron.core.utils import unwrap_model
from torch.distributed.checkpoint.api import CheckpointException

from megatron.trainer.checkpoint import checkpoint_state, megatron_lm_format, torch_checkpoint
from megatron.trainer.checkpoint.checkpoint_config import CheckpointConfig
from megatron.trainer.checkpoint.checkpoint_load import load_checkpoint, load_root
from megatron.trainer.checkpoint.checkpoint_publish import (
    POINTER,
    CheckpointError,
    _publish,
    _remove_partial,
    _remove_stale_staging,
    _save_failed,
    checkpoint_dir,
    latest_iteration,
)
from megatron.trainer.checkpoint.checkpoint_state import (
    TrainingState,
    chunk_keys,
    optimizer_metadata,
    rng_state,
)
from megatron.trainer.checkpoint.checkpoint_writers import (
    WRITER_CHILDREN,
    _require_psutil,
    _use_results_queue,
    _write_errors_raised,
    _writer_errors_raised_not_logged,
    _writing_with_errors_raised,
)

# what the trainer and the tools name through this module
__all__ = ["POINTER", "CheckpointConfig", "CheckpointError", "Checkpointer", "TrainingState",
           "checkpoint_dir", "latest_iteration", "load_checkpoint", "save_checkpoint"]

log = logging.getLogger(__name__)


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
                                zip(chunk_keys(model), unwrap_model(model), strict=True)}
                torch_checkpoint.save(staging, model_states, optimizer, scheduler, rng_state(),
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
    metadata = optimizer_metadata(config)
    sharded = checkpoint_state.sharded_state(model, optimizer, scheduler, state, metadata, False)
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
