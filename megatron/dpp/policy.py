"""The DPP decision rule: which task a pipeline stage runs next.

Pure Python (no torch, no I/O) so the runtime schedule and the simulator run the same code.

The rule is plan-guided greedy. The plan is megatron-core's static order for this rank
(1F1B, or interleaved 1F1B with virtual chunks) with min(slack, pp_size - 1 - rank) more
warmup forwards (`plan_extra_warmup`); with slack 0 it is exactly megatron's order. The
extra warmup buffers forwards for the stages downstream, so a stage gets no more of it
than it has stages after it: the last stage, whose backward input is its own loss, keeps
megatron's strict F, B alternation in its plan (buffering forwards ahead of it only
delays the backward chain every other stage waits for). The cap on in-flight
microbatches is megatron's peak plus the slack, for every rank. A stage runs the first
task of the plan it has not run yet whenever that task's input is here. When it is not,
it runs the earliest later task of the plan whose input is here, under two conditions:

* a forward may run ahead only while the plan stays feasible under the cap: the plan's
  own in-flight count from here on plus the forwards already run ahead of it stays within
  the cap. So the planned task is never blocked by the cap, and since the static plan is
  deadlock-free, a stage waiting for its planned task can never deadlock the pipeline.
* a backward may run ahead only with slack > 0. A backward run early delays the planned
  forward, and with no slack the downstream stages hold no spare forwards to cover the
  delay: in the simulator that made DPP 2-4 % slower than static 1F1B under variance
  (docs/benchmarks/simulator.md), while with slack it is where most of the gain comes from.

Given each microbatch's cost before the iteration (its token count), the plan runs the
microbatches in a cost order instead of 0..m-1 (one model chunk per rank only): cheap
first, dearest about 0.3 of the way, cheap last (`cost_order`). `choose_cost_order` picks
one of two such orders (`ORDER_CANDIDATES`) by simulating this very rule on the known
costs (`predicted_makespan`); every rank computes the same choice from the same costs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

FORWARD = "F"
BACKWARD = "B"


@dataclass(frozen=True, order=True, slots=True)
class Task:
    kind: str  # FORWARD or BACKWARD
    chunk: int  # local model chunk index on this rank
    microbatch: int


@dataclass(frozen=True)
class StageConfig:
    """One pipeline rank's view of the schedule.

    Virtual stage of local chunk c is c * pp_size + rank (megatron's layout).
    `microbatch_group_size` is megatron's microbatch_group_size_per_vp_stage (default
    pp_size); it only matters with num_chunks > 1.
    """

    rank: int
    pp_size: int
    num_chunks: int = 1
    num_microbatches: int = 1
    slack: int = 0
    forward_only: bool = False
    microbatch_group_size: int | None = None

    def __post_init__(self):
        if self.pp_size < 1:
            raise ValueError(f"StageConfig: pp_size must be >= 1, got {self.pp_size}")
        if not 0 <= self.rank < self.pp_size:
            raise ValueError(f"StageConfig: rank {self.rank} not in [0, {self.pp_size})")
        if self.num_chunks < 1:
            raise ValueError(f"StageConfig: num_chunks must be >= 1, got {self.num_chunks}")
        if self.num_microbatches < 1:
            raise ValueError(
                f"StageConfig: num_microbatches must be >= 1, got {self.num_microbatches}"
            )
        if self.slack < 0:
            raise ValueError(f"StageConfig: slack must be >= 0, got {self.slack}")
        if self.num_chunks > 1:
            self._check_interleaving()

    def _check_interleaving(self):
        # the same limits megatron-core 0.16.1 enforces for its interleaved schedule
        group, p, m = self.group_size, self.pp_size, self.num_microbatches
        if not p <= group <= m:
            raise ValueError(
                f"StageConfig: with num_chunks={self.num_chunks}, microbatch group size "
                f"{group} must be in [pp_size={p}, num_microbatches={m}]"
            )
        remainder = m % group
        if 0 < remainder < p:
            raise ValueError(
                f"StageConfig: with num_chunks={self.num_chunks}, num_microbatches={m} "
                f"leaves a last microbatch group of {remainder} < pp_size={p} "
                f"(group size {group}); megatron-core rejects this too"
            )

    @property
    def group_size(self) -> int:
        return self.microbatch_group_size or self.pp_size

    @property
    def num_virtual_stages(self) -> int:
        return self.pp_size * self.num_chunks

    def virtual_stage(self, chunk: int) -> int:
        return chunk * self.pp_size + self.rank


def _interleaved_table(stage: StageConfig) -> list[tuple[int, int]]:
    """(microbatch, chunk) of each forward, in megatron's interleaved forward order."""
    m, chunks, group = stage.num_microbatches, stage.num_chunks, stage.group_size
    table = []
    for first in range(0, m, group):
        last = m if first + group >= m else first + group
        table.extend((i, c) for c in range(chunks) for i in range(first, last))
    return table


