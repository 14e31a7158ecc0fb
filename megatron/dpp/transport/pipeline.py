"""The channels of one rank's pipeline edges, with the backend chosen per edge.

Edges are the hops the topology (megatron/dpp/topology.py) sends outputs along:
activations r -> r+1 and gradients r+1 -> r within every pipeline; with virtual chunks
the ring closes (last rank -> rank 0 for activations, rank 0 -> last rank for gradients).
Opening is collective over the whole job.

Pods are the nodes of the launcher (`--node-ips`), which may share a host: an edge between
two pods never takes shared memory or CUDA IPC, it takes RDMA where a device exists, else
torch.distributed. An emulated link (emulation.py) delays each message of its edges on the
sending side, whatever backend carries it.
"""

from __future__ import annotations

import datetime
import functools
import logging
import os
import random
import sys
import threading
import time
from collections.abc import Iterable

import torch
import torch.distributed as dist

from megatron.dpp.actions import FORWARD
from megatron.dpp.config import TRANSPORTS
from megatron.dpp.topology import PipelineTopology
from megatron.dpp.transport.channel import (
    Edge,
    MessageKey,
    MessageKind,
    PythonInbox,
    SendChannel,
    TransportError,
    brief,
)
from megatron.dpp.transport.emulation import CudaLink, CudaSleep, DelayedDelivery, EdgeDelays
from megatron.dpp.transport.native import NativeInbox, make_inbox
from megatron.dpp.variability import Emulation

log = logging.getLogger(__name__)
# each rank's line per pipeline edge it owns, naming its transport: logged on every rank
EDGE_LOGGER = "megatron.dpp.transport.edges"
edge_log = logging.getLogger(EDGE_LOGGER)

# test hook: deliver each arrival after a random delay of up to this many milliseconds
JITTER_ENV = "DPP_TEST_DELIVERY_JITTER_MS"


def pipeline_edges(pipelines: list[list[int]], num_chunks: int) -> list[Edge]:
    """The edges of every pipeline (its global ranks in pipeline order), each pipeline
    holding `num_chunks` model chunks per rank. A rank never sends to itself (DPP runs
    with more than one pipeline rank)."""
    edges = set()
    for ranks in pipelines:
        topology = PipelineTopology(len(ranks), num_chunks)
        for src, dst, kind in topology.message_edges():
            if src != dst:
                message = MessageKind.ACTIVATION if kind == FORWARD else MessageKind.GRADIENT
                edges.add(Edge(ranks[src], ranks[dst], message))
    # a canonical order, identical on every rank
    return sorted(edges, key=lambda e: (e.src, e.dst, int(e.kind)))


class JitterInbox(PythonInbox):
    """Delays every arrival by a random time (tests: any arrival order must give the same
    result and never deadlock). Arrivals pass through Python here, so only the torch
    backend runs with it."""

    def __init__(self, max_delay_s: float, seed: int):
        super().__init__()
        self._max_delay = max_delay_s
        self._rng = random.Random(seed)
        self._rng_lock = threading.Lock()

    def put(self, key, tensor, ready=None) -> None:
        with self._rng_lock:
            delay = self._rng.uniform(0, self._max_delay)
        timer = threading.Timer(delay, super().put, args=(key, tensor, ready))
        timer.daemon = True
        timer.start()


