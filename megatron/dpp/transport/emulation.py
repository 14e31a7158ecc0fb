"""Emulated links and stragglers: the runtime machinery that applies the variability of
megatron/dpp/variability.py (its profiles and seeded draws, the simulator's) below both
pipeline runtimes, changing time only.

DPP's transports (pipeline.py) and the trainer's megatron-core p2p layer send through
`DelayedDelivery` or `CudaLink`, each message delayed by its own keyed draw (`EdgeDelays`);
both schedules' forward and backward tasks stretch through `StretchedTask` by the factor
`Emulation.straggle_factor` draws. Nothing here touches a tensor's values, so losses and
gradients stay those of the run without emulation.

* A link: each message on an emulated edge becomes usable D ms (plus a uniform 0..J ms,
  plus its size / G) after it was sent. On CPU a delivery thread per edge carries out the
  real send once that time has passed, in the order of sending; on a GPU a link stream
  sleeps on the device (`CudaLink`) and the consumer waits on the event after it.
* A straggler: a compute task on a chosen stage takes FACTOR times as long.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import torch

from megatron.dpp.actions import BACKWARD, FORWARD
from megatron.dpp.transport.channel import MessageKey, MessageKind
from megatron.dpp.variability import Emulation

log = logging.getLogger(__name__)
T = TypeVar("T")


class EdgeDelays:
    """The delays of the messages of one emulated edge, from pipeline stage `src` to `dst`:
    each keyed by the iteration (set before each schedule call) and the task the message
    feeds (variability.Emulation.delay_s, the simulator's draw)."""

    def __init__(self, emulation: Emulation, src: int, dst: int):
        self.emulation, self.src, self.dst = emulation, src, dst
        self.iteration = 0

    def of(self, key: MessageKey, nbytes: int) -> float:
        """Seconds from send to usable of the message `key` of `nbytes`."""
        kind = FORWARD if key.kind == MessageKind.ACTIVATION else BACKWARD
        return self.emulation.delay_s(self.iteration, self.src, self.dst, kind, key.chunk,
                                      key.microbatch, nbytes)


class DelayedDelivery:
    """The delivery thread of one emulated edge: `post` returns at once; the thread runs
    the posted action (the real send, or the delivery into an inbox) once the message's
    delay has passed since it was posted (each action's own delay), in posting order. An action's failure is raised
    by the next `post` or `drain`."""

    def __init__(self, name: str):
        self.name = name
        self._queue: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"emulated-link-{name}",
                                        daemon=True)
        self._thread.start()

    def post(self, action: Callable[[], None], delay_s: float) -> None:
        """Run `action` `delay_s` seconds from now (after the actions posted before)."""
        self._raise_failure()
        self._queue.put((time.monotonic() + delay_s, action))

    def drain(self, timeout: float | None = None) -> None:
        """Wait until every posted action has run."""
        done = threading.Event()
        self._queue.put(done)
        if not done.wait(timeout):
            raise TimeoutError(f"emulated link {self.name}: messages not delivered within "
                               f"{timeout:g} s")
        self._raise_failure()

    def close(self, abort: bool = False, timeout: float = 60.0) -> None:
        """Deliver what is posted (abort: drop it) and end the thread."""
        if abort:
            while True:
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    break
        self._queue.put(None)
        self._thread.join(0.5 if abort else timeout)

    def _raise_failure(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"emulated link {self.name}: delivery failed: "
                               f"{self._error}") from self._error

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            due, action = item
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            if self._error is not None:
                continue  # after a failure nothing more is sent: the peer is gone
            try:
                action()
            except Exception as error:  # reported by the next post or drain
                self._error = error
                log.debug("emulated link %s: %s", self.name, error)


