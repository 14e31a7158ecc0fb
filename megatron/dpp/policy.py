"""The DPP decision rule: which task a pipeline stage runs next.

Plan-guided greedy: a stage runs the next task of its plan (megatron-core's static order
plus up to `slack` extra warm-up forwards) when its input is here, else the earliest later
ready task that keeps the rest of the plan within the caps on microbatches (and, given
token counts, on tokens) held. So the planned task is never blocked and the static plan's
deadlock freedom carries over; at slack 0 the order and memory are megatron-core's. With
the split backward each W is a filler that runs when the planned F or B is not ready (with
`StageConfig.weights_by_backward`, of the pending ones the one whose B was shortest, so that
the longest fill the drain at the iteration's end).
Given each microbatch's cost, the plan runs them in a cost order (`choose_cost_order`).

Pure Python (no torch, no I/O) so the runtime schedule and the simulator run the same
code. docs/design.md ("The rule") has the details; docs/benchmarks/simulator.md and
simulator_split.md the measurements behind the defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from megatron.dpp.actions import BACKWARD, FORWARD, KINDS, WEIGHT, Task
from megatron.dpp.engine import run_pipeline, task_table
from megatron.dpp.plan import (
    PlanError,
    StageConfig,
    check_permutation,
    check_plans,
    plan_order,
    plan_skeleton,
    static_peak,
    weight_delay,
)
from megatron.dpp.topology import PipelineTopology


def plan_extra_warmup(stage: StageConfig) -> int:
    """Warmup forwards the DPP plan adds to megatron's: min(slack, stages after this one),
    and with virtual chunks no more than keeps every rank's plan deadlock-free.

    Fewer extra forwards on later stages: the last stage's backward input is its own loss,
    so forwards buffered there only delay the backward chain (docs/benchmarks/simulator.md).
    One chunk: any extra warmup keeps the plans deadlock-free. Interleaved: 3 or more
    extra forwards deadlock them at p >= 4 with m >= 2p (rank 0 waits for a forward that
    the last rank runs only after a backward rank 0 has not run yet), so the extra is the
    largest up to the slack that `check_plans` proves safe.
    """
    if stage.forward_only:
        return 0
    wanted = min(stage.slack, stage.pp_size - 1 - stage.rank)
    if stage.num_chunks == 1:
        return wanted
    safe = _safe_extra_warmup(replace(stage, rank=0, forward_only=False))
    return min(wanted, safe)


@lru_cache(maxsize=256)
def _safe_extra_warmup(first: StageConfig) -> int:
    """The largest e <= slack with which the plans (min(e, stages after) extra warmup
    forwards per rank) pass the checker; `first` is rank 0's StageConfig."""
    topology = PipelineTopology(first.pp_size, first.num_chunks)
    stages = [replace(first, rank=r) for r in range(first.pp_size)]
    for extra in range(min(first.slack, first.pp_size - 1), 0, -1):
        plans = [plan_order(s, min(extra, s.pp_size - 1 - s.rank)) for s in stages]
        try:
            check_plans(plans, topology, first.num_microbatches)
        except PlanError:
            continue
        return extra
    return 0


# (peak, descent) of the cost orders `choose_cost_order` compares: a linear fall after
# the peak, and one that stays high longer (better at p <= 8 on average, worse at p >= 16,
# docs/benchmarks/simulator.md). The first is the order where the comparison is skipped.
ORDER_CANDIDATES = ((0.3, 1.0), (0.3, 0.5))
# backward / forward time assumed when predicting a cost order's makespan
BACKWARD_COST_RATIO = 2.0
# most tasks (2 * pp_size * microbatches) `choose_cost_order` simulates per candidate; a
# simulation takes ~0.8 ms of CPU time at p = 8, m = 32 (512 tasks), ~3.5 ms at p = 16,
# m = 64 (2048), about linear in the task count (profiling/bench_cost_order.py)
ORDER_CHOICE_MAX_TASKS = 2048


