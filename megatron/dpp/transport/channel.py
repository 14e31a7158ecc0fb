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
from dataclasses import dataclass

import torch


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


@dataclass(frozen=True)
class Edge:
    """One direction of one pipeline link, in global ranks."""

    src: int
    dst: int
    kind: MessageKind


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
    channel that fails records its error, and every later wait raises it.
    `PythonInbox` keeps the messages in a dict; `native.NativeInbox` in the extension,
    where the shared-memory channels' drain threads deliver without taking the GIL.
    """

    @abstractmethod
    def put(self, key: MessageKey, tensor: torch.Tensor) -> None:
        """Deliver `key`; a key that is already here is recorded as a failure."""

    @abstractmethod
    def fail(self, error: BaseException) -> None:
        """Record a channel's failure (the first one is kept) and wake every waiter."""

    @abstractmethod
    def has(self, key: MessageKey) -> bool: ...

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
        """Remove and return the message `key`, waiting for it up to `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            seen = self.version
            tensor = self._pop(key)
            if tensor is not None:
                return tensor
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                self._block(seen, 0)
                raise TransportError(f"timed out after {timeout:.0f} s waiting for {key}")
            self._block(seen, remaining)

    def wait(self, seen_version: int, timeout: float | None = None) -> int:
        """Block until something arrives after `seen_version` (or a channel fails);
        returns the new version. Raises TransportError on timeout or failure."""
        if not self._block(seen_version, timeout):
            raise TransportError(
                f"timed out after {timeout:.0f} s: no message arrived from any pipeline peer"
            )
        return self.version


class PythonInbox(Inbox):
    """The Inbox in a dict under a condition variable: for backends whose receive threads
    are Python threads, and where the native extension is not built."""

    def __init__(self):
        self._messages: dict[MessageKey, torch.Tensor] = {}
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._version = 0

    def put(self, key: MessageKey, tensor: torch.Tensor) -> None:
        with self._cond:
            if key in self._messages and self._error is None:
                self._error = TransportError(f"duplicate message {key}")
            self._messages[key] = tensor
            self._version += 1
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        with self._cond:
            if self._error is None:
                self._error = error
            self._version += 1
            self._cond.notify_all()

    def has(self, key: MessageKey) -> bool:
        with self._cond:
            return key in self._messages

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
            return self._messages.pop(key, None)

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
    def close(self) -> None:
        """Flush, tell the receiver no more messages come, release every resource."""


class RecvChannel(ABC):
    """The receiving end of one edge: drains arrivals into the Inbox it was opened with."""

    edge: Edge

    @abstractmethod
    def close(self) -> None:
        """Stop draining (after the sender's close arrived, or at once on shutdown) and
        release every resource."""


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
