"""--timing-log-level: named wall-clock timers with megatron-core's interface
(`timers(name, log_level).start()` / `.stop()`, which its schedules, optimizer and
finalize_model_grads call through `config.timers`), recording those up to the level.

Level 0 is the iteration time (the log line has it); level 1 adds the trainer's
forward-backward and optimizer and megatron-core's level-1 timers; level 2 its per-
microbatch compute and p2p timers. On GPU a timer synchronises the device at start and
stop, so that it measures the work and not its launch.
"""

from __future__ import annotations

import time

import torch

MAX_LEVEL = 2


class Timer:
    """Nested starts count once: the trainer and megatron-core's schedules both time
    "forward-backward" (DPP's schedule does not)."""

    def __init__(self, synchronize: bool):
        self.synchronize = synchronize
        self.seconds = 0.0
        self._depth = 0
        self._started = 0.0

    def start(self, barrier: bool = False) -> None:
        # megatron's barrier option is ignored: a barrier would time the slowest rank
        self._depth += 1
        if self._depth > 1:
            return
        if self.synchronize:
            torch.cuda.synchronize()
        self._started = time.perf_counter()

    def stop(self, barrier: bool = False) -> None:
        if self._depth == 0:
            raise RuntimeError("timer stopped without being started")
        self._depth -= 1
        if self._depth > 0:
            return
        if self.synchronize:
            torch.cuda.synchronize()
        self.seconds += time.perf_counter() - self._started


class _NullTimer:
    def start(self, barrier: bool = False) -> None:
        pass

    def stop(self, barrier: bool = False) -> None:
        pass


_NULL = _NullTimer()


class _Both:
    """A recorded timer and another consumer's (the --trace tracer's) of the same name."""

    def __init__(self, first, second):
        self.first, self.second = first, second

    def start(self, barrier: bool = False) -> None:
        self.first.start(barrier)
        self.second.start(barrier)

    def stop(self, barrier: bool = False) -> None:
        self.second.stop(barrier)
        self.first.stop(barrier)


class Timers:
    """Timers up to `level`; `inner` (megatron-core's timer interface, e.g. the tracer's)
    sees every call as well."""

    def __init__(self, level: int, synchronize: bool):
        self.level, self.synchronize = level, synchronize
        self.inner = None
        self._timers: dict[str, Timer] = {}

    def __call__(self, name: str, log_level: int | None = None, barrier: bool = False):
        # megatron-core starts some timers with their level and stops them without one:
        # a timer once recorded stays recorded; no level means the highest (as Megatron-LM)
        level = MAX_LEVEL if log_level is None else log_level
        inner = self.inner(name, level) if self.inner is not None else None
        timer = self._timers.get(name)
        if timer is None and level <= self.level:
            timer = self._timers[name] = Timer(self.synchronize)
        if timer is None:
            return inner if inner is not None else _NULL
        return timer if inner is None else _Both(timer, inner)

    def take(self) -> dict[str, float]:
        """Seconds recorded by each timer since the last take; the timers restart at 0."""
        taken = {name: timer.seconds for name, timer in self._timers.items() if timer.seconds}
        for timer in self._timers.values():
            timer.seconds = 0.0
        return taken