def cost_order(costs: list[float], peak: float = 0.3, descent: float = 1.0) -> list[int]:
    """Microbatch order from per-microbatch costs known before the iteration (e.g. token
    counts): the cheapest first, costs rising to the dearest at fraction `peak` of the way,
    then falling to a cheap last microbatch. Each position x in [0, 1] gets a height, x /
    peak before the peak and ((1 - x) / (1 - peak)) ** descent after it; the cheapest
    microbatch takes the lowest position, and so on (ties: the earlier position first).
    descent < 1 keeps the costs high for longer after the peak.

    Cheap ends shorten the pipeline's fill and drain. The rise is steep and early because
    while the costs rise, the first stage waits at its in-flight cap for the gradients of
    the cheaper, older microbatches; with the peak near the end of its warmup (~0.3 of
    the way at m = 4p) it runs most of the rise before it needs a gradient. Equal costs
    keep the natural order."""
    m = len(costs)
    if not 0.0 < peak < 1.0 or descent <= 0.0:
        raise ValueError(f"cost_order: need 0 < peak < 1 and descent > 0, got {peak}, {descent}")
    if m == 0 or max(costs) == min(costs):
        return list(range(m))
    last = max(m - 1, 1)

    def height(position: int) -> float:
        x = position / last
        if x <= peak:
            return x / peak
        return ((1.0 - x) / (1.0 - peak)) ** descent

    positions = sorted(range(m), key=lambda k: (height(k), k))
    ranked = sorted(range(m), key=lambda i: (costs[i], i))
    order = [0] * m
    for position, microbatch in zip(positions, ranked, strict=True):
        order[position] = microbatch
    return order


def choose_cost_order(costs: list[float], pp_size: int, slack: int = 0) -> list[int]:
    """The cost order of `ORDER_CANDIDATES` with the shortest `simulated_makespan` for a
    pipeline of `pp_size` stages with this slack (one model chunk); the first candidate
    wins ties, and is taken without a comparison above `ORDER_CHOICE_MAX_TASKS`. A pure
    function of its arguments, so every rank gets the same order. The split backward's
    rule uses it too: simulating that rule instead (50 % more tasks) picked orders 0.1-0.4 %
    faster but took ~2.2 ms at p = 8, m = 32 (docs/benchmarks/simulator_split.md)."""
    candidates = []
    for peak, descent in ORDER_CANDIDATES:
        order = cost_order(costs, peak, descent)
        if order not in candidates:
            candidates.append(order)
    if len(candidates) == 1 or 2 * pp_size * len(costs) > ORDER_CHOICE_MAX_TASKS:
        return candidates[0]
    makespans = [simulated_makespan(costs, pp_size, slack, order) for order in candidates]
    return candidates[makespans.index(min(makespans))]


def simulated_makespan(costs: list[float], pp_size: int, slack: int, order: list[int],
                       backward_ratio: float = BACKWARD_COST_RATIO) -> float:
    """Makespan of the pipeline when every rank runs `GreedyPolicy` (one model chunk, the
    microbatch order `order`) and microbatch i takes costs[i] forward and backward_ratio *
    costs[i] backward on every stage, with no communication latency: the simulator's
    engine on those durations."""
    m = len(costs)
    backward = [backward_ratio * c for c in costs]
    durations = {FORWARD: [costs] * pp_size, BACKWARD: [backward] * pp_size}
    runners = [GreedyPolicy(StageConfig(r, pp_size, 1, m, slack=slack), microbatch_order=order)
               for r in range(pp_size)]
    return run_pipeline(PipelineTopology(pp_size), runners, durations,
                        count_in_flight=False).makespan


def microbatch_order_for(stage: StageConfig, costs: list[float] | None) -> list[int] | None:
    """The microbatch order DPP runs given the microbatches' costs (None: unknown): the
    cost order for one model chunk in training, megatron's order otherwise (None)."""
    if costs is None:
        return None
    if len(costs) != stage.num_microbatches:
        raise ValueError(f"{len(costs)} microbatch costs for {stage.num_microbatches} "
                         "microbatches")
    if stage.num_chunks > 1 or stage.forward_only:
        return None
    return choose_cost_order(costs, stage.pp_size, stage.slack)


@dataclass(frozen=True)
class _PlanShape:
    """What the policy needs of its plan that does not depend on the microbatch order."""

    skeleton: tuple[tuple[str, int, int], ...]  # (kind, chunk, k-th microbatch of the order)
    # [kind][chunk][k]: plan position of the k-th task of that kind and chunk
    position: dict[str, tuple[tuple[int, ...], ...]]
    peak_from: tuple[int, ...]  # the most the plan holds from F to B from position k on
    cap: int  # on microbatches from F to B
    # with the split backward: the same from F to W (otherwise None and 0)
    held_peak_from: tuple[int, ...] | None
    held_cap: int


