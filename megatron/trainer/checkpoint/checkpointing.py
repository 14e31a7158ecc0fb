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
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import hashlib
import inspect
import logging
import os
import pickle
import queue
import random
import re
import shutil
import signal
import sys
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

from megatron.dpp.transport.channel import brief, peer_failure
from megatron.trainer.checkpoint import checkpoint_files, checkpoint_trust, torch_checkpoint
from megatron.trainer.checkpoint.checkpoint_config import CheckpointConfig
from megatron.trainer.core_compat import core_overrides

log = logging.getLogger(__name__)

POINTER = "latest_checkpointed_iteration.txt"
INTEGRITY_MANIFEST = "integrity.sha256"  # --verify-integrity
# Less free space than this after a failed write means the disk filled up (a write that
# fails for want of space first fills the filesystem to the last block).
FULL_DISK_BYTES = 1 << 20
# Linux system interfaces Python's os module lacks: renameat2 and prctl
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_PR_SET_PDEATHSIG = 1
# the names this module gives checkpoint directories: the only ones it ever deletes
_ITERATION_DIRECTORY = re.compile(r"iter_\d{7}")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be read or written; the message names the path and the cause."""


@dataclass
class TrainingState:
    iteration: int = 0
    consumed_samples: int = 0
    skipped_iterations: int = 0


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def _optimizer_metadata(config: CheckpointConfig) -> dict:
    sharding = config.optimizer_sharding
    return {} if sharding is None else {"distrib_optim_sharding_type": sharding}


def _chunk_keys(model) -> list[str]:
    """The checkpoint's key of each model chunk (Megatron-LM's names)."""
    return ["model"] if len(model) == 1 else [f"model{index}" for index in range(len(model))]


def _sharded_state(model, optimizer, scheduler, state, metadata: dict, loading: bool,
                   with_rng: bool = True) -> dict:
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
    if with_rng:
        sharded["rng_state"] = _rng_sharded_object()
    sharded["training_state"] = vars(state).copy()
    sharded["checkpoint_version"] = 1
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
    return "no layout" if layout is None else "PP {} x TP {} x DP {}".format(*layout)


def _rng_sharded_object() -> ShardedObject:
    """Each rank's RNG state, keyed by its (pipeline, tensor, data) coordinates."""
    coords = (
        parallel_state.get_pipeline_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_data_parallel_rank(with_context_parallel=True),
    )
    return ShardedObject(checkpoint_files.RNG_KEY, _rng_state(), _rng_layout(), coords, replica_id=0)


def _rng_restorable(path: str, config: CheckpointConfig) -> bool:
    """Whether to load the RNG states: asked for, and saved in this run's parallel layout
    (each rank's own state; at another layout there is none that belongs to a rank, and the
    run goes on with its own seeds, as Megatron-LM's)."""
    if not config.load_rng or config.finetune:
        return False
    saved = checkpoint_files.saved_rng_layout(path)
    current = _rng_layout()
    if saved == current:
        return True
    log.info("%s: its RNG states are not restored: saved at %s, this run is %s (the seeds of "
             "--seed continue instead)", path, _layout_text(saved), _layout_text(current))
    return False


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
    if config.run_args is not None:
        sharded["args"] = config.run_args  # common state: written once, by rank 0
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


@contextlib.contextmanager
def _write_errors_raised():
    """megatron-core >= 0.17 writes a rank's last bucket (with one writer thread, all of
    it) in the writer itself, and reports the OSError that write returns as an assertion on
    its type: errno and text are lost. Raised instead, megatron-core's error carries its
    text. Writes in threads (and 0.16's processes) hand theirs over their queue as before."""
    write = core_overrides.WRITE_BUCKET.resolve()
    with core_overrides.WRITE_BUCKET.swapped(
            staticmethod(functools.partial(_write_raising_its_error, write))):
        yield


