"""Shared-memory channels between ranks of one host (native extension, csrc/).

Each edge gets one POSIX shared-memory ring, created by the receiving rank under a name
made of a random token agreed by the job plus src/dst/kind, and unlinked as soon as the
sender mapped it. A native drain thread per receive channel copies every arrival into a
fresh tensor and puts it into the rank's NativeInbox. GPU tensors travel device to device through CUDA IPC
or staged through the (host-registered) ring, when the extension was built with CUDA.
"""

from __future__ import annotations

import _posixshmem
import logging
import os
import secrets
import threading

import torch
import torch.distributed as dist

from megatron.dpp.transport import native
from megatron.dpp.transport.channel import (
    Backend,
    Edge,
    Inbox,
    MessageKey,
    RecvChannel,
    SendChannel,
    TransportError,
    brief,
)
from megatron.dpp.transport.native import NativeInbox

logger = logging.getLogger(__name__)

GPU_PATHS = ("auto", "staged", "ipc")


def segment_name(token: str, edge: Edge) -> str:
    return f"/dpp-{token}-{edge.src}-{edge.dst}-{int(edge.kind)}"


def _unlink_segment(name: str) -> None:
    """Remove a segment's name if it is still there (its creator may have died)."""
    try:
        _posixshmem.shm_unlink(name)
    except FileNotFoundError:
        pass


SHM_DIR = "/dev/shm"  # where shm_open's segments live on Linux


def shm_free_bytes() -> int | None:
    """Bytes free on /dev/shm for this process; None where it cannot be asked."""
    try:
        stats = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return stats.f_bavail * stats.f_frsize


def _as_transport_error(error: Exception, edge: Edge) -> TransportError:
    return TransportError(f"shm channel {edge.src}->{edge.dst} ({edge.kind.name}): {error}")


class _CudaEnd:
    """The CUDA side of one channel end: its device and a side stream for the copies."""

    def __init__(self, device: int):
        self.device = device
        self.copy_stream = torch.cuda.Stream(device)
        # Tensors handed to the Inbox are used on the stream that was current at open.
        self.consumer_stream = torch.cuda.current_stream(device)


class ShmSendChannel(SendChannel):
    def __init__(self, edge: Edge, sender, cuda: _CudaEnd | None):
        self.edge = edge
        self._sender = sender
        self._cuda = cuda
        self._lock = threading.Lock()
        self._closed = False

    def send(self, key: MessageKey, tensor: torch.Tensor) -> None:
        code = self._wire_code(key, tensor)
        with self._lock:
            if self._closed:
                raise TransportError(f"send of {key} on closed channel {self.edge}")
            try:
                if tensor.is_cuda:
                    self._send_cuda(key, code, tensor)
                else:
                    data = tensor.contiguous()
                    self._sender.send(int(key.kind), key.chunk, key.microbatch, code,
                                      list(data.shape), data.data_ptr(),
                                      data.numel() * data.element_size())
            except native.module().NativeTransportError as error:
                raise _as_transport_error(error, self.edge) from error

    def _send_cuda(self, key: MessageKey, code: int, tensor: torch.Tensor) -> None:
        if self._cuda is None:
            raise TransportError(
                f"GPU tensor sent on shm channel {self.edge}, but the native transport was "
                f"built without CUDA (build_info: {native.build_info()})")
        # The extension copies after the current stream's work and records its copy stream
        # on the tensor, which it may still read there after this returns.
        self._sender.send_cuda(int(key.kind), key.chunk, key.microbatch, code,
                               tensor.contiguous(), self._cuda.copy_stream.cuda_stream)

    def flush(self, timeout: float | None = None) -> None:
        # Host copies are done when send() returns; device copies end on the side stream.
        if self._cuda is not None:
            self._cuda.copy_stream.synchronize()

    def close(self, abort: bool = False) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            # only this rank's GPU copies: they must end before the ring goes
            self.flush()
            if abort:
                # Dropped, not closed: the close marker waits for a free slot, which a peer
                # that stopped draining never gives. Dropping unmaps the ring.
                self._sender = None
                return
            try:
                self._sender.close()
            except native.module().NativeTransportError as error:
                raise _as_transport_error(error, self.edge) from error


