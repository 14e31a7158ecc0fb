"""Emulated links and stragglers: reproducible variability that changes time only.

One place for both pipeline runtimes: DPP's transports (pipeline.py) and the trainer's
megatron-core p2p layer send through `DelayedDelivery`, and both schedules' forward and
backward tasks stretch through `Emulation.straggles`. Nothing here touches a tensor's
values, so losses and gradients stay those of the run without emulation.

* A link: each message on an emulated edge becomes usable D ms (plus a uniform 0..J ms,
  plus its size / G) after it was sent. On CPU a delivery thread per edge carries out the
  real send once that time has passed, in the order of sending; on a GPU a link stream
  sleeps on the device (`CudaLink`) and the consumer waits on the event after it.
* A straggler: a compute task on a chosen stage takes FACTOR times as long with
  probability PROB. The draw is keyed by (seed, iteration, microbatch, stage, task kind),
  so the same tasks straggle whichever order a schedule runs them in.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import random
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

LINK_EDGES = ("pods", "all")
FORWARD_TASK, BACKWARD_TASK = 0, 1


@dataclass(frozen=True)
class LinkProfile:
    """delay_ms + U(0, jitter_ms) + size / gbps per message, on the edges `edges` names:
    "pods" (between ranks of different pods) or "all" (every pipeline edge)."""

    delay_ms: float
    jitter_ms: float = 0.0
    gbps: float | None = None
    edges: str = "pods"

    def __post_init__(self):
        if self.delay_ms < 0 or self.jitter_ms < 0:
            raise ValueError(f"emulated link delay {self.delay_ms} ms, jitter {self.jitter_ms} "
                             "ms: both must be >= 0")
        if self.gbps is not None and self.gbps <= 0:
            raise ValueError(f"emulated link bandwidth {self.gbps} GB/s must be > 0")
        if self.edges not in LINK_EDGES:
            raise ValueError(f"emulated link edges {self.edges!r}: choose one of "
                             f"{', '.join(LINK_EDGES)}")

    def emulates(self, src_pod: str, dst_pod: str) -> bool:
        return self.edges == "all" or src_pod != dst_pod

    def describe(self) -> str:
        text = f"link {self.delay_ms:g} ms"
        if self.jitter_ms:
            text += f" + U(0, {self.jitter_ms:g}) ms"
        if self.gbps:
            text += f" + size / {self.gbps:g} GB/s"
        return text + (" on every pipeline edge" if self.edges == "all"
                       else " on the edges between pods")


@dataclass(frozen=True)
class StragglerProfile:
    """With probability `prob` a forward or backward on one of `stages` (pipeline ranks;
    None: every stage) takes `factor` times as long."""

    stages: tuple[int, ...] | None
    prob: float
    factor: float

    def __post_init__(self):
        if not 0 <= self.prob <= 1:
            raise ValueError(f"straggler probability {self.prob} not in [0, 1]")
        if self.factor < 1:
            raise ValueError(f"straggler factor {self.factor} must be >= 1")
        if self.stages is not None and any(stage < 0 for stage in self.stages):
            raise ValueError(f"straggler stages {self.stages}: stage numbers are >= 0")

    def describe(self) -> str:
        stages = "every stage" if self.stages is None else \
            "stage " + ",".join(map(str, self.stages))
        return f"stragglers on {stages}: p {self.prob:g}, x{self.factor:g}"


def parse_link_ms(text: str) -> tuple[float, float]:
    """"D" or "D,J" (milliseconds) -> (D, J)."""
    parts = text.split(",")
    try:
        values = [float(part) for part in parts]
    except ValueError:
        values = []
    if len(values) not in (1, 2) or any(v < 0 for v in values):
        raise ValueError(f"--emulate-link-ms {text!r}: expected D or D,J (milliseconds >= 0), "
                         "e.g. 30 or 30,10")
    return values[0], values[1] if len(values) == 2 else 0.0


def parse_straggler(text: str) -> StragglerProfile:
    """"STAGES:PROB:FACTOR", STAGES a stage, a comma list of them, or "all"."""
    problem = (f"--emulate-straggler {text!r}: expected STAGES:PROB:FACTOR (STAGES a stage "
               "number, a comma list or all; PROB in [0, 1]; FACTOR >= 1), e.g. all:0.1:3")
    parts = text.split(":")
    if len(parts) != 3:
        raise ValueError(problem)
    try:
        stages = None if parts[0] == "all" else tuple(int(s) for s in parts[0].split(","))
        return StragglerProfile(stages, float(parts[1]), float(parts[2]))
    except ValueError:
        raise ValueError(problem) from None


@dataclass(frozen=True)
class Emulation:
    """The run's emulated variability, seeded by `seed`; no link and no straggler: off."""

    seed: int
    link: LinkProfile | None = None
    straggler: StragglerProfile | None = None

    @property
    def active(self) -> bool:
        return self.link is not None or self.straggler is not None

    def describe(self) -> str:
        parts = [p.describe() for p in (self.link, self.straggler) if p is not None]
        return f"emulated: {'; '.join(parts)} (seed {self.seed}; time only, values untouched)"

    def link_between(self, src_pod: str, dst_pod: str) -> LinkProfile | None:
        """The profile of the link from a rank of `src_pod` to one of `dst_pod`, or None
        where that edge is not emulated."""
        if self.link is None or not self.link.emulates(src_pod, dst_pod):
            return None
        return self.link

    def edge_delays(self, src: int, dst: int, kind: int) -> EdgeDelays:
        """The delays of the messages along one edge (global ranks, message kind)."""
        return EdgeDelays(self.link, _hash(self.seed, 1, src, dst, kind))

    def straggles(self, iteration: int, microbatch: int, stage: int, virtual_stage: int,
                  task_kind: int) -> bool:
        """Whether this task straggles; `stage` is the pipeline rank STAGES selects."""
        profile = self.straggler
        if profile is None or profile.prob == 0 or (
                profile.stages is not None and stage not in profile.stages):
            return False
        draw = _hash(self.seed, 2, iteration, microbatch, virtual_stage, task_kind)
        return draw / 2.0 ** 63 < profile.prob