def _write_raising_its_error(write, *args, **kwargs):
    output = write(*args, **kwargs)
    if kwargs.get("results_queue") is None and isinstance(output, tuple) and isinstance(
            output[-1], Exception):
        raise output[-1]
    return output


def _writing_with_errors_raised(write_buckets, *args, **kwargs):
    """The writer process's work: its error goes to the rank's CheckpointError, not its log."""
    with _write_errors_raised(), _writer_errors_raised_not_logged():
        return write_buckets(*args, **kwargs)


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


def _remove_stale_staging(root: str) -> None:
    """Staging directories a crashed save left behind (`iter_N.tmp`): partial checkpoints,
    or a re-saved iteration's previous copy. Never another job's save in progress: --save
    is this job's alone (megatron/trainer/checkpoint/save_directory.py)."""
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if name.startswith("iter_") and name.endswith(".tmp") and os.path.isdir(path):
            log.info("removing %s, left by a save that did not finish", path)
            shutil.rmtree(path)


def _publish(root: str, staging: str, final: str, iteration: int, config: CheckpointConfig,
             non_persistent: bool) -> None:
    """Publish the complete checkpoint (`_move_into_place`), then delete what the flags
    say is no longer kept: the previous checkpoint unless --save-retain-interval retains it
    (Megatron-LM's rule), or every older non-persistent checkpoint."""
    previous = latest_iteration(root)
    if config.verify_integrity:
        write_integrity_manifest(staging)
    _move_into_place(root, staging, final, iteration)
    if non_persistent:
        older = [name for name in os.listdir(root) if _ITERATION_DIRECTORY.fullmatch(name)
                 and name != os.path.basename(final)]
        for name in older:
            _delete_checkpoint(os.path.join(root, name))
    elif (config.retain_interval is not None and previous is not None and previous > 0
          and previous != iteration and previous % config.retain_interval != 0):
        _delete_checkpoint(checkpoint_dir(root, previous))


def _file_digests(path: str) -> dict[str, str]:
    """SHA-256 of every file under `path` but the manifest, by relative path."""
    digests = {}
    for directory, _, names in os.walk(path):
        for name in names:
            full = os.path.join(directory, name)
            relative = os.path.relpath(full, path)
            if relative != INTEGRITY_MANIFEST:
                with open(full, "rb") as handle:
                    digests[relative] = hashlib.file_digest(handle, "sha256").hexdigest()
    return digests


def write_integrity_manifest(path: str) -> None:
    """--verify-integrity at save: one `digest  file` line per file of the checkpoint."""
    lines = [f"{digest}  {name}\n" for name, digest in sorted(_file_digests(path).items())]
    with open(os.path.join(path, INTEGRITY_MANIFEST), "w") as handle:
        handle.writelines(lines)
        handle.flush()
        os.fsync(handle.fileno())


def integrity_problem(path: str) -> str | None:
    """--verify-integrity at load: what differs from the manifest written at save, or None."""
    manifest = os.path.join(path, INTEGRITY_MANIFEST)
    if not os.path.isfile(manifest):
        return f"{path} has no {INTEGRITY_MANIFEST} (saved without --verify-integrity)"
    with open(manifest) as handle:
        expected = dict(reversed(line.rstrip("\n").split("  ", 1)) for line in handle)
    found = _file_digests(path)
    problems = [f"{name}: missing" for name in sorted(expected.keys() - found.keys())]
    problems += [f"{name}: SHA-256 differs from the manifest" for name in sorted(expected)
                 if name in found and found[name] != expected[name]]
    problems += [f"{name}: not in the manifest" for name in sorted(found.keys() - expected.keys())]
    if not problems:
        return None
    return f"{path} fails --verify-integrity: " + "; ".join(problems[:5]) + (
        f" (and {len(problems) - 5} more)" if len(problems) > 5 else "")


