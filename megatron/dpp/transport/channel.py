"""The mailbox Channel API shared by every transport backend.

A pipeline edge (src rank -> dst rank, one direction) is one channel. The sender side
`send(key, tensor)` never waits for the receiver to ask for the message; the receiver
side drains arrivals into an `Inbox` that the schedule polls and waits on. Every message
carries its key, dtype and shape, so any dtype and variable shapes work.
"""

from __future__ import annotations

import enum
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed

from megatron.dpp.errors import brief, peer_failure  # noqa: F401  (re-exported: the backends import them from here)


class TransportError(RuntimeError):
    """A channel failed: a peer died, timed out, or sent something malformed."""


class MessageKind(enum.IntEnum):
    ACTIVATION = 0
    GRADIENT = 1


@dataclass(frozen=True, order=True)
class MessageKey:
    """Identifies one message: what it is, for which local model chunk of the receiver,
    and for which microbatch."""

    kind: MessageKind
    chunk: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind.name} chunk {self.chunk} microbatch {self.microbatch}"


@dataclass(frozen=True)
class Edge:
    """One direction of one pipeline link, in global ranks."""

    src: int
    dst: int
    kind: MessageKind

    def __str__(self) -> str:
        return f"{self.src}->{self.dst} {self.kind.name}"


# dtype <-> small integer code, shared by every backend's wire header
DTYPE_CODES = {
    torch.float32: 0,
    torch.float16: 1,
    torch.bfloat16: 2,
    torch.float64: 3,
    torch.int64: 4,
    torch.int32: 5,
    torch.int8: 6,
    torch.uint8: 7,
    torch.bool: 8,
}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


def dtype_code(dtype: torch.dtype) -> int:
    try:
        return DTYPE_CODES[dtype]
    except KeyError:
        raise TransportError(f"dtype {dtype} cannot be sent over a DPP channel") from None


