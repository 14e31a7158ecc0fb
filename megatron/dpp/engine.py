"""The one discrete-event engine: how long a pipeline takes when each rank's runner picks
its tasks. The simulator, the plan checker and the policy's cost-order choice all run it.

A runner is one rank's decision maker: `next_task(arrived)` returns the task to start now
or None (`arrived(task)` says whether the task's input from another rank is here),
`complete(task, duration)` reports the end of the task it started and how long it took,
`finished` says it has nothing left. `GreedyPolicy` (the DPP rule) and `StaticReplay` (a
fixed order) are runners.

Each rank runs one task at a time; a task's output reaches the rank of the consuming task
(megatron/dpp/topology.py) `latency` after the task ends (a number, or a function of the
edge and the message: megatron/dpp/variability.py's link profiles). Every event of one instant is
applied before any rank decides, so the result does not depend on the order in which
ranks are asked.

By default each rank has a processor of its own (a GPU a stage). With `cores` fewer than
the ranks they share that many (CPU processes on a small host): while n ranks compute,
each advances its task at min(1, cores / n) of full speed, as a fair scheduler shares
them; the part of a task spent waiting (`waits`: a CPU straggler's sleep) takes no core.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache

from megatron.dpp.actions import BACKWARD, FORWARD, WEIGHT, Task
from megatron.dpp.topology import LOCAL_PREDECESSOR, PipelineTopology


class DeadlockError(RuntimeError):
    """Some ranks can never run their next task; `ranks` lists them."""

    def __init__(self, message: str, ranks: list[int]):
        super().__init__(message)
        self.ranks = ranks


@dataclass
class EngineResult:
    makespan: float
    busy: list[float]  # per rank: time spent running tasks
    peak_in_flight: list[int]  # per rank: most microbatches between F start and release
    # per rank: most microbatches between F start and B end (= peak_in_flight unless split)
    peak_activations: list[int]
    # record=True: (rank, task, start, duration) of every task, in start order
    timeline: list[tuple[int, Task, float, float]] | None = None


@lru_cache(maxsize=64)
def task_table(kind: str, chunk: int, num_microbatches: int) -> tuple[Task, ...]:
    """Task(kind, chunk, i) for i in range(num_microbatches), built once: the engine and
    the policy look tasks up instead of building them in their inner loops."""
    return tuple(Task(kind, chunk, i) for i in range(num_microbatches))


def run_pipeline(
    topology: PipelineTopology,
    runners: Sequence,
    durations: Mapping[str, Sequence[Sequence[float]]],
    latency: float | Callable[[int, int, Task], float] = 0.0,
    record: bool = False,
    count_in_flight: bool = True,
    weight_slices: int = 1,
    cores: float | None = None,
    waits: Mapping[str, Sequence[Sequence[float]]] | None = None,
) -> EngineResult:
    """Run every rank's runner to the end. `durations[kind][v][i]`: the time of the task
    of that kind on virtual stage v for microbatch i (a WEIGHT table when the backward is
    split; activations are then freed by W instead of B). `count_in_flight=False` leaves
    the peaks at 0 (the cost-order choice needs the makespan only). `weight_slices` = n: a
    runner returns each W n times, each a part of 1/n of its time; the W releases its
    microbatch at its last part (the timeline has every part). `latency` may be a function
    (source rank, destination rank, the task the message feeds) -> time. `cores` and
    `waits[kind][v][i]` (the part of that task's duration spent waiting): the module
    docstring; `busy` and the timeline then hold each task's wall time. Raises
    DeadlockError when ranks are left that can never run their next task."""
    p = topology.pp_size
    if len(runners) != p:
        raise ValueError(f"{len(runners)} runners for {p} ranks")
    num_microbatches = len(durations[FORWARD][0])
    release = WEIGHT if WEIGHT in durations else BACKWARD
    if weight_slices < 1:
        raise ValueError(f"weight_slices must be >= 1, got {weight_slices}")
    if cores is not None and cores <= 0:
        raise ValueError(f"cores must be > 0, got {cores}")
    shared = cores is not None and cores < p
    if weight_slices > 1 and release == WEIGHT:
        durations = dict(durations)
        durations[WEIGHT] = [[d / weight_slices for d in row] for row in durations[WEIGHT]]
        if waits is not None:
            waits = dict(waits)
            waits[WEIGHT] = [[d / weight_slices for d in row] for row in waits[WEIGHT]]
    # per rank: parts run of each W started and not finished
    weight_parts = [{} for _ in range(p)]
    # per rank, by kind and local chunk: the durations row of the chunk's virtual stage,
    # the destination rank of the output (-1: none), the table of its tasks there and the
    # waits row (None: no waits)
    lanes = []
    for r in range(p):
        lane = {}
        for kind, table in durations.items():
            lane[kind] = []
            for v, route in zip(topology.stage_of[r], topology.routes[r][kind], strict=True):
                wait = waits[kind][v] if shared and waits is not None else None
                if route is None:
                    lane[kind].append((table[v], -1, None, wait))
                else:
                    lane[kind].append((table[v], route[0],
                                       task_table(kind, route[1], num_microbatches), wait))
        lanes.append(lane)
    next_task = [runner.next_task for runner in runners]
    complete = [runner.complete for runner in runners]
    arrived = [set() for _ in range(p)]
    has_arrived = [s.__contains__ for s in arrived]
    # per rank: None, or the running task and its lane entry
    running: list[tuple[Task, tuple] | None] = [None] * p
    busy = [0.0] * p
    in_flight = [0] * p
    peak = [0] * p
    split = release == WEIGHT
    activations = [0] * p  # with the split: microbatches between F start and B end
    peak_activations = [0] * p
    timeline = [] if record else None
    # events: (time, code); code < p: the task running on rank `code` ends; code >= p: the
    # message pending[code - p] = (rank, task) arrives (only with latency). Codes are
    # unique, so equal times never compare anything else.
    events: list[tuple[float, int]] = []
    # shared cores: every computing rank advances at the same speed, so their work ends in
    # the order of its end on one clock that runs at that speed: (that clock's time at the
    # end of the work, rank); then the task's wait, if any, is an event like any other
    computing: list[tuple[float, int]] = []
    work_clock = 0.0
    # shared cores, per rank: the running task's wait, start and row of the timeline
    waiting = [0.0] * p
    started = [0.0] * p
    timeline_row = [0] * p
    pending: list[tuple[int, Task]] = []
    push, pop = heapq.heappush, heapq.heappop
    now = 0.0
    # ranks to ask for a task: a rank may appear twice (asking again changes nothing)
    deciding = list(range(p))
    while True:
        for r in deciding:
            if running[r] is not None:
                continue
            task = next_task[r](has_arrived[r])
            if task is None:
                continue
            kind, chunk, microbatch = task
            lane = lanes[r][kind][chunk]
            duration = lane[0][microbatch]
            if count_in_flight and kind == FORWARD:
                count = in_flight[r] + 1
                in_flight[r] = count
                if count > peak[r]:
                    peak[r] = count
                if split:
                    count = activations[r] + 1
                    activations[r] = count
                    if count > peak_activations[r]:
                        peak_activations[r] = count
            running[r] = task, lane
            started[r] = now
            if shared:
                wait = 0.0 if lane[3] is None else lane[3][microbatch]
                push(computing, (work_clock + duration - wait, r))
                waiting[r] = wait
                if record:
                    timeline_row[r] = len(timeline)
            else:
                busy[r] += duration
                push(events, (now + duration, r))
            if record:
                timeline.append((r, task, now, duration))
        # shared cores: advance the work of the computing ranks to the next event
        while shared and computing and (not events or events[0][0] > now):
            speed = min(1.0, cores / len(computing))
            work_end = now + (computing[0][0] - work_clock) / speed
            if events and events[0][0] < work_end:
                work_clock += (events[0][0] - now) * speed
                now = events[0][0]
            else:
                now, work_clock = work_end, computing[0][0]
            while computing and computing[0][0] <= work_clock:
                r = pop(computing)[1]
                push(events, (now + waiting[r], r))
        if not events:
            break
        now = events[0][0]
        deciding = []
        while events and events[0][0] == now:
            r = pop(events)[1]
            if r >= p:  # an arrival
                r, task = pending[r - p]
                arrived[r].add(task)
                deciding.append(r)
                continue
            deciding.append(r)
            task, (_, dst, targets, _) = running[r]
            running[r] = None
            if shared:
                busy[r] += now - started[r]
                if record:
                    timeline[timeline_row[r]] = (r, task, started[r], now - started[r])
            complete[r](task, now - started[r])
            if weight_slices > 1 and task[0] == WEIGHT:
                parts = weight_parts[r].get(task, 0) + 1
                if parts < weight_slices:
                    weight_parts[r][task] = parts
                    continue
                del weight_parts[r][task]
            if count_in_flight:
                if task[0] == release:
                    in_flight[r] -= 1
                elif split and task[0] == BACKWARD:
                    activations[r] -= 1
            if dst < 0:
                continue
            target = targets[task[2]]
            delay = latency(r, dst, target) if callable(latency) else latency
            if delay:
                push(events, (now + delay, p + len(pending)))
                pending.append((dst, target))
            else:
                arrived[dst].add(target)
                deciding.append(dst)
    stuck = [r for r in range(p) if not runners[r].finished]
    if stuck:
        raise DeadlockError(f"deadlock: ranks {stuck} can never run their next task", stuck)
    return EngineResult(now, busy, peak, peak_activations if split else list(peak), timeline)


class StaticReplay:
    """Runs a fixed order of tasks, each once its inputs are here (megatron-style)."""

    __slots__ = ("rank", "order", "_next", "_message", "_predecessor_at")

    def __init__(self, rank: int, topology: PipelineTopology, order: Sequence[Task]):
        self.rank = rank
        self.order = list(order)
        self._next = 0
        # per position: the task whose input must have arrived (None: a local input), and
        # the position of the task of this rank that must run first (-1: none; past the
        # end when the order lacks it, so that it never runs)
        self._message = [None if topology.input_is_local(rank, t) else t for t in self.order]
        position = {task: k for k, task in enumerate(self.order)}
        never = len(self.order)
        self._predecessor_at = [
            position.get((LOCAL_PREDECESSOR[kind], chunk, microbatch), never)
            if kind in LOCAL_PREDECESSOR else -1
            for kind, chunk, microbatch in self.order]

    @property
    def finished(self) -> bool:
        return self._next == len(self.order)

    @property
    def position(self) -> int:
        """Index in `order` of the next task to run."""
        return self._next

    def next_task(self, arrived) -> Task | None:
        k = self._next
        if k == len(self.order) or self._predecessor_at[k] >= k:
            return None
        message = self._message[k]
        if message is not None and not arrived(message):
            return None
        return self.order[k]

    def complete(self, task: Task, duration: float | None = None) -> None:
        self._next += 1

    def done(self, task: Task) -> bool:
        return task in self.order[:self._next]