class EmulatedSendChannel(SendChannel):
    """A send channel whose messages leave once the edge's emulated delay has passed since
    `send`, which returns at once. On CPU a delivery thread hands each message to the real
    channel; on a GPU the real channel is given it on a link stream that sleeps first (its
    ready event is recorded there, so the consumer's stream waits, never the producer's).
    RDMA stages GPU messages through the host synchronously: there too a delivery thread
    sends, on a side stream that waits for the producer's event."""

    def __init__(self, inner: SendChannel, delays: EdgeDelays, device: torch.device,
                 sleeper: CudaSleep | None, timeout: float, host_staged: bool):
        self.edge, self.inner, self.timeout = inner.edge, inner, timeout
        self.delays = delays
        gpu = device.type == "cuda"
        self._cuda = CudaLink(sleeper, device) if gpu and not host_staged else None
        self._delivery = None if self._cuda else DelayedDelivery(str(self.edge))
        self._side = torch.cuda.Stream(device) if gpu and host_staged else None

    def send(self, key: MessageKey, tensor: torch.Tensor) -> None:
        # the channel's own reference: the schedule frees its output's storage after sending
        tensor = tensor.detach()
        delay_s = self.delays.of(key, tensor.numel() * tensor.element_size())
        if self._cuda is not None:
            stream, _ = self._cuda.delayed_stream(delay_s)
            tensor.record_stream(stream)
            with torch.cuda.stream(stream):
                self.inner.send(key, tensor)
            return
        if self._side is None:
            deliver = functools.partial(self.inner.send, key, tensor)
        else:
            ready = torch.cuda.Event()
            ready.record()
            deliver = functools.partial(self._send_after, ready, key, tensor)
        try:
            self._delivery.post(deliver, delay_s)
        except RuntimeError as error:
            raise TransportError(str(error)) from error

    def _send_after(self, ready, key: MessageKey, tensor: torch.Tensor) -> None:
        with torch.cuda.stream(self._side):
            self._side.wait_event(ready)
            self.inner.send(key, tensor)

    def flush(self, timeout: float | None = None) -> None:
        if self._delivery is not None:
            try:
                self._delivery.drain(timeout)
            except (RuntimeError, TimeoutError) as error:
                raise TransportError(str(error)) from error
        self.inner.flush(timeout)

    def close(self, abort: bool = False) -> None:
        if self._delivery is not None:
            self._delivery.close(abort, self.timeout)
        self.inner.close(abort)


