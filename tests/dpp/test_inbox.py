"""The Inbox contract, for the Python and the native implementation alike."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from megatron.dpp.transport import native
from megatron.dpp.transport.channel import (
    Edge,
    MessageKey,
    MessageKind,
    PythonInbox,
    TransportError,
)

KINDS = [PythonInbox]
if native.available():
    KINDS.append(native.NativeInbox)


def key(microbatch: int, chunk: int = 0) -> MessageKey:
    return MessageKey(MessageKind.ACTIVATION, chunk, microbatch)


@pytest.fixture(params=KINDS, ids=lambda kind: kind.__name__)
def inbox(request):
    return request.param()


def test_messages_are_taken_by_key_in_any_order(inbox):
    tensors = {i: torch.full((i + 1,), float(i)) for i in range(5)}
    for i, tensor in tensors.items():
        inbox.put(key(i, chunk=i % 2), tensor)
    assert len(inbox) == 5 and inbox.has(key(3, chunk=1)) and not inbox.has(key(3))
    assert sorted(inbox.keys()) == sorted(key(i, chunk=i % 2) for i in range(5))
    for i in (4, 0, 2, 1, 3):
        assert torch.equal(inbox.take(key(i, chunk=i % 2), timeout=1), tensors[i])
    assert len(inbox) == 0


def test_take_waits_for_a_message_put_by_another_thread(inbox):
    expected = torch.arange(7)
    timer = threading.Timer(0.05, inbox.put, args=(key(9), expected))
    timer.start()
    assert torch.equal(inbox.take(key(9), timeout=10), expected)
    timer.join()


def test_wait_returns_the_new_version_after_an_arrival(inbox):
    seen = inbox.version
    threading.Timer(0.05, inbox.put, args=(key(1), torch.zeros(1))).start()
    assert inbox.wait(seen, timeout=10) != seen


def test_timeouts_name_what_was_waited_for(inbox):
    start = time.monotonic()
    with pytest.raises(TransportError, match="timed out after 0.2 s waiting for ACTIVATION "
                                             "chunk 0 microbatch 3 from a pipeline peer"):
        inbox.take(key(3), timeout=0.2)
    assert 0.15 < time.monotonic() - start < 5
    fresh = type(inbox)()
    with pytest.raises(TransportError, match="waiting for a message from any pipeline peer"):
        fresh.wait(fresh.version, timeout=0.2)


def test_timeouts_name_the_peer_and_edge_the_message_comes_from():
    sources = [Edge(2, 1, MessageKind.GRADIENT), Edge(0, 1, MessageKind.ACTIVATION)]
    inbox = PythonInbox()
    inbox.set_sources(sources)
    with pytest.raises(TransportError) as caught:
        inbox.wait(inbox.version, timeout=0.1)
    assert str(caught.value) == (
        "timed out after 0.1 s waiting for a message from pipeline peer rank 2 (edge 2->1 "
        "GRADIENT) or a message from pipeline peer rank 0 (edge 0->1 ACTIVATION)")
    inbox = PythonInbox()
    inbox.set_sources(sources)
    expecting = [MessageKey(MessageKind.GRADIENT, 0, 4), key(6), MessageKey(
        MessageKind.GRADIENT, 1, 5)]
    with pytest.raises(TransportError) as caught:
        inbox.wait(inbox.version, timeout=0.1, expecting=expecting)
    assert str(caught.value) == (
        "timed out after 0.1 s waiting for GRADIENT chunk 0 microbatch 4, GRADIENT chunk 1 "
        "microbatch 5 from pipeline peer rank 2 (edge 2->1) or ACTIVATION chunk 0 microbatch 6 "
        "from pipeline peer rank 0 (edge 0->1)")


def test_a_timeout_fails_the_inbox(inbox):
    # the peer is hung: a later wait must not pass because the hung peer sent something
    assert inbox.failure is None
    with pytest.raises(TransportError, match="timed out"):
        inbox.take(key(1), timeout=0.05)
    assert "timed out after 0.05 s" in inbox.failure
    seen = inbox.version
    inbox.put(key(2), torch.zeros(1))
    with pytest.raises(TransportError, match="timed out after 0.05 s"):
        inbox.wait(seen, timeout=1)


def test_a_failure_wakes_the_waiter_and_names_the_channel(inbox):
    threading.Timer(0.05, inbox.fail,
                    args=(TransportError("shm channel 0->1: peer rank 0 died"),)).start()
    with pytest.raises(TransportError, match="peer rank 0 died"):
        inbox.take(key(0), timeout=10)
    with pytest.raises(TransportError, match="peer rank 0 died"):
        inbox.wait(inbox.version, timeout=10)


def test_a_duplicate_message_is_an_error(inbox):
    inbox.put(key(2), torch.zeros(1))
    inbox.put(key(2), torch.ones(1))
    with pytest.raises(TransportError, match="duplicate message"):
        inbox.take(key(5), timeout=1)


@pytest.mark.parametrize("cores, local_ranks, spins", [(32, 2, True), (8, 2, True), (7, 2, False),
                                                       (2, 2, False), (2, 1, False), (4, 1, True)])
def test_waits_spin_only_where_every_local_rank_has_cores_to_spare(monkeypatch, cores,
                                                                   local_ranks, spins):
    monkeypatch.setattr(native.os, "sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_ranks))
    assert native.default_spin_us() == (native.SPIN_US if spins else 0.0)


class _ReadyMarker:
    """Stands in for a CUDA event: records whether the taker waited on it; `done` says
    whether the data it marks is written."""

    def __init__(self):
        self.waited = 0
        self.done = False

    def wait(self):
        self.waited += 1

    def query(self):
        return self.done


def test_an_announced_message_makes_its_taker_wait_for_the_data(inbox):
    """A message put with a `ready` marker (its copy still queued) is handed out at once;
    its taker's stream waits on the marker (once), not its host."""
    ready = _ReadyMarker()
    inbox.put(key(3), torch.ones(2), ready)
    assert inbox.has(key(3)) and ready.waited == 0
    assert not inbox.landed(key(3))  # announced, its data still on the way
    ready.done = True
    assert inbox.landed(key(3)) and not inbox.landed(key(5))
    assert torch.equal(inbox.take(key(3), timeout=1.0), torch.ones(2))
    assert ready.waited == 1
    inbox.put(key(4), torch.zeros(1))  # without a marker: nothing to wait on
    assert inbox.landed(key(4))
    assert torch.equal(inbox.take(key(4), timeout=1.0), torch.zeros(1))
    assert ready.waited == 1


def test_notify_wakes_a_waiter_without_a_message(inbox):
    seen = inbox.version
    threading.Timer(0.05, inbox.notify).start()
    assert inbox.wait(seen, timeout=5.0) != seen
    assert len(inbox) == 0
