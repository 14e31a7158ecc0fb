"""Channels over torch.distributed send/recv on dedicated two-rank process groups.

Works wherever torch.distributed does: gloo between CPU processes, NCCL between GPUs
(headers then travel on a gloo group, payloads on an NCCL group). Each channel has one
thread on each side; a channel's messages arrive in the order they were sent, so the
header / payload pairs of the two sides always match.
"""

from __future__ import annotations

import logging
import queue
import threading

import torch
import torch.distributed as dist

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
    brief,
    dtype_code,
)

log = logging.getLogger(__name__)

MAX_DIMS = 8
HEADER_LEN = 6 + MAX_DIMS  # flag, kind, chunk, microbatch, dtype, ndim, dims...
_DATA, _CLOSE = 0, 1
# After a failure, how long a send thread may take to hand the close header over before
# it is left behind (it may be blocked on a peer that is stopped).
ABORT_GRACE_S = 0.5


def encode_header(key: MessageKey, tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dim() > MAX_DIMS:
        raise TransportError(f"cannot send a {tensor.dim()}-d tensor (at most {MAX_DIMS})")
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[:6] = torch.tensor(
        [_DATA, int(key.kind), key.chunk, key.microbatch, dtype_code(tensor.dtype), tensor.dim()]
    )
    header[6 : 6 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
    return header


def decode_header(header: torch.Tensor) -> tuple[MessageKey, torch.dtype, tuple[int, ...]]:
    values = header.tolist()
    _, kind, chunk, microbatch, code, ndim = values[:6]
    if code not in CODE_DTYPES or not 0 <= ndim <= MAX_DIMS:
        raise TransportError(f"malformed message header {values}")
    key = MessageKey(MessageKind(kind), chunk, microbatch)
    return key, CODE_DTYPES[code], tuple(values[6 : 6 + ndim])


class _Groups:
    """The process groups of one edge: headers always on gloo (no device sync to read
    them), payloads on the device's backend."""

    def __init__(self, header, payload):
        self.header, self.payload = header, payload


class TorchSendChannel(SendChannel):
    def __init__(self, edge: Edge, groups: _Groups, device: torch.device, timeout: float):
        self.edge, self.groups, self.device, self.timeout = edge, groups, device, timeout
        self._queue: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._thread = threading.Thread(
            target=self._run, name=f"dpp-send-{edge.src}->{edge.dst}", daemon=True
        )
        self._thread.start()

    def send(self, key: MessageKey, tensor: torch.Tensor) -> None:
        if self._error is not None:
            raise TransportError(f"send to rank {self.edge.dst} failed: {self._error}")
        tensor = tensor.detach()
        ready = None
        if self._stream is not None:
            # the producer's stream must finish writing before the side stream reads
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        self._queue.put((key, tensor, ready))

    def flush(self, timeout: float | None = None) -> None:
        done = threading.Event()
        self._queue.put(done)
        if not done.wait(timeout):
            raise TransportError(f"timed out flushing sends to rank {self.edge.dst}")
        if self._error is not None:
            raise TransportError(f"send to rank {self.edge.dst} failed: {self._error}")

    def close(self, abort: bool = False) -> None:
        # torch.distributed cannot interrupt a send: a thread still blocked on a hung peer
        # is left behind (a daemon; it ends with the process)
        self._queue.put(None)
        self._thread.join(ABORT_GRACE_S if abort else self.timeout)
        if self._thread.is_alive() and not abort:
            raise TransportError(
                f"closing edge {self.edge}: pipeline peer rank {self.edge.dst} did not take "
                f"this rank's messages within {self.timeout:g} s")

    def _run(self) -> None:
        dst = self.edge.dst
        while True:
            item = self._queue.get()
            if isinstance(item, threading.Event):
                item.set()
                continue
            try:
                if item is None:
                    closing = torch.zeros(HEADER_LEN, dtype=torch.int64)
                    closing[0] = _CLOSE
                    dist.send(closing, dst, group=self.groups.header)
                    return
                self._send_one(*item)
            except Exception as error:  # the peer is gone: reported by the next send/flush
                self._error = error
                log.debug("DPP channel %s: %s", self.edge, error)
                if item is None:
                    return

    def _send_one(self, key, tensor, ready) -> None:
        dst = self.edge.dst
        if ready is not None:
            # announce only data that exists: the receiver posts its NCCL receive on the
            # header, and a receive posted early spins on the peer GPU's SMs until the
            # data comes, slowing its compute (a host running ahead, e.g. replaying CUDA
            # graphs, would announce a whole iteration early)
            ready.synchronize()
        dist.send(encode_header(key, tensor), dst, group=self.groups.header)
        if tensor.numel() == 0:
            return
        payload = tensor.contiguous().view(-1).view(torch.uint8)
        if self._stream is None:
            dist.send(payload, dst, group=self.groups.payload)
            return
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(ready)
            dist.send(payload, dst, group=self.groups.payload)
            # hold the tensor until the transfer is done, without blocking compute
            self._stream.synchronize()


class TorchRecvChannel(RecvChannel):
    def __init__(self, edge: Edge, groups: _Groups, device: torch.device, inbox: Inbox,
                 timeout: float):
        self.edge, self.groups, self.device, self.inbox = edge, groups, device, inbox
        self.timeout = timeout
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._thread = threading.Thread(
            target=self._run, name=f"dpp-recv-{edge.src}->{edge.dst}", daemon=True
        )
        self._thread.start()

    def close(self, abort: bool = False) -> None:
        # The sender's close header ends the thread, a dead sender an error. A receive on a
        # hung peer cannot be interrupted: after a failure the thread is left behind (a
        # daemon, it ends with the process), otherwise it gets the timeout.
        if abort:
            return
        self._thread.join(self.timeout)
        if self._thread.is_alive():
            raise TransportError(
                f"closing edge {self.edge}: pipeline peer rank {self.edge.src} did not close "
                f"it within {self.timeout:g} s")

    def _run(self) -> None:
        src = self.edge.src
        header = torch.zeros(HEADER_LEN, dtype=torch.int64)
        try:
            while True:
                dist.recv(header, src, group=self.groups.header)
                if int(header[0]) == _CLOSE:
                    return
                key, dtype, shape = decode_header(header)
                self.inbox.put(key, *self._receive_payload(dtype, shape))
        except Exception as error:
            self.inbox.fail(TransportError(
                f"pipeline peer rank {src} failed or disconnected (edge {self.edge}) while "
                f"this rank waited for its {self.edge.kind.name.lower()} messages: {brief(error)}"))

    def _receive_payload(self, dtype: torch.dtype, shape: tuple[int, ...]):
        """(the payload's tensor, None or the CUDA event after which it is written). On a
        GPU the receive is only queued on this channel's stream: the message is announced
        at once, and the consumer's stream waits for the event, not its host."""
        numel = 1
        for dim in shape:
            numel *= dim
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if self._stream is None:
            buffer = torch.empty(nbytes, dtype=torch.uint8)
            if nbytes:
                dist.recv(buffer, self.edge.src, group=self.groups.payload)
            return buffer.view(dtype).view(shape), None
        with torch.cuda.stream(self._stream):
            buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            if nbytes:
                dist.recv(buffer, self.edge.src, group=self.groups.payload)
            received = torch.cuda.Event()
            received.record(self._stream)
        # the consumer reads it on the default stream; keep the allocator from reusing it early
        buffer.record_stream(torch.cuda.default_stream(self.device))
        return buffer.view(dtype).view(shape), received


class TorchBackend(Backend):
    """`timeout` bounds a normal close's wait for the peer's side; the receive threads'
    idle waits for the next message have none (the schedule's own waits do)."""

    name = "torch"

    def __init__(self, device: torch.device, timeout: float = 60.0):
        self.device = device
        self.timeout = timeout

    def open(self, edges: list[Edge], rank: int, inbox: Inbox):
        senders, receivers = {}, {}
        gpu = self.device.type == "cuda"
        for edge in edges:
            # every rank creates every group, in the same order (new_group is collective)
            header = dist.new_group([edge.src, edge.dst], backend="gloo")
            payload = dist.new_group([edge.src, edge.dst], backend="nccl") if gpu else header
            groups = _Groups(header, payload)
            if rank == edge.src:
                senders[edge] = TorchSendChannel(edge, groups, self.device, self.timeout)
            elif rank == edge.dst:
                receivers[edge] = TorchRecvChannel(edge, groups, self.device, inbox,
                                                   self.timeout)
        return senders, receivers
