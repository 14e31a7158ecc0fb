"""Start-up stages that can block for long (joining the job, building the dataset index,
loading a checkpoint) say what they wait on when they take longer than a minute, so that a
run never sits silent: each rank logs a WARNING after MEGATRON_STALL_WARNING_S seconds
(default 60) and again at that interval until the stage ends."""

from __future__ import annotations

import logging
import os
import threading
import time

from megatron.trainer.config.arguments import ArgumentError

log = logging.getLogger("megatron.trainer.run.stalls")

DEFAULT_WARNING_S = 60.0


def warning_interval_s() -> float:
    """MEGATRON_STALL_WARNING_S: seconds without progress before a stage says what it waits
    on (a setting so that tests can use seconds)."""
    text = os.environ.get("MEGATRON_STALL_WARNING_S", "")
    try:
        value = float(text) if text else DEFAULT_WARNING_S
    except ValueError:
        raise ArgumentError(f"MEGATRON_STALL_WARNING_S={text!r} is not a number of seconds") from None
    if value <= 0:
        raise ArgumentError(f"MEGATRON_STALL_WARNING_S={text!r}: expected a positive number")
    return value


class StallWatch:
    """Context manager around one blocking stage: while the stage runs, a daemon thread logs
    `still <stage> after N s: <waiting_on>` every `interval_s` seconds."""

    def __init__(self, stage: str, waiting_on: str, interval_s: float | None = None):
        self.stage, self.waiting_on = stage, waiting_on
        self.interval_s = warning_interval_s() if interval_s is None else interval_s
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> StallWatch:
        self._start = time.monotonic()
        self._thread = threading.Thread(target=self._watch, name=f"stall-watch: {self.stage}",
                                        daemon=True)
        self._thread.start()
        return self

    def __exit__(self, exc_type, exc, traceback) -> bool:
        self._done.set()
        self._thread.join()
        return False

    def _watch(self) -> None:
        while not self._done.wait(self.interval_s):
            log.warning("still %s after %.0f s: %s", self.stage,
                        time.monotonic() - self._start, self.waiting_on)
