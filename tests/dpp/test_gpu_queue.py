"""GpuQueue (megatron/dpp/gpu_queue.py): how many launched tasks the device has not
finished, waiting until few enough are, and a wake-up of the inbox each time one ends; on a
SimulatedDevice, whose tasks take a fixed time one after another."""

from __future__ import annotations

import threading
import time

from megatron.dpp.gpu_queue import GpuQueue, SimulatedDevice
from megatron.dpp.transport.channel import PythonInbox

TASK_S = 0.05


def test_counts_waits_and_wakes_the_inbox_as_tasks_end():
    inbox = PythonInbox()
    device = SimulatedDevice(TASK_S)
    gpu = GpuQueue(device.marker, inbox.notify)
    try:
        start = time.monotonic()
        seen = inbox.version
        for _ in range(3):
            gpu.launched()
        assert gpu.busy() == 3
        gpu.wait_until(1)  # two tasks ended: about 2 x TASK_S after the start
        elapsed = time.monotonic() - start
        assert 2 * TASK_S * 0.9 <= elapsed < 3 * TASK_S
        assert gpu.busy() == 1
        inbox.wait(seen, timeout=1.0)  # the watcher woke it at least once
        gpu.wait_until(0)
        assert gpu.busy() == 0
    finally:
        gpu.close()
    assert inbox.version - seen == 3  # one wake-up per task that ended


def test_a_wait_for_arrivals_also_ends_when_the_device_runs_dry():
    """The schedule's one wait: a message or the end of the queued task, whichever first."""
    inbox = PythonInbox()
    gpu = GpuQueue(SimulatedDevice(TASK_S).marker, inbox.notify)
    try:
        gpu.launched()
        seen = inbox.version
        start = time.monotonic()
        inbox.wait(seen, timeout=5.0)  # no message ever comes
        assert TASK_S * 0.9 <= time.monotonic() - start < 1.0
        assert gpu.busy() == 0
    finally:
        gpu.close()


def test_close_waits_for_the_launched_tasks():
    ended = threading.Event()
    gpu = GpuQueue(SimulatedDevice(TASK_S).marker, ended.set)
    gpu.launched()
    gpu.close()
    assert ended.is_set()


def test_parts_of_a_task_count_as_their_share():
    """Four W parts of a quarter each are one task's worth: waiting for at most one task
    leaves them all queued."""
    inbox = PythonInbox()
    gpu = GpuQueue(SimulatedDevice(TASK_S).marker, inbox.notify)
    try:
        start = time.monotonic()
        for _ in range(4):
            gpu.launched(0.25)
        gpu.wait_until(1)
        assert time.monotonic() - start < TASK_S / 2 and gpu.busy() == 4
        gpu.launched()  # a whole task behind them: the host waits for the four parts
        gpu.wait_until(1)
        assert gpu.busy() == 1
    finally:
        gpu.close()