def _raise_on_rank0_verdict(path: str, find_problem) -> None:
    """Rank 0 looks at the checkpoint's files (`find_problem(path)`: a message or None);
    every rank raises its verdict, so that all stop together."""
    problem = [find_problem(path) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(problem, src=0)
    if problem[0] is not None:
        raise CheckpointError(problem[0])


def _verify_on_rank0(path: str) -> None:
    """Rank 0 re-hashes the checkpoint; every rank raises its verdict."""
    _raise_on_rank0_verdict(path, integrity_problem)
    log.info("%s: every file matches its SHA-256 in %s", path, INTEGRITY_MANIFEST)


def _delete_checkpoint(path: str) -> None:
    """One of our own iteration directories (a symbolic link is left alone, as in
    Megatron-LM); a failure is logged, the run goes on."""
    if os.path.islink(path) or not os.path.isdir(path):
        return
    try:
        shutil.rmtree(path)
    except OSError as error:
        log.warning("could not delete the old checkpoint %s: %s", path, error)
    else:
        log.info("deleted the old checkpoint %s", path)


def _move_into_place(root: str, staging: str, final: str, iteration: int) -> None:
    """Move the complete checkpoint `staging` to `final` and point at it. An existing
    `final` (the same iteration saved again) is swapped out atomically and then deleted;
    a crash in between leaves it under the staging name, which the next save removes."""
    if not os.path.isdir(final):
        os.replace(staging, final)
    elif _exchange(staging, final):
        _write_pointer(root, iteration)
        shutil.rmtree(staging)
        return
    else:
        log.warning("%s cannot swap directories atomically (renameat2 RENAME_EXCHANGE): "
                    "replacing %s with two renames", root, final)
        previous = final + ".old"
        if os.path.isdir(previous):
            shutil.rmtree(previous)
        os.replace(final, previous)
        os.replace(staging, final)
        shutil.rmtree(previous)
    _write_pointer(root, iteration)


def _exchange(first: str, second: str) -> bool:
    """Swap two directories atomically (Linux renameat2); False where the C library, the
    kernel or the filesystem cannot."""
    renameat2 = getattr(_LIBC, "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second),
                 _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EXDEV):
        return False
    raise OSError(code, f"renameat2(RENAME_EXCHANGE) of {first} and {second}: "
                        f"{os.strerror(code)}")


def _save_failed(error: BaseException, root: str, staging: str, iteration: int,
                 rank0: bool) -> CheckpointError:
    """The one-line error for a failed save (after removing the partial checkpoint)."""
    free = _free_bytes(staging)
    full = _no_space_left(error) or (free is not None and free < FULL_DISK_BYTES)
    removed = _remove_partial(staging, rank0)
    if full:
        where = "" if free is None else f" ({free} bytes free there)"
        message = (f"No space left on device saving checkpoint iteration {iteration} to "
                   f"{staging}{where}")
    else:
        message = (f"saving checkpoint iteration {iteration} to {staging} failed: "
                   f"{_describe(error)}")
    if removed:
        message += "; removed the partial checkpoint"
    with contextlib.suppress(OSError, CheckpointError):
        latest = latest_iteration(root)
        if latest is not None:
            message += f"; {os.path.join(root, POINTER)} names iteration {latest}"
    return CheckpointError(message)


def _remove_partial(staging: str, rank0: bool) -> bool:
    """Rank 0 made the staging directory and removes it; True when it did."""
    if not rank0 or not os.path.isdir(staging):
        return False
    shutil.rmtree(staging, ignore_errors=True)
    return not os.path.exists(staging)


def _free_bytes(path: str) -> int | None:
    """Free bytes on the filesystem of `path` (or of its nearest existing parent) for
    this process (root may use the blocks reserved for it)."""
    while path and not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            return None
        path = parent
    try:
        stats = os.statvfs(path or ".")
    except OSError:
        return None
    blocks = stats.f_bfree if os.geteuid() == 0 else stats.f_bavail
    return blocks * stats.f_frsize


def _causes(error: BaseException):
    """`error`, its causes and contexts, and the per-rank errors a CheckpointException
    carries."""
    seen, pending = set(), [error]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        pending += [current.__cause__, current.__context__]
        if isinstance(current, CheckpointException):
            pending += [wrapped[0] for wrapped in current.failures.values()]


def _no_space_left(error: BaseException) -> bool:
    return any((isinstance(e, OSError) and e.errno == errno.ENOSPC)
               or os.strerror(errno.ENOSPC) in str(e) for e in _causes(error))


def _describe(error: BaseException) -> str:
    if isinstance(error, CheckpointException):
        if not error.failures:
            return "the write failed on another rank (its error says why)"
        return "; ".join(f"rank {rank}: {type(e).__name__}: {brief(e)}"
                         for rank, (e, _) in sorted(error.failures.items()))
    if peer_failure(error):
        return f"a peer rank failed or disconnected ({brief(error)})"
    return f"{type(error).__name__}: {brief(error)}"


@contextlib.contextmanager
def _writer_errors_raised_not_logged():
    """megatron.core logs a writer's error and raises it too; the CheckpointError carries
    it (one line per rank), so below DEBUG its log stays quiet during the save."""
    logger = logging.getLogger("megatron.core.dist_checkpointing")
    if logger.isEnabledFor(logging.DEBUG):
        yield
        return
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _use_results_queue(results) -> None:
    """megatron.core hands its writers' results over a queue of a multiprocessing Manager
    that it spawns on the first save and keeps: a server process (~270 MB) that outlives
    a killed rank, and keeps a resource tracker alive. A synchronous save puts and gets
    those results in this process, so a plain queue serves (and starts nothing); the
    asynchronous saves bring their own (Checkpointer._async_results_queue)."""
    owner, name = core_overrides.WRITE_RESULTS_QUEUE.owner_and_name()
    setattr(owner, name, results)  # declared, so verified to exist at start-up


class ForkedChildren:
    """While `die_with_this_process()` is active, every process forked from this one (the
    checkpoint writers megatron.core forks per save) gets SIGKILL when this process dies
    (Linux PR_SET_PDEATHSIG; the signal follows the forking thread, here the main one),
    and ignores SIGINT: Ctrl-C is this rank's to handle. Without it a writer of a rank
    killed mid-save stays blocked on a queue lock of the dead rank."""

    def __init__(self):
        self.parent_pid = 0
        if _LIBC is not None:
            os.register_at_fork(after_in_child=self._after_fork_in_child)

    @contextlib.contextmanager
    def die_with_this_process(self):
        self.parent_pid = os.getpid()
        try:
            yield
        finally:
            self.parent_pid = 0

    def _after_fork_in_child(self) -> None:
        if self.parent_pid == 0:
            return
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != self.parent_pid:  # the parent died before prctl took effect
            os._exit(1)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        self.parent_pid = os.getpid()  # and its own children die with it


WRITER_CHILDREN = ForkedChildren()


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
        _restore_rng(loaded["rng_state"])
    state = TrainingState(**loaded["training_state"])
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
    try:
        metadata = dist_checkpointing.load_content_metadata(path)
    except Exception as error:
        common = os.path.join(path, checkpoint_files.COMMON_FILE)
        raise CheckpointError(f"{common} is unreadable: {type(error).__name__}: "
                              f"{brief(error)}") from error
    if metadata is None:  # written before the metadata was stored: the flags' layout
        metadata = _optimizer_metadata(config)
    if optimizer is not None and config.distributed_optimizer:
        _create_adam_states(optimizer)
    sharded = _sharded_state(model, optimizer, scheduler, TrainingState(), metadata, True,
                             with_rng=_rng_restorable(path, config))
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


def _saved_args(path: str) -> dict | None:
    """The flags saved in the checkpoint's common state, where they can be read."""
    try:
        saved = dist_checkpointing.load_common_state_dict(path).get("args")
    except Exception:  # the load failed already: its error is the one reported
        return None
    return vars(saved) if hasattr(saved, "__dict__") else saved


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
