"""A device-independent measure of the activation memory a pipeline schedule holds: the
bytes of the tensors autograd keeps for backward, alive at the same time on this rank.

`SavedTensorBytes` counts them through torch.autograd.graph.saved_tensors_hooks: each
tensor autograd saves is counted (by its storage, so a storage saved by several operations
counts once) from its forward until the graph that saved it is freed, after its backward.
Parameters, which every matmul saves and every schedule holds alike, are left out. On CPU
this is what `torch.cuda.max_memory_allocated` cannot give; on GPU it leaves out the
allocator's caching and fragmentation, so it compares schedules, not devices.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch


class _Saved:
    """What the pack hook hands autograd: the tensor, and the storage it was counted as."""

    __slots__ = ("tensor", "_key", "_counter")

    def __init__(self, tensor: torch.Tensor, key: int | None, counter: SavedTensorBytes):
        self.tensor, self._key, self._counter = tensor, key, counter

    def __del__(self):
        if self._key is not None:
            self._counter._release(self._key)


class SavedTensorBytes:
    """`with counter.counting(): ...` counts what the enclosed forwards save; `current` and
    `peak` are bytes (peak since construction or `reset_peak`)."""

    def __init__(self, parameters: Iterable[torch.Tensor] = ()):
        self._excluded = {p.untyped_storage().data_ptr() for p in parameters}
        self._live: dict[int, list[int]] = {}  # storage address -> [saves alive, bytes]
        self.current = 0
        self.peak = 0

    def reset_peak(self) -> None:
        self.peak = self.current

    @contextlib.contextmanager
    def counting(self):
        with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
            yield self

    def _pack(self, tensor: torch.Tensor) -> _Saved:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self._excluded or storage.nbytes() == 0:
            return _Saved(tensor, None, self)
        entry = self._live.get(key)
        if entry is None:
            self._live[key] = [1, storage.nbytes()]
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
        else:
            entry[0] += 1
        return _Saved(tensor, key, self)

    def _release(self, key: int) -> None:
        entry = self._live[key]
        entry[0] -= 1
        if entry[0] == 0:
            del self._live[key]
            self.current -= entry[1]


def _unpack(saved: _Saved) -> torch.Tensor:
    return saved.tensor
