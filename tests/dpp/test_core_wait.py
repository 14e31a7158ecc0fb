"""CPU task times for DPP's slack choice leave out the time a rank waited for a core
(megatron/dpp/slack_measurement.py): ranks that share cores would otherwise show each
other's work as their own cost spread, which the choice reads as stragglers."""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path

import pytest
import torch

from megatron.dpp import slack_measurement
from megatron.dpp.actions import FORWARD, Task
from megatron.dpp.slack_measurement import SCHEDSTAT, IterationRecord, core_wait_s


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _spin_on(cpu: int, spinning, stop) -> None:
    """Busy on `cpu` until `stop` is set (at most 30 s); `spinning` says it has begun."""
    os.sched_setaffinity(0, {cpu})
    spinning.set()
    end = time.perf_counter() + 30.0
    while not stop.is_set() and time.perf_counter() < end:
        _spin(0.01)


def test_a_cpu_task_time_leaves_out_the_wait_for_a_core(monkeypatch):
    waits = iter([1.0, 1.05])  # the rank waited 50 ms for a core during the task
    monkeypatch.setattr(slack_measurement, "core_wait_s", lambda: next(waits))
    record = IterationRecord()
    with record.timed(Task(FORWARD, 0, 0), torch.device("cpu")):
        time.sleep(0.08)
    (ms,) = record.task_ms[FORWARD, 0]
    assert 25.0 <= ms < 70.0


@pytest.mark.skipif(not Path(SCHEDSTAT).exists() or not hasattr(os, "sched_setaffinity"),
                    reason="needs Linux's per-thread scheduler statistics and CPU affinity")
def test_the_wait_for_a_shared_core_is_counted():
    """Two busy processes on one core: each waits for it about half the time."""
    before_affinity = os.sched_getaffinity(0)
    cpu = min(before_affinity)
    context = multiprocessing.get_context("fork")
    spinning, stop = context.Event(), context.Event()
    child = context.Process(target=_spin_on, args=(cpu, spinning, stop))
    try:
        os.sched_setaffinity(0, {cpu})
        child.start()
        assert spinning.wait(timeout=30)
        waited = core_wait_s()
        _spin(0.6)
        waited = core_wait_s() - waited
    finally:
        stop.set()
        os.sched_setaffinity(0, before_affinity)
        child.join(timeout=10)
        if child.is_alive():
            child.kill()
    assert 0.1 < waited < 0.6
    assert core_wait_s() >= 0.0
