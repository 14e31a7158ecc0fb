"""How far a stage's host runs ahead of its GPU, so that the schedule decides at GPU time.

A static schedule never waits on the host: it queues the next kernels and runs ahead. A
dynamic one must choose, and a host that runs far ahead chooses with stale knowledge (a
filler W looks like the only ready task though the planned input lands before the GPU is
free), while a host that waits for every message and only then launches exposes its
wake-up and launch on the GPU. So the schedule keeps the GPU's queue about one task deep:
before it decides a task it waits until the GPU has started the task before (`wait_until`),
it runs the plan's next task as soon as that task's input is announced (its kernels queue
behind a device-side wait on the data), and it deviates from the plan only when the GPU
has run dry (`busy() == 0`). A watcher thread wakes the schedule's inbox each time a
queued task ends, so that one wait covers both arrivals and the GPU going idle.

`GpuQueue` takes a marker factory: on a GPU a CUDA event recorded on the current stream;
the CPU tests use `SimulatedDevice`, whose tasks end a fixed time after the previous one.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from collections.abc import Callable
from typing import Protocol

# test hook: on CPU ranks, pace the schedule as if each task ran this many milliseconds on
# a device of its own (exercises the GPU-time decisions without a GPU)
SIMULATED_TASK_ENV = "DPP_TEST_SIMULATED_TASK_MS"

# tasks the host keeps queued beyond the one the GPU runs
QUEUE_AHEAD = 1


class Marker(Protocol):
    """The end of a task's queued work on the device."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class GpuQueue:
    """The markers of the tasks this stage has launched and the GPU has not finished."""

    def __init__(self, make_marker: Callable[[], Marker], on_progress: Callable[[], None]):
        self._make_marker = make_marker
        self._on_progress = on_progress
        # (marker, size) of each launched task the device may not have finished
        self._pending: collections.deque[tuple[Marker, float]] = collections.deque()
        self._queued = 0.0  # their sizes, summed
        self._watched: queue.SimpleQueue[Marker | None] = queue.SimpleQueue()
        self._watcher = threading.Thread(target=self._watch, name="dpp-gpu-progress",
                                         daemon=True)
        self._watcher.start()

    def launched(self, size: float = 1.0) -> None:
        """The kernels of one task were queued: mark their end. `size`: the task's share of a
        whole task (a W run in n parts queues n parts of 1/n), so that the host keeps about
        a task's worth of work queued, not one short part."""
        marker = self._make_marker()
        self._pending.append((marker, size))
        self._queued += size
        self._watched.put(marker)

    def busy(self) -> int:
        """Launched tasks the device has not finished."""
        pending = self._pending
        while pending and pending[0][0].query():
            self._queued -= pending.popleft()[1]
        return len(pending)

    def wait_until(self, most: float) -> None:
        """Block until the unfinished launched tasks add up to at most `most` tasks."""
        pending = self._pending
        while pending and self._queued > most + 1e-9:
            marker, size = pending.popleft()
            marker.synchronize()
            self._queued -= size
        if not pending:
            self._queued = 0.0  # no rounding left behind

    def close(self, timeout: float | None = None) -> None:
        """Stop the watcher once it has seen every launched task end, waiting at most
        `timeout` seconds (a device that never finishes, after a peer failed, must not hold
        the process; the watcher is a daemon thread)."""
        self._watched.put(None)
        self._watcher.join(timeout)

    def _watch(self) -> None:
        while (marker := self._watched.get()) is not None:
            marker.synchronize()
            self._on_progress()


def cuda_marker() -> Marker:
    """A CUDA event at the current stream's tail. Blocking: waiting sleeps, no core spins."""
    import torch

    event = torch.cuda.Event(blocking=True)
    event.record()
    return event


class SimulatedDevice:
    """A stand-in device for CPU tests: every task takes `task_s` seconds, one after another,
    from the moment it is launched or the previous one ends, whichever is later."""

    def __init__(self, task_s: float):
        self.task_s = task_s
        self._free_at = 0.0
        self._lock = threading.Lock()

    def marker(self) -> Marker:
        with self._lock:
            self._free_at = max(time.monotonic(), self._free_at) + self.task_s
            return _TimedMarker(self._free_at)


class _TimedMarker:
    def __init__(self, done_at: float):
        self._done_at = done_at

    def query(self) -> bool:
        return time.monotonic() >= self._done_at

    def synchronize(self) -> None:
        left = self._done_at - time.monotonic()
        if left > 0:
            time.sleep(left)
