"""The RDMA backend of the DPP transport: which edges it carries (--dpp-transport rdma /
auto), and its channels. Both ends of a channel run in one process here, one thread per
rank, trading connection info through an in-process exchange. Without an RDMA device the
channel tests run over a stand-in for the extension's RdmaChannel (same calls, a queue
instead of a queue pair); the same exchange over real RC queue pairs runs where a device
exists."""

from __future__ import annotations

import ctypes
import queue
import threading
import time
import uuid

import pytest
import torch

from megatron.dpp.transport import native, pipeline, rdma
from megatron.dpp.transport.channel import (
    Edge,
    MessageKey,
    MessageKind,
    PythonInbox,
    TransportError,
)
from megatron.dpp.transport.pipeline import pipeline_edges, plan_backends
from megatron.dpp.transport.rdma import RdmaBackend

NO_DEVICE_REASON = "no RDMA device (ibv_get_device_list is empty)"
THREAD_TIMEOUT_S = 30.0

# ranks 0, 1 on host a; 2, 3 on host b: edges 1->2 and 2->1 cross hosts
HOSTS = ["a", "a", "b", "b"]
EDGES = pipeline_edges([[0, 1, 2, 3]], num_chunks=1)
REMOTE = [Edge(1, 2, MessageKind.ACTIVATION), Edge(2, 1, MessageKind.GRADIENT)]
LOCAL = [e for e in EDGES if e not in REMOTE]


# ---------------------------------------------------------------- backend choice per edge

def test_rdma_without_a_device_stops_naming_the_reason():
    with pytest.raises(TransportError) as caught:
        plan_backends(EDGES, "rdma", HOSTS, shm_usable=True,
                      rdma_problems=[NO_DEVICE_REASON] * 4)
    message = str(caught.value)
    assert "--dpp-transport rdma" in message and NO_DEVICE_REASON in message
    assert "rank 1 on a" in message


def test_rdma_stops_when_one_end_of_a_cross_host_edge_has_no_device():
    with pytest.raises(TransportError, match="rank 2 on b cannot use RDMA: no RDMA device"):
        plan_backends(EDGES, "rdma", HOSTS, shm_usable=True,
                      rdma_problems=[None, None, NO_DEVICE_REASON, None])


def test_auto_without_a_device_keeps_torch_across_hosts():
    plan = plan_backends(EDGES, "auto", HOSTS, shm_usable=True,
                         rdma_problems=[NO_DEVICE_REASON] * 4)
    assert plan == [("shm", LOCAL), ("torch", REMOTE)]


@pytest.mark.parametrize("transport", ["auto", "rdma"])
def test_rdma_across_hosts_and_shm_within_when_devices_exist(transport):
    plan = plan_backends(EDGES, transport, HOSTS, shm_usable=True, rdma_problems=[None] * 4)
    assert plan == [("shm", LOCAL), ("rdma", REMOTE)]


def test_rdma_uses_torch_within_a_host_without_shm():
    plan = plan_backends(EDGES, "rdma", HOSTS, shm_usable=False, rdma_problems=[None] * 4)
    assert plan == [("rdma", REMOTE), ("torch", LOCAL)]


def test_auto_decides_per_edge_by_both_ends():
    # three hosts; rank 2 (host b) has no device: the edges touching it fall back to torch
    hosts = ["a", "b", "b", "c"]
    edges = pipeline_edges([[0, 1, 2, 3]], num_chunks=1)
    plan = dict(plan_backends(edges, "auto", hosts, shm_usable=True,
                              rdma_problems=[None, None, NO_DEVICE_REASON, None]))
    assert plan["rdma"] == [Edge(0, 1, MessageKind.ACTIVATION), Edge(1, 0, MessageKind.GRADIENT)]
    assert plan["shm"] == [Edge(1, 2, MessageKind.ACTIVATION), Edge(2, 1, MessageKind.GRADIENT)]
    assert plan["torch"] == [Edge(2, 3, MessageKind.ACTIVATION),
                             Edge(3, 2, MessageKind.GRADIENT)]


def test_rdma_on_one_host_needs_no_device():
    plan = plan_backends(EDGES, "rdma", ["a"] * 4, shm_usable=True, rdma_problems=None)
    assert plan == [("shm", EDGES)]


def test_shm_still_refuses_edges_across_hosts():
    with pytest.raises(TransportError, match="--dpp-transport shm: 2 pipeline edges cross hosts"):
        plan_backends(EDGES, "shm", HOSTS, shm_usable=True, rdma_problems=None)


