"""Which recorded CUDA-graph slot a block's microbatch replays, by the microbatch's shape.

A graph replays one shape. With variable lengths (`--variable-seq-lengths`, `--seq-length-cv`)
microbatches come in a few shapes, one per length bucket (`--pad-to-multiple`), so a block
keeps its slots per shape: a forward takes a free slot of its shape, recording a new one on
first use, and the microbatch's backward frees it (cuda_graphs.py). A bucket thus records as
many slots as the schedule ever keeps microbatches of that shape in flight, once.

The recordings of every block on a rank share one memory budget (`--cuda-graph-memory-limit`
GiB): before recording, the slot's memory is estimated (the same shape's earlier slot, else
the most any slot of the rank held per token, times the shape's tokens); where it would pass
the budget, the microbatch runs eagerly (its shape's recorded slots, when free, still replay)
and one line per shape says so. Nothing here touches CUDA:
the recorder is a callable, so the bookkeeping runs on any machine.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Hashable

log = logging.getLogger(__name__)

MAX_SLOTS_PER_SHAPE = 64  # more microbatches of one shape in flight than any schedule keeps


class SlotLeak(RuntimeError):
    """More microbatches of one shape in flight than any schedule keeps: a forward whose
    backward never ran."""


class GraphMemoryBudget:
    """The bytes the rank's graph recordings may hold (None: no bound), shared by its blocks."""

    def __init__(self, limit_bytes: int | None = None):
        if limit_bytes is not None and limit_bytes < 0:
            raise ValueError(f"GraphMemoryBudget: limit {limit_bytes} bytes must be >= 0")
        self.limit_bytes = limit_bytes
        self.used_bytes = 0
        self.bytes_per_token = 0.0  # the most any recorded slot of the rank held per token
        self._refused: set[Hashable] = set()

    def admits(self, estimate: int) -> bool:
        return self.limit_bytes is None or self.used_bytes + estimate <= self.limit_bytes

    def charge(self, shape: tuple[int, ...], recorded_bytes: int) -> None:
        self.used_bytes += recorded_bytes
        self.bytes_per_token = max(self.bytes_per_token, recorded_bytes / _tokens(shape))

    def refuse(self, shape: Hashable, estimate: int) -> None:
        """Say once per shape that it runs eagerly from now on."""
        if shape in self._refused:
            return
        self._refused.add(shape)
        gib = 1 << 30
        log.info("CUDA graphs: memory limit of %.2f GiB reached (%.2f GiB recorded, a slot of "
                 "shape %s needs about %.2f GiB more): microbatches of this shape run eagerly "
                 "where no recorded slot is free (--cuda-graph-memory-limit raises the bound)",
                 self.limit_bytes / gib, self.used_bytes / gib, tuple(shape), estimate / gib)


class ShapeSlots:
    """One block's slots by shape. `record(sample)` records a slot for a microbatch input
    like `sample` and returns (slot, bytes it holds)."""

    def __init__(self, record: Callable[[object], tuple[object, int]],
                 budget: GraphMemoryBudget | None = None):
        self._record = record
        self.budget = budget if budget is not None else GraphMemoryBudget()
        self.free: dict[tuple[int, ...], list] = {}
        self.recorded: dict[tuple[int, ...], list] = {}
        self.slot_bytes: dict[tuple[int, ...], int] = {}  # the largest slot of each shape

    def acquire(self, sample) -> object | None:
        """A free slot of the shape of `sample` (a block input), recorded now from it if
        none is free; None where the memory budget leaves this shape to the eager path."""
        shape = tuple(sample.shape)
        free = self.free.get(shape)
        if free:
            return free.pop()
        recorded = self.recorded.setdefault(shape, [])
        if len(recorded) >= MAX_SLOTS_PER_SHAPE:
            raise SlotLeak(f"{MAX_SLOTS_PER_SHAPE} microbatches of shape {shape} in flight "
                           "through one block's CUDA graphs: a forward whose backward never ran "
                           "(each training forward needs its backward)")
        estimate = self.estimate_bytes(shape)
        if not self.budget.admits(estimate):
            self.budget.refuse(shape, estimate)
            return None
        slot, held = self._record(sample)
        recorded.append(slot)
        self.slot_bytes[shape] = max(self.slot_bytes.get(shape, 0), held)
        self.budget.charge(shape, held)
        return slot

    def release(self, shape, slot) -> None:
        self.free.setdefault(tuple(shape), []).append(slot)

    def estimate_bytes(self, shape: tuple[int, ...]) -> int:
        """What one more slot of `shape` will hold: an earlier slot of that shape, else the
        most any slot of the rank held per token times this shape's tokens (activations
        grow with the tokens; attention's share grows faster, which the next slot then
        measures); 0 before the rank recorded anything."""
        if shape in self.slot_bytes:
            return self.slot_bytes[shape]
        return int(self.budget.bytes_per_token * _tokens(shape))

    def __len__(self) -> int:
        """Slots recorded, of every shape."""
        return sum(len(slots) for slots in self.recorded.values())


def _tokens(shape: tuple[int, ...]) -> int:
    """Sequence x micro-batch positions of a block input [s, b, h]."""
    return max(1, math.prod(shape[:-1]))
