"""--save checked and claimed when the job starts, not at its first save.

Rank 0 checks that the directory can be created and written, that its pointer file reads
as an iteration, and that it holds no checkpoint series unless --load resumes one (a run
without --load would replace them one by one and move the pointer back). It then takes an
advisory lock (flock) on the directory, held until the job ends and released by the kernel
when it dies, so no stale lock survives a crash: a second job with the same --save stops at
start naming the holder's process, and no job ever deletes the staging directory of a save
another one has in progress. Where the filesystem cannot lock a directory (NFS, which locks
files only), a `.lock` file inside it is locked instead. Every rank raises rank 0's verdict.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import tempfile

import torch.distributed as dist

from megatron.trainer.checkpoint.checkpoint_publish import (
    POINTER,
    CheckpointError,
    latest_iteration,
)

log = logging.getLogger(__name__)

LOCK_FILE = ".lock"  # only where the directory itself cannot be locked


class SaveDirectory:
    """The claim on --save of this job (rank 0 holds the lock)."""

    def __init__(self, path: str):
        self.path = path
        self._descriptor: int | None = None

    def claim(self, resuming: bool) -> str | None:
        """Check and lock the directory; a one-line problem, or None once it is ours."""
        try:
            os.makedirs(self.path, exist_ok=True)
            with tempfile.TemporaryFile(dir=self.path):
                pass
        except OSError as error:
            return f"--save {self.path} is not writable: {os.strerror(error.errno)}"
        try:
            latest = latest_iteration(self.path)
        except (CheckpointError, OSError, UnicodeDecodeError) as error:
            return f"--save {self.path}: its pointer is unreadable: {error}"
        if latest is not None and not resuming:
            return (f"--save {self.path} already holds a checkpoint series ("
                    f"{os.path.join(self.path, POINTER)} names iteration {latest}) and there is "
                    "no --load: give --load with it to resume that run, or another --save "
                    "(this run would replace its checkpoints)")
        return self._lock()

    def _lock(self) -> str | None:
        # the directory itself; where the filesystem locks files only, a file in it
        attempts = ((self.path, os.O_RDONLY | os.O_DIRECTORY),
                    (os.path.join(self.path, LOCK_FILE), os.O_RDWR | os.O_CREAT))
        for target, flags in attempts:
            descriptor = os.open(target, flags, 0o644)
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as error:
                os.close(descriptor)
                if error.errno in (errno.EWOULDBLOCK, errno.EACCES):
                    return self._held(target)
                failure = error
                continue
            self._descriptor = descriptor
            return None
        return f"--save {self.path} cannot be locked: {os.strerror(failure.errno)}"

    def _held(self, target: str) -> str:
        holder = lock_holder(target)
        who = "another job" if holder is None else f"another job (pid {holder})"
        return (f"--save {self.path} is in use by {who}: its saves would replace this run's "
                "checkpoints; give this run another --save")

    def release(self) -> None:
        if self._descriptor is not None:
            os.close(self._descriptor)  # the lock goes with the last descriptor
            self._descriptor = None


def lock_holder(path: str) -> str | None:
    """`pid (command)` of the process on this machine holding the flock on `path` (from
    /proc/locks), or None where it is not found (another machine, no /proc)."""
    try:
        stats = os.stat(path)
        with open("/proc/locks") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return None
    identity = f"{os.major(stats.st_dev):02x}:{os.minor(stats.st_dev):02x}:{stats.st_ino}"
    flocks = [fields for fields in map(str.split, lines) if "FLOCK" in fields and len(fields) > 5]
    # by device and inode; by inode alone where the device numbers differ (overlayfs)
    matching = [f for f in flocks if f[5] == identity] or [
        f for f in flocks if f[5].rsplit(":", 1)[-1] == str(stats.st_ino)]
    for fields in matching[:1]:
            pid = fields[4]
            with contextlib.suppress(OSError):
                with open(f"/proc/{pid}/cmdline", "rb") as handle:
                    command = handle.read().replace(b"\0", b" ").decode(errors="replace")
                return f"{pid}: {command.strip()[:200]}"
            return pid
    return None


def claim_save_directory(path: str, resuming: bool, stack: contextlib.ExitStack) -> None:
    """Rank 0 claims --save for the job (released when `stack` closes); every rank raises
    its verdict as a CheckpointError."""
    directory = SaveDirectory(path)
    problem = [directory.claim(resuming) if dist.get_rank() == 0 else None]
    stack.callback(directory.release)
    dist.broadcast_object_list(problem, src=0)
    if problem[0] is not None:
        raise CheckpointError(problem[0])
    log.debug("--save %s locked for this job", path)