@pytest.mark.skipif(not native.available(), reason="native transport extension not built")
def test_assign_backends_opens_rdma_across_hosts(monkeypatch):
    monkeypatch.setattr(pipeline, "_rdma_problems", lambda: [None] * 4)
    plan = pipeline._assign_backends(EDGES, "rdma", torch.device("cpu"), 12.0, native_inbox=True,
                                     hosts=HOSTS)
    assert [(backend.name, edges) for backend, edges in plan] == [("shm", LOCAL),
                                                                   ("rdma", REMOTE)]
    assert isinstance(plan[1][0], RdmaBackend) and plan[1][0].timeout == 12.0


@pytest.mark.skipif(bool(rdma.rdma_devices()), reason="this host has an RDMA device")
def test_assign_backends_reports_this_hosts_missing_rdma(monkeypatch):
    monkeypatch.setattr(pipeline, "_rdma_problems", lambda: [rdma.unavailable_reason()] * 4)
    reason = rdma.unavailable_reason()
    if native.build_info()["rdma"]:
        assert reason == NO_DEVICE_REASON
    with pytest.raises(TransportError) as caught:
        pipeline._assign_backends(EDGES, "rdma", torch.device("cpu"), 10.0, native_inbox=True,
                                  hosts=HOSTS)
    assert reason in str(caught.value)
    plan = pipeline._assign_backends(EDGES, "auto", torch.device("cpu"), 10.0, native_inbox=True,
                                     hosts=HOSTS)
    assert ("torch", REMOTE) in [(backend.name, edges) for backend, edges in plan]


# ---------------------------------------------------------------- channels

class ThreadExchange:
    """all_gather_object for ranks that are threads of this process."""

    def __init__(self, world_size: int):
        self._values: list = [None] * world_size
        self._barrier = threading.Barrier(world_size, timeout=THREAD_TIMEOUT_S)

    def for_rank(self, rank: int):
        def exchange(value):
            self._values[rank] = value
            self._barrier.wait()
            gathered = list(self._values)
            self._barrier.wait()  # nobody overwrites before everyone has read
            return gathered

        return exchange


