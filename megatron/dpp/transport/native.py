"""The compiled transport extension (csrc/ built into megatron.dpp._native by setup.py)."""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

from megatron.dpp.transport.channel import TransportError

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
