"""The compiled transport extension (csrc/ built into megatron.dpp._native by setup.py)."""

from __future__ import annotations

import functools
import importlib
import os
import time
from types import ModuleType

import torch

from megatron.dpp.transport.channel import (
    Inbox,
    MessageKey,
    MessageKind,
    PythonInbox,
    TransportError,
)

_BUILD_HINT = "build it with `pip install --no-build-isolation --no-deps -e .` in the repo root"


@functools.cache
def _load() -> tuple[ModuleType | None, str]:
    try:
        return importlib.import_module("megatron.dpp._native"), ""
    except ImportError as error:
        return None, str(error)


def available() -> bool:
    """True when the extension was built and imports."""
    return _load()[0] is not None


def unavailable_reason() -> str:
    """Why the extension does not import, with the way to build it ("" when it does)."""
    extension, reason = _load()
    return "" if extension is not None else f"megatron.dpp._native: {reason}; {_BUILD_HINT}"


def module() -> ModuleType:
    """The extension module; raises TransportError saying why it cannot be imported."""
    extension, reason = _load()
    if extension is None:
        raise TransportError(f"native transport megatron.dpp._native unavailable ({reason}); "
                             f"{_BUILD_HINT}")
    return extension


def build_info() -> dict[str, bool]:
    """What the extension was built with: {'shm': ..., 'cuda': ..., 'rdma': ...}; all False
    when it is not built."""
    extension, _ = _load()
    if extension is None:
        return {"shm": False, "cuda": False, "rdma": False}
    return dict(extension.build_info())


# A spinning wait needs a core of its own: each local rank has a main thread and drain
# threads that may spin, so with fewer cores than this per local rank they would slow the
# ranks they share cores with (10 % per step on 2 cores, 2 ranks) instead of answering
# sooner.
CORES_PER_RANK_TO_SPIN = 4
SPIN_US = 200.0


def default_spin_us() -> float:
    """How long a wait of the native transport polls before it sleeps on a futex: SPIN_US
    where the host has CORES_PER_RANK_TO_SPIN cores per local rank (torchrun's
    LOCAL_WORLD_SIZE), else 0."""
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    cores = len(os.sched_getaffinity(0))
    return SPIN_US if cores >= CORES_PER_RANK_TO_SPIN * local_ranks else 0.0


class NativeInbox(Inbox):
    """The Inbox kept in the extension's Mailbox. The shared-memory drain threads deliver
    into it without the GIL and wake a waiting schedule directly; a wait spins `spin_us`
    microseconds (default: `default_spin_us()`) before it sleeps on a futex."""

    # A wait returns to Python this often, so that Ctrl-C (a signal Python handles between
    # bytecodes) ends a rank that waits for a peer at once.
    SIGNAL_CHECK_S = 0.2

    def __init__(self, spin_us: float | None = None):
        self.mailbox = module().Mailbox(default_spin_us() if spin_us is None else spin_us)
        # `ready` events of messages put from Python (the native drains keep their own)
        self._ready: dict[MessageKey, object] = {}

    def put(self, key: MessageKey, tensor: torch.Tensor, ready=None) -> None:
        if ready is not None:
            self._ready[key] = ready  # before the key is visible to a taker
        self.mailbox.put(int(key.kind), key.chunk, key.microbatch, tensor)

    def notify(self) -> None:
        self.mailbox.notify()

    def fail(self, error: BaseException) -> None:
        self.mailbox.fail(str(error))

    @property
    def failure(self) -> str | None:
        return self.mailbox.error()

    def has(self, key: MessageKey) -> bool:
        return self.mailbox.has(int(key.kind), key.chunk, key.microbatch)

    def landed(self, key: MessageKey) -> bool:
        if not self.mailbox.landed(int(key.kind), key.chunk, key.microbatch):
            return False
        ready = self._ready.get(key)
        return ready is None or ready.query()

    def keys(self) -> list[MessageKey]:
        return [MessageKey(MessageKind(kind), chunk, microbatch)
                for kind, chunk, microbatch in self.mailbox.keys()]

    @property
    def version(self) -> int:
        return self.mailbox.version

    def __len__(self) -> int:
        return len(self.mailbox)

    def _pop(self, key: MessageKey) -> torch.Tensor | None:
        tensor = self.mailbox.take(int(key.kind), key.chunk, key.microbatch)
        if tensor is not None:
            ready = self._ready.pop(key, None)
            if ready is not None:
                ready.wait()  # the current stream waits on the device; the host goes on
        return tensor

    def _block(self, seen_version: int, timeout: float | None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            remaining = self.SIGNAL_CHECK_S if deadline is None else deadline - time.monotonic()
            ok = self.mailbox.wait(seen_version, max(0.0, min(remaining, self.SIGNAL_CHECK_S)))
            error = self.mailbox.error()
            if error is not None:
                raise TransportError(error)
            if ok or (deadline is not None and time.monotonic() >= deadline):
                return ok


def make_inbox() -> Inbox:
    """A NativeInbox where the extension is built (the shared-memory backend needs one),
    a PythonInbox otherwise."""
    return NativeInbox() if available() else PythonInbox()