class PipelineTransport:
    """This rank's send channels (by destination rank and kind) and its inbox. `pod`: this
    rank's pod (its node's address under --node-ips; default its host name); `emulation`:
    the emulated links to apply to the edges it selects."""

    def __init__(self, pipeline_ranks: list[int], num_chunks: int, device: torch.device,
                 transport: str, timeout: float, pod: str | None = None,
                 emulation: Emulation | None = None):
        if transport not in TRANSPORTS:
            raise ValueError(f"--dpp-transport {transport}: choose one of {', '.join(TRANSPORTS)}")
        self.rank = dist.get_rank()
        self.timeout = timeout
        jitter_ms = float(os.environ.get(JITTER_ENV, "0"))
        self.inbox = JitterInbox(jitter_ms / 1000.0, self.rank) if jitter_ms > 0 else make_inbox()
        pipelines = _all_pipelines(pipeline_ranks)
        self.barrier_group = None
        for ranks in pipelines:
            group = dist.new_group(ranks, backend="gloo")
            if self.rank in ranks:
                self.barrier_group = group
        edges = pipeline_edges(pipelines, num_chunks)
        self._senders = {}
        self._receivers = {}
        native_inbox = isinstance(self.inbox, NativeInbox)
        stage_of = {rank: stage for ranks in pipelines for stage, rank in enumerate(ranks)}
        self._emulated: list[EmulatedSendChannel] = []
        pods = _gather(pod or os.uname().nodename)
        sleeper = CudaSleep() if device.type == "cuda" else None
        for backend, backend_edges in _assign_backends(edges, transport, device, timeout,
                                                       native_inbox, pods):
            senders, receivers = backend.open(backend_edges, self.rank, self.inbox)
            for edge in [e for e in backend_edges if self.rank in (e.src, e.dst)]:
                link = emulation.link_between(pods[edge.src], pods[edge.dst]) \
                    if emulation is not None else None
                if link is not None and edge in senders:
                    delays = EdgeDelays(emulation, stage_of[edge.src], stage_of[edge.dst])
                    senders[edge] = EmulatedSendChannel(
                        senders[edge], delays, device, sleeper, timeout,
                        host_staged=backend.name == "rdma")
                    self._emulated.append(senders[edge])
                edge_log.info("DPP transport %s for edge %s%s", backend.name, edge_label(edge),
                              _edge_note(pods[edge.src], pods[edge.dst], link is not None))
            self._senders.update(senders)
            self._receivers.update(receivers)
        self._by_destination = {(e.dst, e.kind): ch for e, ch in self._senders.items()}
        self.inbox.set_sources(self._receivers)

    def set_iteration(self, iteration: int) -> None:
        """The training iteration the next messages belong to: part of each emulated
        message's delay draw."""
        for channel in self._emulated:
            channel.delays.iteration = iteration

    def send(self, dst: int, key: MessageKey, tensor: torch.Tensor) -> None:
        try:
            channel = self._by_destination[(dst, key.kind)]
        except KeyError:
            raise TransportError(f"rank {self.rank} has no {key.kind.name} channel to rank {dst}")\
                from None
        channel.send(key, tensor)

    def barrier(self) -> None:
        """Every stage of this pipeline has finished the previous schedule call: message keys
        repeat from call to call, and a stage that never waits (forward-only) must not run
        a whole call ahead. Each stage sends every other one a token and waits for theirs,
        so a stage that does not come within the timeout is named."""
        peers = [r for r in dist.get_process_group_ranks(self.barrier_group) if r != self.rank]
        deadline = time.monotonic() + self.timeout
        token = torch.zeros(1)
        sends = [dist.isend(token, peer, group=self.barrier_group) for peer in peers]
        tokens = {peer: torch.zeros(1) for peer in peers}
        receipts = {peer: dist.irecv(tokens[peer], peer, group=self.barrier_group)
                    for peer in peers}
        for peer, work in [*receipts.items(), *zip(peers, sends, strict=True)]:
            remaining = max(deadline - time.monotonic(), 0.001)
            try:
                work.wait(datetime.timedelta(seconds=remaining))
            except RuntimeError as error:
                failure = TransportError(
                    f"pipeline peer rank {peer} failed, disconnected or did not reach the start "
                    f"of this schedule call within {self.timeout:g} s ({brief(error)})")
                self.inbox.fail(failure)
                raise failure from error

    def take(self, key: MessageKey) -> torch.Tensor:
        """The message `key`, waiting up to the timeout; a timeout names its peer."""
        return self.inbox.take(key, self.timeout)

    def wait(self, seen_version: int, expecting: Iterable[MessageKey] = ()) -> int:
        """The inbox's `wait` with this transport's timeout; `expecting` (the messages the
        caller can use) names what a timeout waited for."""
        return self.inbox.wait(seen_version, self.timeout, expecting)

    def flush(self) -> None:
        for channel in self._senders.values():
            channel.flush(self.timeout)

    def close(self, abort: bool | None = None) -> None:
        """Close every channel; waits on peers are bounded by the timeout. `abort` releases
        everything at once without waiting for any peer; by default it is on when a channel
        failed or when an exception is propagating (an ExitStack unwinding after an error),
        for then a peer may be hung or gone."""
        if abort is None:
            abort = self.inbox.failure is not None or sys.exc_info()[1] is not None
        problems = []
        for channel in [*self._senders.values(), *self._receivers.values()]:
            try:
                channel.close(abort=abort)
            except TransportError as error:
                problems.append(error)
        self._senders.clear()
        self._receivers.clear()
        if abort:
            for problem in problems:
                log.debug("closing after a failure: %s", problem)
        elif problems:
            raise TransportError("; ".join(map(str, problems)))