def _peaks_from(skeleton, release: str) -> tuple[int, ...]:
    """[k]: the most microbatches the plan holds (F counts up, `release` down) at any
    position from k on."""
    profile = [0]
    for kind, _, _ in skeleton:
        profile.append(profile[-1] + (1 if kind == FORWARD else -1 if kind == release else 0))
    for k in range(len(profile) - 2, -1, -1):
        profile[k] = max(profile[k], profile[k + 1])
    return tuple(profile)


@lru_cache(maxsize=1024)
def _plan_shape(stage: StageConfig, extra_warmup: int) -> _PlanShape:
    skeleton = plan_skeleton(stage, extra_warmup)
    chunks, m = stage.num_chunks, stage.num_microbatches
    position = {kind: [[0] * m for _ in range(chunks)] for kind in KINDS}
    for pos, (kind, chunk, k) in enumerate(skeleton):
        position[kind][chunk][k] = pos
    position = {kind: tuple(map(tuple, rows)) for kind, rows in position.items()}
    total = m * chunks
    split = stage.split_backward and not stage.forward_only
    if stage.forward_only:
        cap = total
    else:
        cap = min(static_peak(stage) + stage.slack, total)
    held_peak_from, held_cap = None, 0
    if split:
        # what the split plan holds from F to W: this rank's static peak plus the Ws it
        # defers (plan.weight_delay: rank 0's peak with the W deferred, its own without)
        held_peak_from = _peaks_from(skeleton, WEIGHT)
        held_cap = min(static_peak(stage) + weight_delay(stage) + stage.slack, total)
    return _PlanShape(skeleton, position, _peaks_from(skeleton, BACKWARD), cap,
                      held_peak_from, held_cap)


@lru_cache(maxsize=16)
def _task_sequences(chunks: int, m: int, order: tuple[int, ...]
                    ) -> dict[str, tuple[tuple[Task, ...], ...]]:
    """[kind][chunk][k]: the task of the k-th microbatch of `order`; the same on every rank."""
    return {kind: tuple(tuple(task_table(kind, c, m)[i] for i in order) for c in range(chunks))
            for kind in KINDS}


