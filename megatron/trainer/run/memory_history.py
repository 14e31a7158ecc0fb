"""--record-memory-history: the CUDA caching allocator's history, Megatron-LM's flag.

The ranks of --profile-ranks record every allocation and free with the Python stack that
made it, from before the model is built, and write torch's memory snapshot after the run's
first iteration (where CUDA graphs record their buckets and most peaks are set), every
--log-interval iterations and when the run ends, an error (an out-of-memory one too)
included: --memory-snapshot-path with `-rank<R>` before its suffix, replaced whole each
time. https://pytorch.org/memory_viz opens it; profiling/memory_peak.py names what was live
at the peak (and compares two runs). Megatron-LM writes only the last rank's
snapshot, to the path as given.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# events kept, the oldest dropped first (4 layers and 3 iterations made 5,000; a first step
# recording every length bucket's graphs makes many more)
MAX_EVENTS = 1_000_000


class MemorySnapshotError(RuntimeError):
    """The snapshot could not be written (a full disk, a path that is not writable)."""


def snapshot_path(path: str, rank: int) -> Path:
    """--memory-snapshot-path for one rank: `snapshot.pickle` -> `snapshot-rank3.pickle`."""
    base, suffix = os.path.splitext(path)
    return Path(f"{base}-rank{rank}{suffix}")


def memory_history_refusal(asked: bool, cuda_available: bool) -> str | None:
    """Why --record-memory-history cannot run here (every rank asks, before the job starts)."""
    if asked and not cuda_available:
        return ("--record-memory-history records the CUDA caching allocator: this machine has "
                "no CUDA device")
    return None


class MemoryHistory(contextlib.AbstractContextManager):
    """Records while entered, on the chosen ranks; `after_step` writes the snapshot."""

    def __init__(self, enabled: bool, path: str, rank: int, log_interval: int,
                 memory=torch.cuda.memory):
        self.enabled = enabled
        self.path = snapshot_path(path, rank)
        self.log_interval = log_interval
        self._memory = memory
        self._steps = 0

    def __enter__(self):
        if self.enabled:
            self._memory._record_memory_history(enabled="all", context="alloc", stacks="python",
                                                max_entries=MAX_EVENTS)
            log.info("recording the CUDA allocator's history; snapshots go to %s", self.path)
        return self

    def __exit__(self, exc_type, exc, traceback):
        if not self.enabled:
            return False
        try:
            self.write()
        except Exception as error:  # a broken device must not hide the error that ended the run
            if exc is None:
                raise
            log.warning("no memory snapshot at the end of the run: %s", error)
        finally:
            self._memory._record_memory_history(enabled=None)
        return False

    def after_step(self, iteration: int) -> None:
        """After each iteration (counted from 1; a resumed run's first is its own first)."""
        self._steps += 1
        if self.enabled and (self._steps == 1 or iteration % self.log_interval == 0):
            self.write()

    def write(self) -> None:
        """The snapshot, through a temporary file: a reader never sees half of one."""
        partial = self.path.with_name(f"{self.path.name}.partial-{os.getpid()}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(partial, "wb") as file:
                pickle.dump(self._memory._snapshot(), file)
            os.replace(partial, self.path)
        except OSError as error:
            raise MemorySnapshotError(f"--memory-snapshot-path: cannot write {self.path}: "
                                      f"{error.strerror or error}") from error
        finally:
            with contextlib.suppress(OSError):  # no folder: no partial file either
                partial.unlink(missing_ok=True)
