"""ibverbs RDMA channels for pipeline edges that cross hosts (native extension, csrc/).

Each edge is one RC queue pair between the two ranks' RdmaChannel ends: the sender
RDMA-writes fragments into the receiver's registered slots and gets credits back (see
csrc/rdma.h). The ends exchange their connection info through torch.distributed. The
native receiver has no drain thread of its own, so a Python thread per receive channel
copies every arrival into a fresh tensor and puts it into the rank's Inbox (a NativeInbox
or a PythonInbox: both take `put` and `fail` from any thread).

The channel carries host memory only: GPU tensors are staged through a host copy.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist

from megatron.dpp.transport import native
from megatron.dpp.transport.channel import (
    CODE_DTYPES,
    Backend,
    Edge,
    Inbox,
    MessageKey,
    MessageKind,
    RecvChannel,
    SendChannel,
    TransportError,
)

logger = logging.getLogger(__name__)

DEVICE_ENV = "DPP_RDMA_DEVICE"
GID_INDEX_ENV = "DPP_RDMA_GID_INDEX"
DEFAULT_PORT = 1
NO_DEVICE = "no RDMA device (ibv_get_device_list is empty)"

# gathers one picklable object per rank, in rank order (collective over the job)
Exchange = Callable[[object], list]


def rdma_devices() -> list[str]:
    """The RDMA devices ibverbs sees; empty where the extension has no RDMA part."""
    if not native.build_info()["rdma"]:
        return []
    return list(native.module().rdma_devices())


def unavailable_reason() -> str | None:
    """Why this process cannot open RDMA channels, or None when it can."""
    if not native.available():
        try:
            native.module()
        except TransportError as error:
            return str(error)
    if not native.build_info()["rdma"]:
        return ("the native transport was built without RDMA (no libibverbs headers at build "
                "time, or DPP_NO_RDMA=1)")
    devices = rdma_devices()
    if not devices:
        return NO_DEVICE
    wanted = os.environ.get(DEVICE_ENV)
    if wanted and wanted not in devices:
        return f"{DEVICE_ENV}={wanted} is not one of this host's RDMA devices {devices}"
    return None


def _edge_name(edge: Edge) -> str:
    return f"rdma channel {edge.src}->{edge.dst} ({edge.kind.name})"


def _as_transport_error(error: Exception, edge: Edge) -> TransportError:
    if isinstance(error, TransportError):
        return TransportError(f"{_edge_name(edge)}: {error}")
    return TransportError(f"{_edge_name(edge)}: {type(error).__name__}: {error}")


def _all_gather(value: object) -> list:
    if not dist.is_initialized():
        raise TransportError("RdmaBackend.open needs torch.distributed initialised (the channel "
                             "ends exchange their queue-pair info through it)")
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


class RdmaSendChannel(SendChannel):
    def __init__(self, edge: Edge, end):
        self.edge = edge
        self._end = end
        # the native end is not thread-safe: one send (or close) at a time
        self._lock = threading.Lock()
        self._closed = False

    def send(self, key: MessageKey, tensor: torch.Tensor) -> None:
        code = self._wire_code(key, tensor)
        # The channel reads host memory only. A synchronous device-to-host copy (it waits
        # for the producing stream) is the simple, correct staging; cross-host links are
        # slower than this copy.
        data = tensor.detach().cpu().contiguous()
        with self._lock:
            if self._closed:
                raise TransportError(f"send of {key} on closed {_edge_name(self.edge)}")
            try:
                # returns once the payload is copied into registered memory, so `data` may go
                self._end.send(int(key.kind), key.chunk, key.microbatch, code, list(data.shape),
                               data.data_ptr(), data.numel() * data.element_size())
            except Exception as error:
                raise _as_transport_error(error, self.edge) from error

    def flush(self, timeout: float | None = None) -> None:
        # Every payload left the caller's memory when send() returned; close() waits for
        # the peer's acknowledgement of the last writes.
        pass

    def close(self, abort: bool = False) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if abort:
                # dropped, not closed: the close marker would wait for a credit from a peer
                # that may never give one; dropping destroys the queue pair
                self._end.interrupt()
                self._end = None
                return
            try:
                self._end.close()
            except Exception as error:
                raise _as_transport_error(error, self.edge) from error


class RdmaRecvChannel(RecvChannel):
    """The receiving end: a Python thread moves each arrival into a tensor (on `device`
    when the rank runs on a GPU) and puts it into the Inbox."""

    def __init__(self, edge: Edge, end, inbox: Inbox, device: torch.device | None,
                 close_wait_s: float):
        self.edge = edge
        self._end = end
        self._inbox = inbox
        self._close_wait_s = close_wait_s
        self._device = device if device is not None and device.type == "cuda" else None
        self._copy_stream = None
        self._consumer_stream = None
        if self._device is not None:
            self._copy_stream = torch.cuda.Stream(self._device)
            # arrivals are used on the stream that was current at open
            self._consumer_stream = torch.cuda.current_stream(self._device)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._drain,
                                        name=f"dpp-rdma-recv-{edge.src}->{edge.dst}",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _drain(self) -> None:
        try:
            while True:
                message = self._end.next()
                if message is None:  # the sender closed the channel, or close() interrupted
                    return
                kind, chunk, microbatch, code, shape, nbytes, _ = message
                key = MessageKey(MessageKind(kind), chunk, microbatch)
                if key.kind != self.edge.kind:
                    raise TransportError(f"{key} arrived on a {self.edge.kind.name} channel")
                if code not in CODE_DTYPES:
                    raise TransportError(f"{key} has unknown dtype code {code}")
                tensor = torch.empty(tuple(shape), dtype=CODE_DTYPES[code])
                if tensor.numel() * tensor.element_size() != nbytes:
                    raise TransportError(f"{key}: {nbytes} bytes do not make a "
                                         f"{tensor.dtype} tensor of shape {tuple(shape)}")
                if not self._end.read_into(tensor.data_ptr(), nbytes):
                    if self._stopping.is_set():
                        return
                    raise TransportError(f"{key} arrived incomplete")
                self._inbox.put(key, self._to_device(tensor))
        except Exception as error:
            if not self._stopping.is_set():
                # the schedule reports it, once, from the inbox
                logger.debug("%s failed: %s", _edge_name(self.edge), error)
                self._inbox.fail(_as_transport_error(error, self.edge))

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._device is None:
            return tensor
        with torch.cuda.stream(self._copy_stream):
            on_device = tensor.to(self._device)
            self._copy_stream.synchronize()
        # keep the allocator from reusing the memory while the consumer's stream reads it
        on_device.record_stream(self._consumer_stream)
        return on_device

    def close(self, abort: bool = False) -> None:
        # Let the sender's close marker arrive first: tearing the queue pair down under a
        # sender that is still closing would fail its last write. A peer that never closes
        # (it died) costs at most `close_wait_s`; after a failure (abort) nothing is awaited.
        if self._thread.is_alive() and not abort:
            self._thread.join(self._close_wait_s)
        self._stopping.set()
        self._end.interrupt()
        self._thread.join()
        try:
            self._end.close()
        except Exception as error:
            raise _as_transport_error(error, self.edge) from error


class RdmaBackend(Backend):
    """RDMA channels for edges between ranks of different hosts.

    `slots` x `slot_bytes` is each channel's registered ring on both ends (larger messages
    are split into consecutive slots). `timeout` bounds every wait on the peer except the
    receiver's idle wait for the next message (a sender that dies is noticed by the
    schedule's own timeout). The ibverbs device is `rdma_device`, else $DPP_RDMA_DEVICE,
    else the first one ibverbs lists; the GID index is `gid_index`, else
    $DPP_RDMA_GID_INDEX, else 0 (RoCE needs a GID; < 0 uses the LID only, InfiniBand).
    `device` is the rank's torch device: arrivals move there when it is a GPU. `exchange`
    replaces the all_gather_object over the default process group that the ends use to
    trade connection info (tests run both ends in one process with it).
    """

    name = "rdma"

    def __init__(self, device: torch.device | None = None, timeout: float = 60.0,
                 slots: int = 8, slot_bytes: int = 4 << 20, rdma_device: str | None = None,
                 port: int = DEFAULT_PORT, gid_index: int | None = None,
                 exchange: Exchange | None = None):
        if timeout <= 0:
            raise ValueError(f"RdmaBackend timeout must be > 0 s, got {timeout}")
        if slots < 2:
            raise ValueError(f"RdmaBackend slots must be >= 2, got {slots}")
        if slot_bytes < 4096:
            raise ValueError(f"RdmaBackend slot_bytes must be >= 4096, got {slot_bytes}")
        self.device = device
        self.timeout = timeout
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.rdma_device = rdma_device
        self.port = port
        self.gid_index = (int(os.environ.get(GID_INDEX_ENV, "0")) if gid_index is None
                          else gid_index)
        self._exchange = exchange or _all_gather

    def _device_name(self) -> str:
        if self.rdma_device is not None:
            return self.rdma_device
        reason = unavailable_reason()
        if reason is not None:
            raise TransportError(f"RdmaBackend: {reason}")
        return os.environ.get(DEVICE_ENV) or rdma_devices()[0]

    def _create_end(self, edge: Edge, rank: int):
        """This rank's native end of `edge`, not yet connected."""
        sender = edge.src == rank
        peer = edge.dst if sender else edge.src
        return native.module().RdmaChannel(self._device_name(), self.port, self.gid_index,
                                           sender, self.slots, self.slot_bytes, rank, peer,
                                           self.timeout)

    def _agree(self, failure: str | None, payload: object = None) -> list:
        """Exchange (failure, payload) with every rank; raise if any rank failed, so that
        every rank stops at the same step instead of waiting on a peer that gave up."""
        gathered = self._exchange((failure, payload))
        failures = [text for text, _ in gathered if text is not None]
        if failures:
            raise TransportError(f"RdmaBackend.open failed: {'; '.join(failures)}")
        return [item for _, item in gathered]

    def open(self, edges: list[Edge], rank: int, inbox: Inbox):
        if len(set(edges)) != len(edges):
            raise TransportError(f"duplicate edges given to RdmaBackend.open: {edges}")
        mine = {index: edge for index, edge in enumerate(edges) if rank in (edge.src, edge.dst)}
        ends: dict[Edge, object] = {}
        try:
            failure, infos = None, {}
            try:
                for index, edge in mine.items():
                    ends[edge] = self._create_end(edge, rank)
                    infos[index] = ends[edge].local_info()
            except Exception as error:  # still join the exchange, or the others hang in it
                failure = f"rank {rank}: {_as_transport_error(error, edge)}"
            peer_infos = self._agree(failure, infos)
            failure = None
            try:
                for index, edge in mine.items():
                    peer = edge.dst if edge.src == rank else edge.src
                    ends[edge].connect(peer_infos[peer][index])
            except Exception as error:
                failure = f"rank {rank}: {_as_transport_error(error, edge)}"
            # also a barrier: every queue pair is ready before any rank sends on one
            self._agree(failure)
        except Exception as error:
            # Dropped, not closed: a connected sender's close() would write a close marker
            # to a peer that is giving up as well. Dropping destroys the queue pairs.
            for end in ends.values():
                end.interrupt()
            ends.clear()
            if isinstance(error, TransportError):
                raise
            raise TransportError(f"RdmaBackend.open on rank {rank} failed: {error}") from error
        senders: dict[Edge, SendChannel] = {}
        receivers: dict[Edge, RecvChannel] = {}
        for edge, end in ends.items():
            if edge.src == rank:
                senders[edge] = RdmaSendChannel(edge, end)
            else:
                receiver = RdmaRecvChannel(edge, end, inbox, self.device, self.timeout)
                receiver.start()
                receivers[edge] = receiver
        return senders, receivers