class GreedyPolicy:
    """Plan-guided greedy task choice for one pipeline rank (see the module docstring).

    `microbatch_order`: the order the microbatches go through the plan (default 0..m-1;
    `microbatch_order_for` gives DPP's from the microbatches' costs). The rule does not
    estimate durations ahead: deviating only when the substitute would finish before the
    planned input arrives never deviated in the simulator, because a lower bound on that
    arrival is shorter than a backward. With `StageConfig.weights_by_backward` it uses the
    durations reported to `complete` to order the pending W tasks
    (`_cheapest_weight_first`).
    """

    __slots__ = ("stage", "_order", "_forwards", "_backwards", "_weights", "_plan",
                 "_forward_position", "_backward_position", "_weight_position", "_peak_from",
                 "_held_peak_from", "_cap", "_held_cap", "_split", "_length", "_done",
                 "_next_pos", "_ahead_forwards", "_next_forward", "_next_backward",
                 "_next_weight", "_in_flight", "_held", "_running", "_running_pos",
                 "_backward_ahead", "_local_forward_chunk", "_local_backward_chunk",
                 "_costs", "_cost_peak_from", "_cost_cap", "_held_cost", "_ahead_cost",
                 "_weight_slices", "_weight_parts", "_backward_durations", "_weights_by_backward",
                 "static")

    def __init__(self, stage: StageConfig, extra_warmup: int | None = None,
                 microbatch_order: list[int] | None = None,
                 costs: list[float] | None = None, static: bool = False):
        self.stage = stage
        # the plan in order, each task once its input is here: the static schedule on the
        # same runtime (ZB-H1 or interleaved zero bubble with the split), for comparison
        self.static = static
        chunks, m = stage.num_chunks, stage.num_microbatches
        if extra_warmup is None:
            extra_warmup = plan_extra_warmup(stage)
        if not 0 <= extra_warmup <= stage.slack:
            raise ValueError(f"extra_warmup {extra_warmup} not in [0, slack={stage.slack}]")
        if microbatch_order is not None:
            check_permutation(microbatch_order, m)
        order = range(m) if microbatch_order is None else microbatch_order
        shape = _plan_shape(stage, extra_warmup)
        self._order = tuple(order)
        # the k-th forward / backward / W of each chunk in the plan's microbatch order
        sequences = _task_sequences(chunks, m, self._order)
        self._forwards, self._backwards = sequences[FORWARD], sequences[BACKWARD]
        # lists: the rule may swap two pending W tasks' turns (_cheapest_weight_first)
        self._weights = [list(weights) for weights in sequences[WEIGHT]]
        self._plan = [sequences[kind][chunk][k] for kind, chunk, k in shape.skeleton]
        self._forward_position = shape.position[FORWARD]
        self._backward_position = shape.position[BACKWARD]
        self._weight_position = shape.position[WEIGHT]
        self._peak_from = shape.peak_from
        self._held_peak_from = shape.held_peak_from
        self._cap = shape.cap
        self._split = shape.held_peak_from is not None
        # without the split nothing is held past B: a cap the F->W count never reaches
        self._held_cap = shape.held_cap if self._split else len(self._plan) + 1
        self._length = len(self._plan)
        self._done = bytearray(self._length)
        self._next_pos = 0  # first plan position not done
        self._ahead_forwards = 0  # forwards done at plan positions after _next_pos
        self._next_forward = [0] * chunks
        self._next_backward = [0] * chunks
        self._next_weight = [0] * chunks
        self._in_flight = 0  # microbatches from F to B
        self._held = 0  # with the split: microbatches from F to W
        self._weight_slices = stage.weight_slices if self._split else 1
        # per chunk: parts run of its next W (each chunk runs its W tasks in turn)
        self._weight_parts = [0] * chunks
        # the dynamic rule only: the plan in order keeps its W order
        self._weights_by_backward = stage.weights_by_backward and not static
        # [chunk][microbatch]: how long its B took, where the runner reported it (kept only
        # where the W order follows it)
        self._backward_durations: list[list[float | None]] = [
            [None] * m for _ in range(chunks)]
        self._running: Task | None = None
        self._running_pos = 0
        self._backward_ahead = stage.slack > 0 and not stage.forward_only
        # -1 never matches a chunk: this rank has no local input of that kind
        self._local_forward_chunk = 0 if stage.rank == 0 else -1
        self._local_backward_chunk = chunks - 1 if stage.rank == stage.pp_size - 1 else -1
        self._held_cost = self._ahead_cost = 0
        self._costs = self._cost_peak_from = None
        self._cost_cap = 0
        if costs is not None and not stage.forward_only:
            self._cap_costs(list(costs))

    def _cap_costs(self, costs: list[float]) -> None:
        """The token cap (module docstring): the plan's held cost from each position on,
        and the cap, the static schedule's peak in this order plus the slack's dearest
        microbatches (the plan's extra warm-up forwards stay within it)."""
        if len(costs) != self.stage.num_microbatches or any(c < 0 for c in costs):
            raise ValueError(f"{len(costs)} microbatch costs (each >= 0) for "
                             f"{self.stage.num_microbatches} microbatches")
        release = WEIGHT if self._split else BACKWARD
        profile = [0]
        for kind, _, microbatch in self._plan:
            change = costs[microbatch] if kind == FORWARD else (
                -costs[microbatch] if kind == release else 0)
            profile.append(profile[-1] + change)
        for k in range(len(profile) - 2, -1, -1):
            profile[k] = max(profile[k], profile[k + 1])
        # the static schedule: the plan without the slack's extra warm-up forwards
        held = static_peak_cost = 0
        for kind, _, k in _plan_shape(self.stage, 0).skeleton:
            cost = costs[self._order[k]]
            held += cost if kind == FORWARD else (-cost if kind == release else 0)
            static_peak_cost = max(static_peak_cost, held)
        self._costs, self._cost_peak_from = costs, profile
        self._cost_cap = static_peak_cost + sum(sorted(costs, reverse=True)[:self.stage.slack])

    @property
    def cap(self) -> int:
        """The most microbatches this rank holds from F to their release (W with the split
        backward, else B)."""
        return self._held_cap if self._split else self._cap

    @property
    def activation_cap(self) -> int:
        """The most microbatches this rank holds from F to B."""
        return self._cap

    @property
    def cost_cap(self) -> float | None:
        """The most cost (tokens) this rank holds from F to release; None without costs."""
        return None if self._costs is None else self._cost_cap

    @property
    def held_cost(self) -> float:
        """The cost of the microbatches held from F to release (0 without costs)."""
        return self._held_cost

    def _forward_fits(self, task: Task) -> bool:
        """Whether a forward run out of the plan's turn keeps the rest of the plan within
        the token cap (always without costs)."""
        costs = self._costs
        return costs is None or (self._cost_peak_from[self._next_pos] + self._ahead_cost
                                 + costs[task[2]] <= self._cost_cap)

    @property
    def in_flight(self) -> int:
        """Microbatches from F to their release (W with the split backward, else B)."""
        return self._held if self._split else self._in_flight

    @property
    def num_decisions(self) -> int:
        """How many tasks next_task returns in all: the plan's, each W counted once per
        part (`StageConfig.weight_slices`)."""
        weights = sum(1 for task in self._plan if task[0] == WEIGHT)
        return self._length + (self._weight_slices - 1) * weights

    @property
    def finished(self) -> bool:
        return self._next_pos == self._length

    @property
    def microbatch_order(self) -> list[int]:
        return list(self._order)

    @property
    def plan(self) -> list[Task]:
        return list(self._plan)

    def input_is_local(self, task: Task) -> bool:
        return self.stage.topology.input_is_local(self.stage.rank, task)

    def next_task(self, arrived, deviate: bool = True, arriving=None) -> Task | None:
        """The task to run now, or None; `arrived(task)` says whether the task's input from
        another rank is here (asked only where the input is not local).

        The runtime decides at GPU time (megatron/dpp/gpu_queue.py) and passes two more
        things. `deviate=False` while its GPU is still busy: only the plan's next task (a
        planned W still yields to the next planned F or B that has arrived), never one run
        ahead: the planned input may yet land before the GPU is free. `arriving(task)`,
        with `arrived` meaning "landed": the task's input is on its way (announced, its
        copy queued); a planned task whose input is arriving is deviated from only by a
        part of a pending W, short enough not to hold it up, never by a forward or
        backward of the plan's future."""
        if self._running is not None:
            raise RuntimeError(f"next_task called while {self._running} is still running")
        pos = self._next_pos
        if pos == self._length:
            return None
        task = self._plan[pos]
        kind = task[0]
        if kind == FORWARD:
            ready = (self._in_flight < self._cap and self._held < self._held_cap
                     and (task[1] == self._local_forward_chunk or arrived(task)))
        elif kind == BACKWARD:
            ready = task[1] == self._local_backward_chunk or arrived(task)
        else:  # a W (its B, earlier in the plan, ran): it fills, so a ready F or B goes first
            substitute = None if self.static else self._past_weights(arrived)
            if substitute is not None:
                return substitute
            if self._weights_by_backward:
                self._cheapest_weight_first(task[1])
                task = self._plan[pos]
            ready = True
        if ready:
            self._running, self._running_pos = task, pos
            return task
        if self.static or not deviate:
            return None
        if arriving is not None and arriving(task):
            return self._pending_weight()
        return self._run_ahead(arrived)

    def _pending_weight(self) -> Task | None:
        """The pending W (its B ran) earliest in the plan, to fill a short wait; None when
        there is none."""
        if not self._split:
            return None
        found = [w for chunk in range(self.stage.num_chunks)
                 if (w := self._weight_ready(chunk)) is not None]
        if not found:
            return None
        self._running, self._running_pos = min(found, key=lambda w: w[1])
        return self._running

    def _weight_ready(self, chunk: int) -> tuple[Task, int] | None:
        """The chunk's next W and its plan position when its B ran (a W's input is local:
        it is then ready); None otherwise."""
        w = self._next_weight[chunk]
        if w < self._next_backward[chunk]:
            if self._weights_by_backward:
                self._cheapest_weight_first(chunk)
            return self._weights[chunk][w], self._weight_position[chunk][w]
        return None

    def _cheapest_weight_first(self, chunk: int) -> None:
        """Give the chunk's next W turn to its pending W (B ran) whose B was the shortest,
        swapping the two W tasks' places in the plan: a W takes about what its B took, and
        the longest ones, kept for last, fill the pipeline's drain, where a stage waits for
        the last backwards and has nothing but W tasks to run. Without every pending B's
        duration, or with a W run in part, the turns stay in order."""
        first, end = self._next_weight[chunk], self._next_backward[chunk]
        if end - first < 2 or self._weight_parts[chunk]:
            return
        weights, durations = self._weights[chunk], self._backward_durations[chunk]
        best, shortest = first, durations[weights[first][2]]
        if shortest is None:
            return
        for k in range(first + 1, end):
            duration = durations[weights[k][2]]
            if duration is None:
                return
            if duration < shortest:
                best, shortest = k, duration
        if best != first:
            positions = self._weight_position[chunk]
            weights[first], weights[best] = weights[best], weights[first]
            plan = self._plan
            plan[positions[first]], plan[positions[best]] = weights[first], weights[best]

    def _past_weights(self, arrived) -> Task | None:
        """The first F or B of the plan not done after the planned W (and the W tasks that
        follow it), when it is ready and within both caps; None otherwise. Only W tasks are
        passed over, so the F->B count at that F is the plan's; the F->W cap is checked
        directly, and the W tasks passed over stay runnable (their input is local)."""
        plan, done, pos = self._plan, self._done, self._next_pos + 1
        while pos < self._length and (done[pos] or plan[pos][0] == WEIGHT):
            pos += 1
        if pos == self._length:
            return None
        task = plan[pos]
        if task[0] == FORWARD:
            ready = (self._in_flight < self._cap and self._held < self._held_cap
                     and self._forward_fits(task)
                     and (task[1] == self._local_forward_chunk or arrived(task)))
        else:
            ready = task[1] == self._local_backward_chunk or arrived(task)
        if not ready:
            return None
        self._running, self._running_pos = task, pos
        return task

    def _run_ahead(self, arrived) -> Task | None:
        """The earliest later plan task that is ready, within the rule's conditions."""
        best, best_pos = None, self._length
        next_pos, ahead = self._next_pos, self._ahead_forwards
        forward_ok = (self._in_flight < self._cap
                      and self._cap - self._peak_from[next_pos] - ahead > 0)
        split = self._split
        if split and forward_ok:
            forward_ok = (self._held < self._held_cap
                          and self._held_cap - self._held_peak_from[next_pos] - ahead > 0)
        next_forward, next_backward = self._next_forward, self._next_backward
        m = self.stage.num_microbatches
        for chunk in range(self.stage.num_chunks):
            k = next_backward[chunk]
            if split and (weight := self._weight_ready(chunk)) is not None \
                    and weight[1] < best_pos:
                best, best_pos = weight
            if self._backward_ahead and k < next_forward[chunk]:
                pos = self._backward_position[chunk][k]
                if pos < best_pos:
                    task = self._backwards[chunk][k]
                    if chunk == self._local_backward_chunk or arrived(task):
                        best, best_pos = task, pos
            k = next_forward[chunk]
            if forward_ok and k < m:
                pos = self._forward_position[chunk][k]
                if pos < best_pos:
                    task = self._forwards[chunk][k]
                    if self._forward_fits(task) and (
                            chunk == self._local_forward_chunk or arrived(task)):
                        best, best_pos = task, pos
        if best is not None:
            self._running, self._running_pos = best, best_pos
        return best

    def complete(self, task: Task, duration: float | None = None) -> None:
        """The running task ended; `duration`: how long it took (a B's orders the pending W
        tasks, `_cheapest_weight_first`), None where the runner does not know."""
        running = self._running
        if task is not running and task != running:
            raise RuntimeError(f"complete({task}) but the running task is {running}")
        pos = self._running_pos
        self._running = None
        kind = task[0]
        if kind == WEIGHT and self._weight_slices > 1:
            parts = self._weight_parts[task[1]] + 1
            if parts < self._weight_slices:  # the W goes on later; it is still held
                self._weight_parts[task[1]] = parts
                return
            self._weight_parts[task[1]] = 0
        costs = self._costs
        cost = 0 if costs is None else costs[task[2]]
        if kind == FORWARD:
            self._next_forward[task[1]] += 1
            self._in_flight += 1
            self._held += 1
            self._held_cost += cost
        elif kind == BACKWARD:
            self._next_backward[task[1]] += 1
            if self._weights_by_backward:  # nothing else reads a B's duration
                self._backward_durations[task[1]][task[2]] = duration
            self._in_flight -= 1
            if not self._split:
                self._held_cost -= cost
        else:
            self._next_weight[task[1]] += 1
            self._held -= 1
            self._held_cost -= cost
        done = self._done
        done[pos] = 1
        if pos != self._next_pos:
            if kind == FORWARD:
                self._ahead_forwards += 1
                self._ahead_cost += cost
            return
        plan, length = self._plan, self._length
        pos += 1
        while pos < length and done[pos]:
            if plan[pos][0] == FORWARD:
                self._ahead_forwards -= 1
                if costs is not None:
                    self._ahead_cost -= costs[plan[pos][2]]
            pos += 1
        self._next_pos = pos
