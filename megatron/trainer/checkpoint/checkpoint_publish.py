"""A finished save published atomically: pointer file, retention, integrity, failed saves."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import logging
import os
import re
import shutil
import sys

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from megatron.dpp.errors import brief, peer_failure
from megatron.trainer.checkpoint.checkpoint_config import CheckpointConfig

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
# the names this module gives checkpoint directories: the only ones it ever deletes
_ITERATION_DIRECTORY = re.compile(r"iter_\d{7}")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be read or written; the message names the path and the cause."""


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


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
