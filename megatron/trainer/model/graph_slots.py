"""Which recorded CUDA-graph slot a block's microbatch replays, by the microbatch's shape.

A graph replays one shape. With variable lengths (`--variable-seq-lengths`, `--seq-length-cv`)
microbatches come in a few shapes, one per length bucket (`--pad-to-multiple`). A block keeps
lanes: a lane is one memory pool holding one recorded slot per shape, and carries one
microbatch at a time, from its forward to the end of its backward (cuda_graphs.py). The slots
of a lane share its pool: their saved activations and temporaries overlap, which is safe
because only one of them is in flight. So a block holds as many pools as the schedule keeps
microbatches in flight (the same as with one fixed shape), each as large as its largest
shape, not one pool per shape and microbatch in flight.

A new lane records the largest of the run's bucket shapes (`warm_shapes`, when they are
known in advance: the first recording sizes the pool) and the shape it is made for; the other
buckets wait for `record_warm()` at the end of the step, when no microbatch is in flight, so
that a stage does not hold its pipeline peers up mid-step while it records dozens of shapes (a
token budget's row counts make 50 at 2,048 tokens) and no later step pays for a recording. A
shape met later is recorded on first use in a free lane. The recordings of every block on a rank share one memory budget
(`--cuda-graph-memory-limit` GiB): before recording, what the slot adds is estimated (tokens
beyond what its lane already held, at the most bytes per token any recording of the rank
took); where it would pass the budget, the microbatch runs eagerly and one line per shape
says so. Nothing here touches CUDA: the recorder is a callable, so the bookkeeping runs on
any machine.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Hashable, Iterable

log = logging.getLogger(__name__)

MAX_LANES = 64  # more microbatches in flight through one block than any schedule keeps

Shape = tuple[int, ...]


class SlotLeak(RuntimeError):
    """More microbatches in flight through one block than any schedule keeps: a forward
    whose backward never ran."""


class GraphMemoryBudget:
    """The bytes the rank's graph recordings may hold (None: no bound), shared by its blocks."""

    def __init__(self, limit_bytes: int | None = None):
        if limit_bytes is not None and limit_bytes < 0:
            raise ValueError(f"GraphMemoryBudget: limit {limit_bytes} bytes must be >= 0")
        self.limit_bytes = limit_bytes
        self.used_bytes = 0
        self.bytes_per_token = 0.0  # the most any first recording in a lane held per token
        self._refused: set[Hashable] = set()

    def admits(self, estimate: int) -> bool:
        return self.limit_bytes is None or self.used_bytes + estimate <= self.limit_bytes

    def charge(self, shape: Shape, recorded_bytes: int, fresh_pool: bool) -> None:
        self.used_bytes += recorded_bytes
        if fresh_pool:  # a later recording in a lane reuses its pool: no per-token measure
            self.bytes_per_token = max(self.bytes_per_token, recorded_bytes / tokens(shape))

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


class Lane:
    """One memory pool, its slots by shape, and whether a microbatch is in flight in it."""

    def __init__(self, index: int, pool: object):
        self.index = index
        self.pool = pool
        self.slots: dict[Shape, object] = {}
        self.busy = False
        self.capacity_tokens = 0  # the largest shape recorded in the pool


class ShapeSlots:
    """One block's lanes. `record(shape, pool, lane_index)` records a slot for microbatch
    inputs of `shape` into `pool` and returns (slot, bytes it added); `new_pool()` makes a
    lane's pool."""

    def __init__(self, record: Callable[[Shape, object, int], tuple[object, int]],
                 budget: GraphMemoryBudget | None = None,
                 new_pool: Callable[[], object] = lambda: None,
                 warm_shapes: Iterable[Shape] = ()):
        self._record = record
        self._new_pool = new_pool
        self.budget = budget if budget is not None else GraphMemoryBudget()
        # largest first: the first recording sizes the pool, the others reuse it
        self.warm_shapes = sorted({tuple(s) for s in warm_shapes}, key=tokens, reverse=True)
        self.lanes: list[Lane] = []

    def acquire(self, sample) -> object | None:
        """A slot of the shape of `sample` (a block input) in a free lane, recorded now if no
        free lane has one; None where the memory budget leaves this shape to the eager path."""
        shape = tuple(sample.shape)
        free = [lane for lane in self.lanes if not lane.busy]
        for lane in free:
            if shape in lane.slots:
                lane.busy = True
                return lane.slots[shape]
        if free:  # the free lane whose pool already holds the most
            lane = max(free, key=lambda lane: lane.capacity_tokens)
        else:
            if len(self.lanes) >= MAX_LANES:
                raise SlotLeak(f"{MAX_LANES} microbatches in flight through one block's CUDA "
                               "graphs: a forward whose backward never ran (each training "
                               "forward needs its backward)")
            lane = Lane(len(self.lanes), self._new_pool())
            self.lanes.append(lane)
            if self.warm_shapes:  # the largest bucket sizes the pool; the rest: record_warm
                self._record_into(lane, self.warm_shapes[0])
        slot = lane.slots.get(shape)
        if slot is None:
            slot = self._record_into(lane, shape)
        if slot is not None:
            lane.busy = True
        return slot

    def record_warm(self) -> int:
        """Record the missing bucket shapes of every free lane (between steps all are);
        returns how many were recorded."""
        recorded = 0
        for lane in self.lanes:
            for shape in self.warm_shapes if not lane.busy else ():
                if shape not in lane.slots and self._record_into(lane, shape) is not None:
                    recorded += 1
        return recorded

    def release(self, shape, slot) -> None:
        for lane in self.lanes:
            if lane.slots.get(tuple(shape)) is slot:
                lane.busy = False
                return
        raise KeyError(f"no lane holds this slot of shape {tuple(shape)}")

    def estimate_bytes(self, shape: Shape, lane: Lane | None = None) -> int:
        """What recording `shape` into `lane` (a new one when None) adds: its tokens beyond
        the largest shape the lane's pool already held, at the most bytes per token any
        recording into a fresh pool of the rank took; 0 before the rank recorded anything."""
        held = 0 if lane is None else lane.capacity_tokens
        return int(self.budget.bytes_per_token * max(0, tokens(shape) - held))

    def _record_into(self, lane: Lane, shape: Shape) -> object | None:
        estimate = self.estimate_bytes(shape, lane)
        if not self.budget.admits(estimate):
            self.budget.refuse(shape, estimate)
            return None
        slot, added = self._record(shape, lane.pool, lane.index)
        self.budget.charge(shape, added, fresh_pool=not lane.slots)
        lane.slots[shape] = slot
        lane.capacity_tokens = max(lane.capacity_tokens, tokens(shape))
        return slot

    @property
    def recorded(self) -> dict[Shape, list]:
        """The recorded slots by shape, over all lanes."""
        by_shape: dict[Shape, list] = {}
        for lane in self.lanes:
            for shape, slot in lane.slots.items():
                by_shape.setdefault(shape, []).append(slot)
        return by_shape

    def __len__(self) -> int:
        """Slots recorded, of every shape."""
        return sum(len(lane.slots) for lane in self.lanes)


def tokens(shape: Shape) -> int:
    """Sequence x micro-batch positions of a block input [s, b, h]."""
    return max(1, math.prod(shape[:-1]))
