"""The device side of the emulation (megatron/dpp/transport/emulation.py) on a GPU: a link's
delay sits on a stream of its own, never on the host or the compute stream, and keeps the
edge's messages in order; a straggling task spins the compute stream for the rest of its
factor while the host goes on. The CPU side is tested in test_emulation.py."""

from __future__ import annotations

import time

import pytest
import torch

from megatron.dpp.actions import FORWARD
from megatron.dpp.transport.emulation import CudaLink, CudaSleep, StretchedTask

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="device-side waits need a GPU (the CPU path: "
                                       "test_emulation.py)")

DELAY_S = 0.05
# what the host may spend queueing a wait of DELAY_S: far below the wait itself
QUEUED_S = DELAY_S / 5


def _timed_event(stream=None) -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=True)
    event.record(stream)
    return event


def _seconds(start: torch.cuda.Event, end: torch.cuda.Event) -> float:
    return start.elapsed_time(end) / 1000.0


def test_cuda_sleep_waits_on_the_stream_and_not_on_the_host():
    sleeper = CudaSleep()
    sleeper.cycles_per_s()  # calibrated once, before anything is timed
    start = _timed_event()
    host = time.monotonic()
    sleeper.spin(DELAY_S)
    queued = time.monotonic() - host
    end = _timed_event()
    end.synchronize()
    assert queued < QUEUED_S, f"the host spent {queued:.3f} s queueing a {DELAY_S} s wait"
    assert 0.8 * DELAY_S <= _seconds(start, end) <= 1.5 * DELAY_S, _seconds(start, end)


def test_a_delayed_message_holds_up_neither_the_host_nor_the_compute_stream():
    device = torch.device("cuda", torch.cuda.current_device())
    link = CudaLink(CudaSleep(), device)
    link.sleeper.cycles_per_s()
    message = torch.arange(4096, dtype=torch.float32, device=device)
    # load both kernels first: loading a kernel lazily waits for the running ones
    message * 2, message + 1
    torch.cuda.synchronize()
    sent = _timed_event()
    host = time.monotonic()
    stream, ready = link.delayed_stream(DELAY_S)
    with torch.cuda.stream(stream):
        delivered = message * 2  # what a channel does with the message on the link stream
    landed = _timed_event(stream)
    queued = time.monotonic() - host
    after = message + 1  # the producer's next task, on the compute stream
    computed = _timed_event()
    computed.synchronize()
    assert not ready.query(), "the compute stream waited for the emulated link"
    landed.synchronize()
    assert queued < QUEUED_S, f"the host spent {queued:.3f} s sending over the link"
    assert _seconds(sent, computed) < DELAY_S / 2
    assert _seconds(sent, landed) >= 0.8 * DELAY_S, _seconds(sent, landed)
    assert torch.equal(delivered, message * 2) and torch.equal(after, message + 1)


def test_a_link_delivers_its_messages_in_order():
    device = torch.device("cuda", torch.cuda.current_device())
    link = CudaLink(CudaSleep(), device)
    link.sleeper.cycles_per_s()
    sent = _timed_event()
    landed = []
    for delay in (DELAY_S, DELAY_S / 10, 0.0):  # later messages with shorter delays
        stream, _ = link.delayed_stream(delay)
        landed.append(_timed_event(stream))
    torch.cuda.synchronize()
    times = [_seconds(sent, event) for event in landed]
    # each waits for the one before: none lands before the first's delay (events of
    # different streams that complete together may be timed a microsecond apart)
    assert min(times) >= 0.8 * DELAY_S, f"a later message overtook the first: {times}"
    assert all(b >= a - 1e-5 for a, b in zip(times, times[1:], strict=False)), times


def test_a_straggling_task_spins_the_compute_stream_for_the_rest_of_its_factor():
    device = torch.device("cuda", torch.cuda.current_device())
    sleeper = CudaSleep()
    sleeper.cycles_per_s()
    work_s, factor = DELAY_S / 5, 3.0

    def task() -> tuple[float, float]:
        """(host seconds to queue it, device seconds it took)"""
        start = _timed_event()
        host = time.monotonic()
        stretched = StretchedTask(device)
        sleeper.spin(work_s)  # the task's own work
        stretched.finish(factor, sleeper, FORWARD)
        queued = time.monotonic() - host
        end = _timed_event()
        end.synchronize()
        return queued, _seconds(start, end)

    task()  # the stretch is the last measured task's: the first one has none yet
    queued, took = task()
    assert queued < work_s, f"the host waited {queued:.3f} s for a straggling task"
    assert 0.8 * factor * work_s <= took <= 1.5 * factor * work_s, (took, factor * work_s)