class ShmRecvChannel(RecvChannel):
    """The receiving end: a native drain thread copies every arrival into a tensor of this
    rank's and delivers it to the NativeInbox."""

    def __init__(self, edge: Edge, receiver, inbox: NativeInbox, cuda: _CudaEnd | None):
        self.edge = edge
        self._receiver = receiver
        self._inbox = inbox
        self._cuda = cuda
        self._drain = None

    def start(self) -> None:
        cuda = self._cuda
        self._drain = native.module().ShmDrain(
            self._receiver, self._inbox.mailbox,
            f"shm channel {self.edge.src}->{self.edge.dst} ({self.edge.kind.name})",
            -1 if cuda is None else cuda.device,
            0 if cuda is None else cuda.copy_stream.cuda_stream,
            0 if cuda is None else cuda.consumer_stream.cuda_stream)

    def close(self, abort: bool = False) -> None:
        # the drain's waits see the interrupt within a futex tick, whatever the peer does
        self._receiver.interrupt()
        if self._drain is not None:
            self._drain.join()
        self._receiver.close()


class ShmBackend(Backend):
    """Shared-memory channels for edges between ranks of one host.

    `slots` x `slot_bytes` is each channel's ring in shared memory (larger messages are
    split into consecutive slots); on the CUDA IPC path the receiver's GPU holds `slots` x
    `device_slot_bytes` (16 MiB: one copy per activation of a 2048 x 2 x 2048 bf16
    microbatch; 128 MiB per receiving channel). `timeout` bounds every wait on a peer that
    is not the receiver's idle wait for the next message (that one ends when the peer
    dies); a wait polls its slot for `spin_us` microseconds (default:
    `native.default_spin_us()`) before it sleeps on a futex.
    `path` picks the GPU path: "ipc" (device to device), "staged" (through host memory) or
    "auto" (IPC where the peer's pool can be opened). `token` names the segments; by
    default rank 0 draws a random one and broadcasts it on the default process group.
    """

    name = "shm"

    def __init__(self, timeout: float = 60.0, slots: int = 8, slot_bytes: int = 4 << 20,
                 device_slot_bytes: int = 16 << 20, path: str = "auto",
                 token: str | None = None, spin_us: float | None = None):
        if timeout <= 0:
            raise ValueError(f"ShmBackend timeout must be > 0 s, got {timeout}")
        if slots < 2:
            raise ValueError(f"ShmBackend slots must be >= 2, got {slots}")
        if slot_bytes < 4096:
            raise ValueError(f"ShmBackend slot_bytes must be >= 4096, got {slot_bytes}")
        if device_slot_bytes < 4096:
            raise ValueError(
                f"ShmBackend device_slot_bytes must be >= 4096, got {device_slot_bytes}")
        if path not in GPU_PATHS:
            raise ValueError(f"ShmBackend path must be one of {GPU_PATHS}, got {path!r}")
        if token is not None and not token.isalnum():
            raise ValueError(f"ShmBackend token must be alphanumeric, got {token!r}")
        self.timeout = timeout
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.device_slot_bytes = device_slot_bytes
        self.path = path
        self.spin_us = native.default_spin_us() if spin_us is None else spin_us
        self._token = token

    def _agree_token(self) -> str:
        if self._token is not None:
            return self._token
        if not dist.is_initialized():
            raise TransportError("ShmBackend.open needs torch.distributed initialised (to agree "
                                 "on segment names) or an explicit token")
        holder = [secrets.token_hex(8) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(holder, src=0)
        return holder[0]

    @staticmethod
    def _barrier() -> None:
        if dist.is_initialized():
            dist.barrier()

    def _cuda_end(self) -> _CudaEnd | None:
        if native.build_info()["cuda"] and torch.cuda.is_available():
            return _CudaEnd(torch.cuda.current_device())
        return None

    def open(self, edges: list[Edge], rank: int, inbox: Inbox):
        if not isinstance(inbox, NativeInbox):
            raise TransportError(
                f"ShmBackend delivers into a NativeInbox (megatron.dpp.transport.native."
                f"make_inbox()), got {type(inbox).__name__}")
        if len(set(edges)) != len(edges):
            raise TransportError(f"duplicate edges given to ShmBackend.open: {edges}")
        extension = native.module()
        token = self._agree_token()
        receivers: dict[Edge, ShmRecvChannel] = {}
        senders: dict[Edge, ShmSendChannel] = {}
        try:
            failure: Exception | None = None
            try:
                self._check_room([edge for edge in edges if edge.dst == rank], rank)
                for edge in edges:
                    if edge.dst == rank:
                        receivers[edge] = self._open_receiver(extension, token, edge, inbox)
            except Exception as error:  # still reach the barrier, or the other ranks hang there
                failure = error
            try:
                self._barrier()
            except RuntimeError as error:
                raise TransportError(
                    f"shm channel set-up on rank {rank}: a peer rank failed or disconnected "
                    f"before every channel was created ({brief(error)})") from error
            if failure is not None:
                raise failure
            for edge in edges:
                if edge.src == rank:
                    senders[edge] = self._open_sender(extension, token, edge)
        except BaseException as error:
            self._clean_up_failed_open(token, edges, rank, [*senders.values(),
                                                            *receivers.values()])
            if isinstance(error, TransportError) or not isinstance(error, Exception):
                raise
            raise TransportError(f"ShmBackend.open on rank {rank} failed: {error}") from error
        for channel in receivers.values():
            channel.start()
        return senders, receivers

    def _check_room(self, incoming: list[Edge], rank: int) -> None:
        """Up front: this rank's receiving segments (its rings' slots at least) fit in what
        /dev/shm has free. The segments reserve their pages when created too, so one that
        does not fit later (other ranks, other jobs) fails by name rather than as SIGBUS."""
        needed = len(incoming) * self.slots * self.slot_bytes
        free = shm_free_bytes()
        if needed and free is not None and needed > free:
            raise TransportError(
                f"shm channels of rank {rank}: {len(incoming)} receiving segments need at "
                f"least {needed} bytes of {SHM_DIR}, which has {free} bytes free (give it more "
                "space, e.g. docker run --shm-size, or --dpp-transport torch)")

    @staticmethod
    def _clean_up_failed_open(token: str, edges: list[Edge], rank: int, channels) -> None:
        """Release this rank's channels and remove the segment of every edge it is an end
        of: its own, and its peers' (a peer that died in set-up cannot remove them)."""
        for channel in channels:
            try:
                channel.close(abort=True)
            except TransportError:
                logger.debug("closing %s after a failed open", channel.edge, exc_info=True)
        for edge in edges:
            if rank in (edge.src, edge.dst):
                _unlink_segment(segment_name(token, edge))

    def _open_receiver(self, extension, token: str, edge: Edge, inbox: Inbox) -> ShmRecvChannel:
        receiver = extension.ShmReceiver(segment_name(token, edge), self.slots, self.slot_bytes,
                                         edge.dst, edge.src, self.timeout, self.spin_us)
        cuda = self._cuda_end()
        if cuda is not None:
            receiver.enable_cuda(cuda.device, self.path != "staged", self.device_slot_bytes)
        return ShmRecvChannel(edge, receiver, inbox, cuda)

    def _open_sender(self, extension, token: str, edge: Edge) -> ShmSendChannel:
        sender = extension.ShmSender(segment_name(token, edge), edge.src, edge.dst, self.timeout,
                                     self.spin_us)
        cuda = self._cuda_end()
        if cuda is not None:
            chosen = sender.enable_cuda(cuda.device, self.path)
            logger.info("shm channel %d->%d (%s): GPU path %s", edge.src, edge.dst,
                        edge.kind.name, chosen)
        return ShmSendChannel(edge, sender, cuda)