def static_order(stage: StageConfig) -> list[Task]:
    """This rank's task order in megatron-core's static schedule.

    num_chunks == 1: 1F1B (warmup forwards, then one forward one backward, then cooldown
    backwards). num_chunks > 1: megatron-core's interleaved 1F1B, whose backward k runs
    chunk num_chunks - 1 - chunk(k) on the microbatch of forward k.
    """
    return plan_order(stage, extra_warmup=0)


def plan_extra_warmup(stage: StageConfig) -> int:
    """Warmup forwards the DPP plan adds to megatron's: min(slack, stages after this one).

    In the simulator's acceptance grid (p <= 8, +2 slack) this took the mean over the
    non-uniform cells from 1.067x to 1.083x of static 1F1B against `stage.slack` on
    every rank (docs/benchmarks/simulator.md); the gain is almost all the last stage's.
    """
    if stage.forward_only:
        return 0
    return min(stage.slack, stage.pp_size - 1 - stage.rank)


def plan_order(
    stage: StageConfig,
    extra_warmup: int | None = None,
    microbatch_order: list[int] | None = None,
) -> list[Task]:
    """The static order with `extra_warmup` (default: `plan_extra_warmup(stage)`) more
    warmup forwards; the DPP policy's plan. `microbatch_order`, a permutation of
    range(num_microbatches) (default: the natural order), is the order in which the
    microbatches go through the schedule; every rank must use the same one."""
    p, r, chunks, m = stage.pp_size, stage.rank, stage.num_chunks, stage.num_microbatches
    if extra_warmup is None:
        extra_warmup = plan_extra_warmup(stage)
    table = [(i, 0) for i in range(m)] if chunks == 1 else _interleaved_table(stage)
    if microbatch_order is not None:
        _check_permutation(microbatch_order, m)
        table = [(microbatch_order[i], c) for i, c in table]
    forwards = [Task(FORWARD, c, i) for i, c in table]
    if stage.forward_only:
        return forwards
    backwards = [Task(BACKWARD, chunks - 1 - c, i) for i, c in table]
    total = len(table)
    if chunks == 1:
        warmup = p - r - 1
    else:
        warmup = 2 * (p - r - 1) + (chunks - 1) * stage.group_size
    warmup = min(warmup + extra_warmup, total)
    order = forwards[:warmup]
    for k in range(total - warmup):
        order.append(forwards[warmup + k])
        order.append(backwards[k])
    order.extend(backwards[total - warmup :])
    return order


def _check_permutation(order: list[int], m: int) -> None:
    if sorted(order) != list(range(m)):
        raise ValueError(f"microbatch order {order} is not a permutation of range({m})")


