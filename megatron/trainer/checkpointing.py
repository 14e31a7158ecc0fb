"""Checkpoints through megatron.core.dist_checkpointing, written atomically.

Layout under --save: `iter_0000010/` (one directory per checkpoint) and
`latest_checkpointed_iteration.txt`. A checkpoint is first written to `iter_0000010.tmp`
and renamed into place only when every rank has finished, and the pointer file is replaced
atomically, so a crash never leaves a half-written checkpoint under a final name. Saving
an iteration that already has a directory swaps the new one in atomically before the old
one is deleted, so the pointer never names a missing directory. A failed save removes its
partial directory and says why (a full disk by name); the writer processes megatron.core
forks die with their rank.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import queue
import random
import shutil
import signal
import sys
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.utils import unwrap_model
from torch.distributed.checkpoint.api import CheckpointException

from megatron.dpp.transport.channel import brief, peer_failure
from megatron.trainer import core_overrides

log = logging.getLogger(__name__)

POINTER = "latest_checkpointed_iteration.txt"
# Less free space than this after a failed write means the disk filled up (a write that
# fails for want of space first fills the filesystem to the last block).
FULL_DISK_BYTES = 1 << 20
# Linux system interfaces Python's os module lacks: renameat2 and prctl
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_PR_SET_PDEATHSIG = 1


class CheckpointError(RuntimeError):
    """A checkpoint cannot be read or written; the message names the path and the cause."""


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
    try:
        if rank0:
            os.makedirs(root, exist_ok=True)
            _remove_stale_staging(root)
            os.makedirs(staging)
        dist.barrier()
        no_optim = args.no_save_optim
        sharded = _sharded_state(model, None if no_optim else optimizer, scheduler, state, args,
                                 False)
        _keep_write_results_in_process()
        with WRITER_CHILDREN.die_with_this_process(), _writer_errors_raised_not_logged():
            dist_checkpointing.save(sharded, staging)
        dist.barrier()
        if rank0:
            _publish(root, staging, final, state.iteration)
        dist.barrier()
    except BaseException as error:
        if not isinstance(error, Exception | CheckpointException):
            _remove_partial(staging, rank0)  # an interrupt: no message of ours
            raise
        raise _save_failed(error, root, staging, state.iteration, rank0) from error
    log.info("saved checkpoint at iteration %d to %s", state.iteration, final)
    return final


def _remove_stale_staging(root: str) -> None:
    """Staging directories a crashed save left behind (`iter_N.tmp`): partial checkpoints,
    or a re-saved iteration's previous copy."""
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if name.startswith("iter_") and name.endswith(".tmp") and os.path.isdir(path):
            shutil.rmtree(path)


def _publish(root: str, staging: str, final: str, iteration: int) -> None:
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


def _keep_write_results_in_process() -> None:
    """megatron.core hands its writers' results over a queue of a multiprocessing Manager
    that it spawns on the first save and keeps: a server process (~270 MB) that outlives
    a killed rank, and keeps a resource tracker alive. A synchronous save puts and gets
    those results in this process, so a plain queue serves (and starts nothing)."""
    owner, name = core_overrides.WRITE_RESULTS_QUEUE.owner_and_name()
    if getattr(owner, name) is None:  # declared, so verified to exist at start-up
        setattr(owner, name, queue.Queue())


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