class Inbox(ABC):
    """Arrived messages of one rank, from all of its receive channels.

    Receive channels `put` from their own threads; the schedule `take`s by key and blocks
    in `wait` (no spinning beyond a few microseconds) when nothing it needs is here. A
    channel that fails records its error, and every later wait raises it; so does a wait
    that times out (the peer is hung: nothing that arrives later can be trusted).
    `sources`, the receive edges that deliver here, name the peer a timed-out wait waited
    on. `PythonInbox` keeps the messages in a dict; `native.NativeInbox` in the extension,
    where the shared-memory channels' drain threads deliver without taking the GIL.
    """

    sources: tuple[Edge, ...] = ()

    def set_sources(self, edges: Iterable[Edge]) -> None:
        self.sources = tuple(edges)

    @abstractmethod
    def put(self, key: MessageKey, tensor: torch.Tensor, ready=None) -> None:
        """Deliver `key`; a key that is already here is recorded as a failure. `ready`: a
        CUDA event that marks the tensor's data as written (a message announced while its
        copy is still queued); `take` makes the taker's stream wait for it."""

    @abstractmethod
    def notify(self) -> None:
        """Wake every waiter without a message (it looks again: the schedule also decides
        on its GPU's progress)."""

    @abstractmethod
    def fail(self, error: BaseException) -> None:
        """Record a channel's failure (the first one is kept) and wake every waiter."""

    @property
    @abstractmethod
    def failure(self) -> str | None:
        """The recorded failure's message; None while nothing failed."""

    @abstractmethod
    def has(self, key: MessageKey) -> bool:
        """The message is here (announced: a GPU message's data may still be on its way)."""

    @abstractmethod
    def landed(self, key: MessageKey) -> bool:
        """The message is here and its data written (`ready`, if any, has passed)."""

    @abstractmethod
    def keys(self) -> list[MessageKey]: ...

    @property
    @abstractmethod
    def version(self) -> int:
        """Changes on every arrival and failure."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def _pop(self, key: MessageKey) -> torch.Tensor | None:
        """Remove and return `key`'s tensor, or None when it has not arrived."""

    @abstractmethod
    def _block(self, seen_version: int, timeout: float | None) -> bool:
        """Wait until the version differs from `seen_version` (True) or `timeout` passes
        (False); raise the recorded failure, if any."""

    def take(self, key: MessageKey, timeout: float | None = None) -> torch.Tensor:
        """Remove and return the message `key`, waiting for it up to `timeout` seconds. A
        message announced before its data landed is handed out at once: the current CUDA
        stream waits for the data on the device."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            seen = self.version
            tensor = self._pop(key)
            if tensor is not None:
                return tensor
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                self._block(seen, 0)
                raise self._timed_out(timeout, [key])
            self._block(seen, remaining)

    def wait(self, seen_version: int, timeout: float | None = None,
             expecting: Iterable[MessageKey] = ()) -> int:
        """Block until something arrives after `seen_version` (or a channel fails);
        returns the new version. Raises TransportError on timeout or failure; a timeout's
        message names `expecting`, the messages the caller waits for, and their peers."""
        if not self._block(seen_version, timeout):
            raise self._timed_out(timeout, list(expecting))
        return self.version

    def _timed_out(self, timeout: float, keys: list[MessageKey]) -> TransportError:
        error = TransportError(f"timed out after {timeout:g} s waiting for "
                               f"{self.describe_wait(keys)}")
        self.fail(error)
        return error

    def describe_wait(self, keys: list[MessageKey]) -> str:
        """What a wait for `keys` (for any message when empty) waits for, naming each
        peer by rank and edge where `sources` knows it."""
        if not keys:
            if not self.sources:
                return "a message from any pipeline peer"
            return " or ".join(f"a message from pipeline peer rank {edge.src} (edge {edge})"
                               for edge in self.sources)
        by_peer: dict[str, list[MessageKey]] = {}
        for key in dict.fromkeys(keys):
            edges = [edge for edge in self.sources if edge.kind == key.kind]
            peer = (" or ".join(f"pipeline peer rank {e.src} (edge {e.src}->{e.dst})"
                                for e in edges) or "a pipeline peer")
            by_peer.setdefault(peer, []).append(key)
        return " or ".join(f"{', '.join(map(str, group))} from {peer}"
                           for peer, group in by_peer.items())


class PythonInbox(Inbox):
    """The Inbox in a dict under a condition variable: for backends whose receive threads
    are Python threads, and where the native extension is not built."""

    def __init__(self):
        self._messages: dict[MessageKey, tuple[torch.Tensor, object]] = {}
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._version = 0

    def put(self, key: MessageKey, tensor: torch.Tensor, ready=None) -> None:
        with self._cond:
            if key in self._messages and self._error is None:
                self._error = TransportError(f"duplicate message {key}")
            self._messages[key] = tensor, ready
            self._version += 1
            self._cond.notify_all()

    def notify(self) -> None:
        with self._cond:
            self._version += 1
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        with self._cond:
            if self._error is None:
                self._error = error
            self._version += 1
            self._cond.notify_all()

    @property
    def failure(self) -> str | None:
        with self._cond:
            return None if self._error is None else str(self._error)

    def has(self, key: MessageKey) -> bool:
        with self._cond:
            return key in self._messages

    def landed(self, key: MessageKey) -> bool:
        with self._cond:
            message = self._messages.get(key)
        return message is not None and (message[1] is None or message[1].query())

    def keys(self) -> list[MessageKey]:
        with self._cond:
            return list(self._messages)

    @property
    def version(self) -> int:
        with self._cond:
            return self._version

    def __len__(self) -> int:
        with self._cond:
            return len(self._messages)

    def _pop(self, key: MessageKey) -> torch.Tensor | None:
        with self._cond:
            message = self._messages.pop(key, None)
        if message is None:
            return None
        tensor, ready = message
        if ready is not None:
            ready.wait()  # the current stream waits on the device; the host goes on
        return tensor

    def _block(self, seen_version: int, timeout: float | None) -> bool:
        with self._cond:
            ok = self._cond.wait_for(
                lambda: self._version != seen_version or self._error is not None, timeout
            )
            if self._error is not None:
                if isinstance(self._error, TransportError):
                    raise self._error
                raise TransportError(f"pipeline channel failed: {self._error}") from self._error
            return ok


class SendChannel(ABC):
    """The sending end of one edge."""

    edge: Edge

    def _wire_code(self, key: MessageKey, tensor: torch.Tensor) -> int:
        """`tensor`'s dtype code, once `key` is known to belong on this edge."""
        code = dtype_code(tensor.dtype)
        if key.kind != self.edge.kind:
            raise TransportError(f"{key} sent on a {self.edge.kind.name} channel")
        return code

    @abstractmethod
    def send(self, key: MessageKey, tensor: torch.Tensor) -> None:
        """Queue `tensor` for delivery; returns without waiting for the receiver. The caller
        may free or overwrite its own reference afterwards: the channel keeps what it needs."""

    @abstractmethod
    def flush(self, timeout: float | None = None) -> None:
        """Wait until every queued message has left this process."""

    @abstractmethod
    def close(self, abort: bool = False) -> None:
        """Flush, tell the receiver no more messages come, release every resource; every
        wait on the peer is bounded by the backend's timeout. `abort` (after a failure):
        release at once, without flushing or waiting for the peer."""


class RecvChannel(ABC):
    """The receiving end of one edge: drains arrivals into the Inbox it was opened with."""

    edge: Edge

    @abstractmethod
    def close(self, abort: bool = False) -> None:
        """Stop draining once the sender's close arrived (waiting at most the backend's
        timeout for it) and release every resource. `abort` (after a failure): stop at
        once, without waiting for the peer."""


class Backend(ABC):
    """Opens channels of one kind. Opening is collective: every rank of the job calls
    `open` with the same list of edges, in the same order."""

    name: str

    @abstractmethod
    def open(
        self, edges: list[Edge], rank: int, inbox: Inbox
    ) -> tuple[dict[Edge, SendChannel], dict[Edge, RecvChannel]]:
        """Open this rank's ends of `edges`: senders where rank == src, receivers (draining
        into `inbox`) where rank == dst."""