# (peak, descent) of the cost orders `choose_cost_order` compares: a linear fall after
# the peak, and one that stays high longer (better at p <= 8 on average, worse at p >= 16,
# docs/benchmarks/simulator.md). The first is the order where the comparison is skipped.
ORDER_CANDIDATES = ((0.3, 1.0), (0.3, 0.5))
# backward / forward time assumed when predicting a cost order's makespan
BACKWARD_COST_RATIO = 2.0
# most tasks (2 * pp_size * microbatches) `choose_cost_order` simulates per candidate; a
# prediction takes ~0.45 ms of host time at p = 8, m = 32 (512 tasks), ~2.3 ms at p = 16,
# m = 64 (2048), linear in the task count
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
    """The cost order of `ORDER_CANDIDATES` with the shortest `predicted_makespan` for a
    pipeline of `pp_size` stages with this slack (one model chunk); the first candidate
    wins ties, and is taken without a comparison above `ORDER_CHOICE_MAX_TASKS`. A pure
    function of its arguments, so every rank gets the same order."""
    candidates = []
    for peak, descent in ORDER_CANDIDATES:
        order = cost_order(costs, peak, descent)
        if order not in candidates:
            candidates.append(order)
    if len(candidates) == 1 or 2 * pp_size * len(costs) > ORDER_CHOICE_MAX_TASKS:
        return candidates[0]
    makespans = [predicted_makespan(costs, pp_size, slack, order) for order in candidates]
    return candidates[makespans.index(min(makespans))]


def predicted_makespan(
    costs: list[float],
    pp_size: int,
    slack: int,
    order: list[int],
    backward_ratio: float = BACKWARD_COST_RATIO,
) -> float:
    """Makespan of the pipeline when every rank runs `GreedyPolicy` (one model chunk, the
    plan of `plan_order` with `order`, the policy's cap) and microbatch i takes costs[i]
    forward and backward_ratio * costs[i] backward on every stage, with no communication
    latency: the same result as megatron.dpp.simulate's DPP run on those durations
    (tests/test_policy.py checks it), several times faster.

    A rank's state is the number f of forwards and b of backwards it has run (both run in
    order), so everything GreedyPolicy tracks has a closed form: in the plan (w warmup
    forwards) forward j sits at position j (j < w) or 2j - w, backward j at w + 2j + 1
    (j < m - w) or m + j; the planned task is the one at the lower position; the forwards
    run ahead of a planned backward b are f minus the min(w + b + 1, m) that the plan puts
    before it; and the plan's peak in flight from position k on is w + 1 (w if w = m) up
    to k = 2m - w, then 2m - k."""
    p, m = pp_size, len(costs)
    _check_permutation(order, m)
    forward = [costs[i] for i in order]  # by position in the order
    backward = [backward_ratio * c for c in forward]
    # plan_order's warmup (plan_extra_warmup's extra) and GreedyPolicy's cap, per rank
    warmups = [min(p - 1 - r + min(slack, p - 1 - r), m) for r in range(p)]
    caps = [min(min(p - r, m) + slack, m) for r in range(p)]
    done_f, done_b = [0] * p, [0] * p
    # forwards / backwards whose input has arrived at rank r (local inputs: all of them)
    in_f = [m] + [0] * (p - 1)
    in_b = [0] * (p - 1) + [m]
    idle = float("inf")
    ends = [idle] * p  # end of the task running on each rank; idle: none runs
    running_forward = [False] * p
    now = 0.0
    deciding = list(range(p))  # ranks to offer a task (duplicates are harmless)
    while True:
        for r in deciding:
            if ends[r] != idle:
                continue
            f, b, w = done_f[r], done_b[r], warmups[r]
            if b == m:
                continue  # finished
            forward_ready = f < in_f[r] and f - b < caps[r]
            backward_ready = b < f and b < in_b[r]
            backward_pos = w + 2 * b + 1 if b < m - w else m + b
            if f < m and (f if f < w else 2 * f - w) < backward_pos:  # planned: forward f
                if forward_ready:
                    run_forward = True
                elif slack and backward_ready:  # a backward runs ahead only with slack
                    run_forward = False
                else:
                    continue
            elif backward_ready:  # planned: backward b
                run_forward = False
            elif forward_ready:  # a forward runs ahead while the plan stays under the cap
                peak = (w + 1 if m > w else w) if backward_pos < 2 * m - w else 2 * m - backward_pos
                if caps[r] - peak <= f - min(w + b + 1, m):
                    continue
                run_forward = True
            else:
                continue
            running_forward[r] = run_forward
            ends[r] = now + (forward[f] if run_forward else backward[b])
        soonest = min(ends)
        if soonest == idle:
            break
        now = soonest
        deciding = []
        while now in ends:  # every task ending now, before any rank decides
            r = ends.index(now)
            ends[r] = idle
            deciding.append(r)
            if running_forward[r]:
                done_f[r] += 1
                if r + 1 < p:
                    in_f[r + 1] = done_f[r]
                    deciding.append(r + 1)
            else:
                done_b[r] += 1
                if r > 0:
                    in_b[r - 1] = done_b[r]
                    deciding.append(r - 1)
    if done_b != [m] * p:
        raise RuntimeError("predicted_makespan: the plans deadlocked")
    return now