class EdgeDelays:
    """Seconds each message of one edge is delayed by, drawn in sending order."""

    def __init__(self, link: LinkProfile, seed: int):
        self.link = link
        self._rng = random.Random(seed)

    def next(self, nbytes: int) -> float:
        link = self.link
        ms = link.delay_ms + (self._rng.uniform(0, link.jitter_ms) if link.jitter_ms else 0.0)
        seconds = ms / 1000.0
        if link.gbps:
            seconds += nbytes / (link.gbps * 1e9)
        return seconds


class DelayedDelivery:
    """The delivery thread of one emulated edge: `post` returns at once; the thread runs
    the posted action (the real send, or the delivery into an inbox) once the message's
    delay has passed since it was posted, in posting order. An action's failure is raised
    by the next `post` or `drain`."""

    def __init__(self, name: str, delays: EdgeDelays):
        self.name = name
        self.delays = delays
        self._queue: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"emulated-link-{name}",
                                        daemon=True)
        self._thread.start()

    def post(self, action: Callable[[], None], nbytes: int) -> None:
        self._raise_failure()
        self._queue.put((time.monotonic() + self.delays.next(nbytes), action))

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
    """Extends one task to `factor` times its own duration. On CPU: the host sleeps for the
    rest after the task. On a GPU: the compute stream spins for (factor - 1) times the
    task's last measured duration (`CudaSleep`; the host never waits for the device)."""

    def __init__(self, factor: float, device: torch.device):
        self.factor = factor
        self.gpu = device.type == "cuda"
        self.started = time.monotonic()
        if self.gpu:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()

    def finish(self, sleeper: CudaSleep | None = None, kind: int = FORWARD_TASK) -> None:
        if not self.gpu:
            elapsed = time.monotonic() - self.started
            time.sleep(elapsed * (self.factor - 1))
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        sleeper.spin(sleeper.measured(kind, self._start, end) * (self.factor - 1))


class CudaSleep:
    """Device-side waits of a given length: torch.cuda._sleep spins a number of GPU clock
    cycles, calibrated once against CUDA events. Also keeps, per task kind, the duration of
    the last measured task, read from its events once they completed."""

    def __init__(self):
        self._cycles_per_s: float | None = None
        self._pending: dict[int, tuple] = {}
        self._last_s: dict[int, float] = {}

    def spin(self, seconds: float, stream=None) -> None:
        if seconds <= 0:
            return
        with torch.cuda.stream(stream or torch.cuda.current_stream()):
            torch.cuda._sleep(max(1, int(seconds * self.cycles_per_s())))

    def cycles_per_s(self) -> float:
        if self._cycles_per_s is None:
            cycles = 50_000_000
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                enable_timing=True)
            start.record()
            torch.cuda._sleep(cycles)
            end.record()
            end.synchronize()
            self._cycles_per_s = cycles / (start.elapsed_time(end) / 1000.0)
        return self._cycles_per_s

    def measured(self, kind: int, start, end) -> float:
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

    def __init__(self, delays: EdgeDelays, sleeper: CudaSleep, device: torch.device):
        self.delays = delays
        self.sleeper = sleeper
        self._streams = [torch.cuda.Stream(device) for _ in range(self.RING)]
        self._next = 0
        self._delivered = None

    def delayed_stream(self, nbytes: int):
        """(stream, event): work queued next on the stream, and whatever waits on the
        event, runs once the current stream's work so far and the message's delay have
        passed (and after the edge's previous message)."""
        stream = self._streams[self._next]
        self._next = (self._next + 1) % self.RING
        stream.wait_stream(torch.cuda.current_stream())
        self.sleeper.spin(self.delays.next(nbytes), stream)
        if self._delivered is not None:
            stream.wait_event(self._delivered)
        self._delivered = torch.cuda.Event()
        self._delivered.record(stream)
        return stream, self._delivered


def _hash(*values: int) -> int:
    """A 63-bit integer from signed 64-bit integers."""
    digest = hashlib.blake2b(struct.pack(f"<{len(values)}q", *values), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