class StretchedTask:
    """Extends one task, started at construction, to `factor` times its own duration (the
    factor given at its end, once the task's key is known). On CPU: after the task the host
    sleeps (factor - 1) times the CPU time its thread spent in it, so where ranks share
    cores the time it waited for one is not stretched too. On a GPU: the compute stream
    spins for (factor - 1) times the task's last measured duration (`CudaSleep`; the host
    never waits for the device)."""

    def __init__(self, device: torch.device):
        self.gpu = device.type == "cuda"
        self.started = time.thread_time()
        if self.gpu:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()

    def finish(self, factor: float, sleeper: CudaSleep | None = None,
               kind: str = FORWARD) -> None:
        if not self.gpu:
            time.sleep((time.thread_time() - self.started) * (factor - 1))
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        sleeper.spin(sleeper.measured(kind, self._start, end) * (factor - 1))


class StragglingTasks:
    """Runs the tasks a schedule runs itself (DPP's W parts) stretched by their straggle
    factor, as the trainer's hook stretches forward and backward tasks: a W straggles as the
    backward it was split from would. `iteration` is set before each schedule call."""

    def __init__(self, emulation: Emulation, stage: int, device: torch.device):
        self.emulation, self.stage, self.device = emulation, stage, device
        self.sleeper = CudaSleep() if device.type == "cuda" else None
        self.iteration = 0

    def run(self, kind: str, chunk: int, microbatch: int, task: Callable[[], T]) -> T:
        factor = self.emulation.straggle_factor(self.iteration, microbatch, self.stage, chunk,
                                                kind)
        if factor <= 1:
            return task()
        stretched = StretchedTask(self.device)
        result = task()
        stretched.finish(factor, self.sleeper, kind)
        return result


class CudaSleep:
    """Device-side waits of a given length: torch.cuda._sleep spins a number of GPU clock
    cycles, calibrated once against CUDA events. Also keeps, per task kind, the duration of
    the last measured task, read from its events once they completed."""

    def __init__(self):
        self._cycles_per_s: float | None = None
        self._pending: dict[str, tuple] = {}
        self._last_s: dict[str, float] = {}

    def spin(self, seconds: float, stream=None) -> None:
        if seconds <= 0:
            return
        with torch.cuda.stream(stream or torch.cuda.current_stream()):
            torch.cuda._sleep(max(1, int(seconds * self.cycles_per_s())))

    def cycles_per_s(self) -> float:
        if self._cycles_per_s is None:
            cycles = 50_000_000
            # an idle GPU raises its clock once busy: time the second of two sleeps
            torch.cuda._sleep(cycles)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                enable_timing=True)
            start.record()
            torch.cuda._sleep(cycles)
            end.record()
            end.synchronize()
            self._cycles_per_s = cycles / (start.elapsed_time(end) / 1000.0)
        return self._cycles_per_s

    def measured(self, kind: str, start, end) -> float:
        """The last measured task of `kind`'s duration in seconds (0 before the first);
        (start, end) is the task just recorded, measured next time unless one is still
        waiting for its events (the host runs ahead of the device)."""
        pending = self._pending.get(kind)
        if pending is None or pending[1].query():
            if pending is not None:
                self._last_s[kind] = pending[0].elapsed_time(pending[1]) / 1000.0
            self._pending[kind] = (start, end)
        return self._last_s.get(kind, 0.0)


class CudaLink:
    """The device side of one emulated GPU edge: each message's event is recorded on a link
    stream after a device-side sleep, never on the compute stream. A ring of streams lets
    messages sent less than a delay apart be in flight together; each also waits for the
    one before, so they are delivered in order."""

    RING = 4

    def __init__(self, sleeper: CudaSleep, device: torch.device):
        self.sleeper = sleeper
        self._streams = [torch.cuda.Stream(device) for _ in range(self.RING)]
        self._next = 0
        self._delivered = None

    def delayed_stream(self, delay_s: float):
        """(stream, event): work queued next on the stream, and whatever waits on the
        event, runs once the current stream's work so far and `delay_s` seconds have
        passed (and after the edge's previous message)."""
        stream = self._streams[self._next]
        self._next = (self._next + 1) % self.RING
        stream.wait_stream(torch.cuda.current_stream())
        self.sleeper.spin(delay_s, stream)
        if self._delivered is not None:
            stream.wait_event(self._delivered)
        self._delivered = torch.cuda.Event()
        self._delivered.record(stream)
        return stream, self._delivered