def _gather(value) -> list:
    """`value` of every rank, by rank."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def _all_pipelines(mine: list[int]) -> list[list[int]]:
    return [list(p) for p in sorted({tuple(p) for p in _gather(list(mine))})]


def edge_label(edge: Edge) -> str:
    return f"{edge.src}->{edge.dst}:{edge.kind.name[0]}"


def _edge_note(src_pod: str, dst_pod: str, emulated: bool) -> str:
    where = "" if src_pod == dst_pod else f"across pods {src_pod} -> {dst_pod}"
    notes = [note for note in (where, "emulated link" if emulated else "") if note]
    return f" ({', '.join(notes)})" if notes else ""


def _assign_backends(edges, transport, device, timeout, native_inbox, hosts):
    """[(backend, its edges)] in an order every rank agrees on. The shared-memory backend
    needs the inbox to be a NativeInbox; `hosts[r]` is rank r's pod: edges between pods
    are edges across hosts."""
    from megatron.dpp.transport.rdma import RdmaBackend
    from megatron.dpp.transport.torch_backend import TorchBackend

    if transport == "torch":
        return [(TorchBackend(device, timeout), edges)]
    native = _native_backend(timeout, transport)
    if native is not None and not native_inbox:
        if transport == "shm":
            raise TransportError(f"--dpp-transport shm does not run with {JITTER_ENV} (the "
                                 "delayed delivery is a torch-backend test hook)")
        native = None
    crosses_hosts = any(hosts[e.src] != hosts[e.dst] for e in edges)
    # gathered, not local: every rank must reach the same plan (opening is collective)
    rdma_problems = _rdma_problems() if crosses_hosts and transport in ("rdma", "auto") else None
    plan = plan_backends(edges, transport, hosts, shm_usable=native is not None,
                         rdma_problems=rdma_problems)
    fallback = [e for name, group in plan if name == "torch" for e in group
                if hosts[e.src] != hosts[e.dst]]
    if transport == "auto" and fallback:
        rank = next(r for r in (fallback[0].src, fallback[0].dst) if rdma_problems[r])
        log.info("DPP transport auto: torch for %d edges across hosts (e.g. rank %d on %s "
                 "cannot use RDMA: %s)", len(fallback), rank, hosts[rank], rdma_problems[rank])
    make = {"shm": lambda: native, "torch": lambda: TorchBackend(device, timeout),
            "rdma": lambda: RdmaBackend(device, timeout=timeout)}
    return [(make[name](), group) for name, group in plan]


BACKEND_ORDER = ("shm", "rdma", "torch")


def plan_backends(edges: list[Edge], transport: str, hosts: list[str], shm_usable: bool,
                  rdma_problems: list[str | None] | None) -> list[tuple[str, list[Edge]]]:
    """Which backend carries each edge: [(backend name, its edges)], in BACKEND_ORDER, each
    group in the order of `edges`. `hosts[r]` is rank r's host; `rdma_problems[r]` says why
    rank r cannot open RDMA channels (None: it can); needed only when an edge crosses hosts
    under --dpp-transport rdma or auto.

    Edges within a host use shm where usable, else torch. Edges across hosts: rdma uses RDMA
    and stops when an end cannot; auto uses RDMA where both ends can, torch otherwise.
    """
    choice: dict[Edge, str] = {}
    for edge in edges:
        if transport == "torch":
            choice[edge] = "torch"
        elif hosts[edge.src] == hosts[edge.dst]:
            choice[edge] = "shm" if shm_usable else "torch"
        elif transport == "shm":
            remote = [e for e in edges if hosts[e.src] != hosts[e.dst]]
            raise TransportError(
                f"--dpp-transport shm: {len(remote)} pipeline edges cross hosts "
                f"(e.g. rank {edge.src} on {hosts[edge.src]} -> rank {edge.dst} on "
                f"{hosts[edge.dst]}); use --dpp-transport auto")
        else:
            choice[edge] = _cross_host_backend(edge, transport, hosts, rdma_problems)
    return [(name, [e for e in edges if choice[e] == name]) for name in BACKEND_ORDER
            if name in choice.values()]


def _cross_host_backend(edge: Edge, transport: str, hosts: list[str],
                        rdma_problems: list[str | None] | None) -> str:
    if rdma_problems is None:
        raise ValueError(f"--dpp-transport {transport} with edges across hosts needs "
                         "rdma_problems")
    for rank in (edge.src, edge.dst):
        problem = rdma_problems[rank]
        if problem is None:
            continue
        if transport == "rdma":
            raise TransportError(
                f"--dpp-transport rdma: pipeline edge {edge.src}->{edge.dst} crosses hosts, but "
                f"rank {rank} on {hosts[rank]} cannot use RDMA: {problem}; use --dpp-transport "
                "auto or torch")
        return "torch"
    return "rdma"


def _rdma_problems() -> list[str | None]:
    from megatron.dpp.transport.rdma import unavailable_reason

    return _gather(unavailable_reason())


def _native_backend(timeout: float, transport: str):
    """The shm backend, or None where the native extension does not import (--dpp-transport
    shm then stops, naming why; auto and rdma warn that same-host edges take torch)."""
    from megatron.dpp.transport import native

    if not native.available():
        if transport == "shm":
            native.module()  # raises, saying why the extension does not import
        log.warning("DPP transport %s: edges within this host fall back from shm to the "
                    "slower torch transport: %s", transport, native.unavailable_reason())
        return None
    from megatron.dpp.transport.shm import ShmBackend

    return ShmBackend(timeout=timeout)