def run_ranks_in_threads(world_size: int, body) -> list:
    """body(rank) on one thread per rank; their results, or the first rank's exception."""
    results: list = [None] * world_size
    errors: list = [None] * world_size

    def run(rank):
        try:
            results[rank] = body(rank)
        except BaseException as error:  # re-raised in the test's thread
            errors[rank] = error

    threads = [threading.Thread(target=run, args=(rank,), daemon=True)
               for rank in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(THREAD_TIMEOUT_S)
        assert not thread.is_alive(), "a rank hung"
    for error in errors:
        if error is not None:
            raise error
    return results


class FakeRdmaEnd:
    """The extension's RdmaChannel calls over a bounded queue (its slots), in one process."""

    _registry: dict[bytes, FakeRdmaEnd] = {}

    def __init__(self, sender: bool, slots: int):
        self.sender = sender
        self.token = uuid.uuid4().bytes
        FakeRdmaEnd._registry[self.token] = self
        self.arrivals: queue.Queue = queue.Queue(maxsize=slots)
        self.peer: FakeRdmaEnd | None = None
        self.interrupted = threading.Event()
        self.closed = False
        self._payload = b""

    def local_info(self) -> bytes:
        return self.token

    def connect(self, remote_info: bytes) -> None:
        self.peer = FakeRdmaEnd._registry[remote_info]

    def send(self, kind, chunk, microbatch, dtype, shape, address, nbytes) -> None:
        payload = ctypes.string_at(address, nbytes) if nbytes else b""
        meta = (kind, chunk, microbatch, dtype, tuple(shape), nbytes, False)
        self.peer.arrivals.put((meta, payload), timeout=THREAD_TIMEOUT_S)

    def close(self) -> None:
        if self.sender and self.peer is not None and not self.closed:  # as native: connected
            self.peer.arrivals.put(None, timeout=THREAD_TIMEOUT_S)
        self.closed = True

    def next(self):
        while not self.interrupted.is_set():
            try:
                item = self.arrivals.get(timeout=0.01)
            except queue.Empty:
                continue
            if item is None:
                return None
            meta, self._payload = item
            return meta
        return None

    def read_into(self, address, nbytes) -> bool:
        assert nbytes == len(self._payload)
        if nbytes:
            ctypes.memmove(address, self._payload, nbytes)
        return True

    def interrupt(self) -> None:
        self.interrupted.set()


class FakeRdmaBackend(RdmaBackend):
    """RdmaBackend whose native ends are FakeRdmaEnds (make_end(edge, rank) may replace them)."""

    def __init__(self, make_end=None, **kwargs):
        super().__init__(**kwargs)
        self.ends: list = []
        self._make_end = make_end or (lambda edge, rank: FakeRdmaEnd(edge.src == rank,
                                                                      self.slots))

    def _create_end(self, edge, rank):
        end = self._make_end(edge, rank)
        self.ends.append(end)
        return end


PAIR = [Edge(0, 1, MessageKind.ACTIVATION), Edge(1, 0, MessageKind.GRADIENT)]


def messages_of(rank: int) -> list[tuple[MessageKey, torch.Tensor]]:
    """What rank `rank` sends on its edge of PAIR: every wire dtype, a 0-d, an empty and a
    multi-slot tensor (30_000 fp32 = 15 slots of 8 KiB)."""
    kind = PAIR[rank].kind
    generator = torch.Generator().manual_seed(rank)
    tensors = [
        torch.randn(3, 5, generator=generator),
        torch.randn(2, 4, 6, generator=generator).to(torch.bfloat16),
        torch.randn(7, generator=generator).to(torch.float16),
        torch.tensor(2.5, dtype=torch.float64),
        torch.randint(-9, 9, (4, 2), generator=generator),
        torch.randint(-9, 9, (6,), generator=generator).to(torch.int32),
        torch.randint(-9, 9, (5,), generator=generator).to(torch.int8),
        torch.randint(0, 255, (3,), generator=generator).to(torch.uint8),
        torch.tensor([True, False, True]),
        torch.empty(0, 3, dtype=torch.float16),
        torch.randn(30_000, generator=generator),
        torch.randn(4, 8, generator=generator).t(),  # not contiguous
    ]
    return [(MessageKey(kind, chunk=index % 2, microbatch=index), tensor)
            for index, tensor in enumerate(tensors)]


def exchange_over(backends: list[RdmaBackend]):
    """Each rank of PAIR sends messages_of(rank) and takes the other's; returns
    [(rank's inbox after closing, what it received)]."""

    def body(rank):
        inbox = PythonInbox()
        senders, receivers = backends[rank].open(PAIR, rank, inbox)
        assert list(senders) == [PAIR[rank]] and list(receivers) == [PAIR[1 - rank]]
        for key, tensor in messages_of(rank):
            sent = tensor.clone()
            senders[PAIR[rank]].send(key, sent)
            sent.zero_()  # the channel must have kept its own copy
        received = {key: inbox.take(key, timeout=THREAD_TIMEOUT_S)
                    for key, _ in messages_of(1 - rank)}
        for channel in [*senders.values(), *receivers.values()]:
            channel.close()
        return inbox, received

    return run_ranks_in_threads(2, body)


def assert_received_everything(results):
    for rank, (inbox, received) in enumerate(results):
        for key, expected in messages_of(1 - rank):
            got = received[key]
            assert got.dtype == expected.dtype and got.shape == expected.shape, key
            assert got.device.type == "cpu"
            assert torch.equal(got, expected), key
        assert len(inbox) == 0


def test_channels_deliver_every_dtype_and_shape_into_the_inbox():
    exchange = ThreadExchange(2)
    backends = [FakeRdmaBackend(exchange=exchange.for_rank(rank), slots=2, slot_bytes=8192,
                                timeout=10.0) for rank in range(2)]
    assert_received_everything(exchange_over(backends))
    assert all(end.closed for backend in backends for end in backend.ends)


def test_send_checks_the_edge_kind_and_refuses_after_close():
    exchange = ThreadExchange(2)
    backends = [FakeRdmaBackend(exchange=exchange.for_rank(rank)) for rank in range(2)]

    def body(rank):
        senders, receivers = backends[rank].open(PAIR[:1], rank, PythonInbox())
        if rank == 0:
            channel = senders[PAIR[0]]
            with pytest.raises(TransportError, match="sent on a ACTIVATION channel"):
                channel.send(MessageKey(MessageKind.GRADIENT, 0, 0), torch.ones(2))
            with pytest.raises(TransportError, match="cannot be sent"):
                channel.send(MessageKey(MessageKind.ACTIVATION, 0, 0),
                             torch.ones(2, dtype=torch.complex64))
            channel.close()
            with pytest.raises(TransportError, match="closed rdma channel 0->1"):
                channel.send(MessageKey(MessageKind.ACTIVATION, 0, 0), torch.ones(2))
        for channel in receivers.values():
            channel.close()

    run_ranks_in_threads(2, body)


def test_a_failing_receive_fails_the_inbox_naming_the_edge():
    class BrokenLink(FakeRdmaEnd):
        def next(self):
            raise RuntimeError("completion with status IBV_WC_RETRY_EXC_ERR")

    def make_end(edge, rank):
        return (FakeRdmaEnd if edge.src == rank else BrokenLink)(edge.src == rank, 4)

    exchange = ThreadExchange(2)
    backends = [FakeRdmaBackend(make_end, exchange=exchange.for_rank(rank)) for rank in range(2)]

    def body(rank):
        inbox = PythonInbox()
        senders, receivers = backends[rank].open(PAIR[:1], rank, inbox)
        if rank == 1:
            with pytest.raises(TransportError) as caught:
                inbox.take(MessageKey(MessageKind.ACTIVATION, 0, 0), timeout=THREAD_TIMEOUT_S)
            assert "rdma channel 0->1 (ACTIVATION)" in str(caught.value)
            assert "IBV_WC_RETRY_EXC_ERR" in str(caught.value)
        for channel in [*senders.values(), *receivers.values()]:
            channel.close()

    run_ranks_in_threads(2, body)


class QueuePairFailsToConnect(FakeRdmaEnd):
    def connect(self, remote_info: bytes) -> None:
        super().connect(remote_info)
        raise RuntimeError("ibv_modify_qp to RTR: Invalid argument")


@pytest.mark.parametrize("step", ["create", "connect"])
def test_a_failed_open_on_one_rank_stops_every_rank(step):
    def make_end(edge, rank):
        if rank == 1 and step == "create":
            raise RuntimeError("ibv_create_qp: Cannot allocate memory")
        return (QueuePairFailsToConnect if rank == 1 else FakeRdmaEnd)(edge.src == rank, 4)

    exchange = ThreadExchange(2)
    backends = [FakeRdmaBackend(make_end, exchange=exchange.for_rank(rank)) for rank in range(2)]

    def body(rank):
        with pytest.raises(TransportError) as caught:
            backends[rank].open(PAIR, rank, PythonInbox())
        return str(caught.value)

    expected = {"create": "ibv_create_qp: Cannot allocate memory",
                "connect": "ibv_modify_qp to RTR: Invalid argument"}[step]
    for message in run_ranks_in_threads(2, body):
        assert "rank 1" in message and expected in message
    # rank 0's ends were stopped and let go, without writing a close marker to rank 1
    assert len(backends[0].ends) == 2
    assert all(end.interrupted.is_set() for end in backends[0].ends)
    assert all(end.arrivals.empty() for end in backends[1].ends)


def test_closing_a_receiver_whose_sender_never_closes_takes_at_most_the_timeout():
    exchange = ThreadExchange(2)
    backends = [FakeRdmaBackend(exchange=exchange.for_rank(rank), timeout=0.5)
                for rank in range(2)]
    opened = run_ranks_in_threads(2, lambda rank: backends[rank].open(PAIR[:1], rank,
                                                                       PythonInbox()))
    receiver = opened[1][1][PAIR[0]]
    started = time.monotonic()
    closing = threading.Thread(target=receiver.close, daemon=True)
    closing.start()
    closing.join(THREAD_TIMEOUT_S)
    assert not closing.is_alive(), "close() hung on a sender that never closes"
    assert 0.4 < time.monotonic() - started < 5.0  # waited for the close marker, then gave up
    assert backends[1].ends[0].interrupted.is_set()


@pytest.mark.skipif(bool(rdma.rdma_devices()), reason="this host has an RDMA device")
def test_open_without_a_device_fails_on_every_rank():
    exchange = ThreadExchange(2)
    backends = [RdmaBackend(exchange=exchange.for_rank(rank)) for rank in range(2)]

    def body(rank):
        with pytest.raises(TransportError) as caught:
            backends[rank].open(PAIR, rank, PythonInbox())
        return str(caught.value)

    for message in run_ranks_in_threads(2, body):
        assert rdma.unavailable_reason() in message


@pytest.mark.skipif(not rdma.rdma_devices(), reason=NO_DEVICE_REASON)
def test_loopback_exchange_over_real_queue_pairs():
    exchange = ThreadExchange(2)
    backends = [RdmaBackend(exchange=exchange.for_rank(rank), slots=4, slot_bytes=8192,
                            timeout=10.0) for rank in range(2)]
    assert_received_everything(exchange_over(backends))


def test_a_same_host_fallback_from_shm_warns_with_the_reason(monkeypatch, caplog):
    """Without the native extension, auto (and rdma) carry same-host edges over torch: one
    WARNING names why the extension does not import; --dpp-transport shm stops instead."""
    import logging

    from megatron.dpp.transport import native, pipeline
    from megatron.dpp.transport.channel import TransportError

    monkeypatch.setattr(native, "_load", lambda: (None, "No module named 'megatron.dpp._native'"))
    with caplog.at_level(logging.WARNING, logger=pipeline.__name__):
        assert pipeline._native_backend(60.0, "auto") is None
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert "fall back from shm" in record.message and "No module named" in record.message
    with pytest.raises(TransportError, match="No module named"):
        pipeline._native_backend(60.0, "shm")