def in_flight_profile(order: list[Task]) -> list[int]:
    """In-flight count (forwards done, backward not done) after each prefix of `order`."""
    counts = [0]
    for task in order:
        counts.append(counts[-1] + (1 if task.kind == FORWARD else -1))
    return counts


def static_peak_in_flight(stage: StageConfig) -> int:
    return max(in_flight_profile(static_order(stage)))


def input_is_local(stage: StageConfig, task: Task) -> bool:
    """F of virtual stage 0 reads local data; B of the last virtual stage starts from the
    local loss. Every other task waits for a neighbour's message."""
    if task.kind == FORWARD:
        return stage.rank == 0 and task.chunk == 0
    return stage.rank == stage.pp_size - 1 and task.chunk == stage.num_chunks - 1


class GreedyPolicy:
    """Plan-guided greedy task choice for one pipeline rank (see the module docstring).

    `cost_model(task)`, when given, predicts a task's duration (for example from its
    token count); `estimated_duration` falls back to the mean of the durations passed to
    `complete` per kind and chunk. The rule itself does not use estimates: deviating only
    when the substitute would finish before the planned input arrives never deviated in
    the simulator, because a lower bound on that arrival is shorter than a backward.
    """

    def __init__(
        self,
        stage: StageConfig,
        cost_model: Callable[[Task], float] | None = None,
        extra_warmup: int | None = None,
        microbatch_costs: list[float] | None = None,
        microbatch_order: list[int] | None = None,
    ):
        self.stage = stage
        self._cost_model = cost_model
        chunks, m = stage.num_chunks, stage.num_microbatches
        if extra_warmup is None:
            extra_warmup = plan_extra_warmup(stage)
        if not 0 <= extra_warmup <= stage.slack:
            raise ValueError(f"extra_warmup {extra_warmup} not in [0, slack={stage.slack}]")
        if microbatch_order is None and microbatch_costs is not None:
            if len(microbatch_costs) != m:
                raise ValueError(f"{len(microbatch_costs)} microbatch costs for {m} microbatches")
            if chunks == 1 and not stage.forward_only:
                microbatch_order = choose_cost_order(
                    microbatch_costs, stage.pp_size, stage.slack)
        order = list(range(m)) if microbatch_order is None else list(microbatch_order)
        self._plan = plan_order(stage, extra_warmup, order)
        self._order = order
        self._plan_pos = {task: k for k, task in enumerate(self._plan)}
        profile = in_flight_profile(self._plan)
        # suffix maxima: the most the plan will hold in flight from position k on
        self._plan_peak_from = profile[:]
        for k in range(len(profile) - 2, -1, -1):
            self._plan_peak_from[k] = max(profile[k], self._plan_peak_from[k + 1])
        if stage.forward_only:
            self._cap = m * chunks
        else:
            static_peak = static_peak_in_flight(stage)
            self._cap = min(static_peak + stage.slack, m * chunks)
        self._done = bytearray(len(self._plan))
        self._next_pos = 0  # first plan position not done
        self._ahead_forwards = 0  # forwards done at plan positions after _next_pos
        self._next_forward = [0] * chunks
        self._next_backward = [0] * chunks
        self._in_flight = 0
        self._running: Task | None = None
        # k-th forward / backward of a chunk in the plan's microbatch order
        self._forwards = [[Task(FORWARD, c, i) for i in order] for c in range(chunks)]
        self._backwards = [[Task(BACKWARD, c, i) for i in order] for c in range(chunks)]
        last_rank = stage.pp_size - 1
        # -1 never matches a chunk: this rank has no local input of that kind
        self._local_forward_chunk = 0 if stage.rank == 0 else -1
        self._local_backward_chunk = chunks - 1 if stage.rank == last_rank else -1
        self._duration_sum = {}
        self._duration_count = {}

    @property
    def cap(self) -> int:
        return self._cap

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def finished(self) -> bool:
        return self._next_pos == len(self._plan)

    @property
    def microbatch_order(self) -> list[int]:
        return list(self._order)

    @property
    def plan(self) -> list[Task]:
        return list(self._plan)

    def input_is_local(self, task: Task) -> bool:
        return input_is_local(self.stage, task)

    def next_task(self, arrived: Callable[[Task], bool], now: float | None = None) -> Task | None:
        if self._running is not None:
            raise RuntimeError(f"next_task called while {self._running} is still running")
        if self.finished:
            return None
        planned = self._plan[self._next_pos]
        if self._ready(planned, arrived):
            return self._start(planned)
        best, best_pos = None, len(self._plan)
        forward_room = self._cap - self._plan_peak_from[self._next_pos] - self._ahead_forwards
        backward_ahead = self.stage.slack > 0 and not self.stage.forward_only
        for chunk in range(self.stage.num_chunks):
            i = self._next_backward[chunk]
            if backward_ahead and i < self._next_forward[chunk]:
                task = self._backwards[chunk][i]
                pos = self._plan_pos[task]
                if pos < best_pos and self._ready(task, arrived):
                    best, best_pos = task, pos
            i = self._next_forward[chunk]
            if forward_room > 0 and i < self.stage.num_microbatches:
                task = self._forwards[chunk][i]
                pos = self._plan_pos[task]
                if pos < best_pos and self._ready(task, arrived):
                    best, best_pos = task, pos
        if best is None:
            return None
        return self._start(best)

    def complete(self, task: Task, duration: float | None = None) -> None:
        if task != self._running:
            raise RuntimeError(f"complete({task}) but the running task is {self._running}")
        self._running = None
        chunk = task.chunk
        if task.kind == FORWARD:
            self._next_forward[chunk] += 1
            self._in_flight += 1
        else:
            self._next_backward[chunk] += 1
            self._in_flight -= 1
        if duration is not None:
            key = (task.kind, chunk)
            self._duration_sum[key] = self._duration_sum.get(key, 0.0) + duration
            self._duration_count[key] = self._duration_count.get(key, 0) + 1
        pos = self._plan_pos[task]
        self._done[pos] = 1
        if pos != self._next_pos:
            if task.kind == FORWARD:
                self._ahead_forwards += 1
            return
        plan, done = self._plan, self._done
        pos += 1
        while pos < len(plan) and done[pos]:
            if plan[pos].kind == FORWARD:
                self._ahead_forwards -= 1
            pos += 1
        self._next_pos = pos

    def estimated_duration(self, task: Task) -> float | None:
        """Predicted duration: the cost model's, else the mean measured one, else None."""
        if self._cost_model is not None:
            return self._cost_model(task)
        key = (task.kind, task.chunk)
        count = self._duration_count.get(key)
        return self._duration_sum[key] / count if count else None

    def _ready(self, task: Task, arrived: Callable[[Task], bool]) -> bool:
        if task.kind == FORWARD:
            if self._in_flight >= self._cap:
                return False
            if task.chunk == self._local_forward_chunk:
                return True
        elif task.chunk == self._local_backward_chunk:
            return True
        return arrived(task)

    def _start(self, task: Task) -> Task:
        self._running = task
        return task
