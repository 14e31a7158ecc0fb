"""Discrete-event simulation of pipeline schedules: static 1F1B, interleaved 1F1B, GPipe,
ZB-H1 and DPP (the GreedyPolicy of megatron.dpp.policy, the same code the runtime uses),
and replays of recorded per-rank orders.

The event loop is megatron/dpp/engine.py's: each rank runs one task at a time; a forward
of virtual stage v > 0 needs the activation of virtual stage v - 1, a backward of v < V - 1
the gradient of v + 1 (megatron/dpp/topology.py); both travel with a fixed latency. This
module adds the task durations (a cost model, see `CostModel`), runs schedules and recorded
orders on them, and writes their traces; megatron/dpp/sim/simulate_grid.py is the comparison
grid, megatron/dpp/sim/simulate.py the command line.

With the split backward each backward is a B (input gradient) and a W (weight gradient)
task, half of the backward's time each by default (F = B = W); the static baselines then
get the microbatch order DPP runs, so a comparison measures the schedule, not the order.

A link profile and a straggler profile (megatron/dpp/variability.py) add the delays an
emulating runtime draws, from the same seed and with the same draws: a message's time on a
slow edge and the straggling tasks (the cost model's `forward` then sets the unit: e.g. a
forward's milliseconds, since the link's delays are in ms). "dpp-static" is DPP's plan with
the same extra warm-up run in order, the static schedule on DPP's runtime.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from megatron.dpp.actions import BACKWARD, FORWARD, WEIGHT, Task
from megatron.dpp.config import DEFAULTS
from megatron.dpp.engine import StaticReplay, run_pipeline
from megatron.dpp.plan import StageConfig, check_plans, gpipe_order, static_order
from megatron.dpp.policy import GreedyPolicy, microbatch_order_for
from megatron.dpp.topology import PipelineTopology
from megatron.dpp.variability import LinkProfile, StragglerProfile

SCHEDULES = ("1f1b", "interleaved", "gpipe", "zb-h1", "dpp", "dpp-static")
# the schedules that run the DPP policy (the slack and the split apply to them)
DPP_SCHEDULES = ("dpp", "dpp-static")
# the schedules that run the backward as B and W tasks
SPLIT_SCHEDULES = ("zb-h1",)


@dataclass(frozen=True)
class CostModel:
    """Task durations, in units of one stage's mean forward time.

    cv: lognormal per-microbatch cost factor with this coefficient of variation, the same
        factor on every stage (a long sequence is long everywhere).
    jitter: independent lognormal factor per task with this coefficient of variation.
    slow_stage / slow_factor: one rank runs slow_factor times slower.
    latency: time from a task's end to its output's arrival at the neighbour.
    weight_share: with the split backward, the share of a backward's time in W (the rest
        is B), each with its own jitter.
    link: a slow link on some edges, its delays in the unit of `forward` (ms when forward
        is a forward's milliseconds); message_bytes: each message's size, for its bandwidth.
    straggler: straggling tasks, drawn from the comparison's seed and iteration.
    A chunk of a rank with num_chunks chunks costs 1 / num_chunks of the rank's work.
    """

    forward: float = 1.0
    backward_ratio: float = 2.0
    cv: float = 0.0
    jitter: float = 0.0
    slow_stage: int | None = None
    slow_factor: float = 1.0
    latency: float = 0.0
    weight_share: float = 0.5
    link: LinkProfile | None = None
    message_bytes: int = 0
    straggler: StragglerProfile | None = None

    def __post_init__(self):
        for name in ("forward", "backward_ratio", "slow_factor"):
            if getattr(self, name) <= 0:
                raise ValueError(f"CostModel: {name} must be > 0, got {getattr(self, name)}")
        for name in ("cv", "jitter", "latency"):
            if getattr(self, name) < 0:
                raise ValueError(f"CostModel: {name} must be >= 0, got {getattr(self, name)}")
        if not 0 < self.weight_share < 1:
            raise ValueError(f"CostModel: weight_share must be in (0, 1), got "
                             f"{self.weight_share}")

    @property
    def is_random(self) -> bool:
        return (self.cv > 0 or self.jitter > 0 or self.straggler is not None
                or (self.link is not None and self.link.jitter_ms > 0))


def _lognormal_sampler(rng: random.Random, cv: float):
    """Mean-one lognormal draws with the given coefficient of variation."""
    if cv == 0:
        return lambda: 1.0
    sigma = math.sqrt(math.log1p(cv * cv))
    mu = -0.5 * sigma * sigma
    return lambda: rng.lognormvariate(mu, sigma)


@dataclass
class Durations:
    """forward[v][i], backward[v][i]: duration of microbatch i on virtual stage v. With
    `weight` (sampled for the split backward), backward is B's time and weight W's."""

    forward: list[list[float]]
    backward: list[list[float]]
    microbatch_factor: list[float]
    weight: list[list[float]] | None = None
    # kind -> [virtual stage][microbatch]: the part of each duration a straggler adds,
    # which a CPU rank sleeps (None: no stragglers); only shared cores tell it apart
    stretch: dict[str, list[list[float]]] | None = None

    def by_kind(self, split_backward: bool = False) -> dict[str, list[list[float]]]:
        """The engine's view: task kind -> [virtual stage][microbatch]; without the split,
        a backward takes B's time plus W's."""
        if split_backward:
            if self.weight is None:
                raise ValueError("the split backward needs durations sampled with "
                                 "split_backward=True (W times)")
            return {FORWARD: self.forward, BACKWARD: self.backward, WEIGHT: self.weight}
        if self.weight is None:
            return {FORWARD: self.forward, BACKWARD: self.backward}
        return {FORWARD: self.forward, BACKWARD: _sum_rows(self.backward, self.weight)}

    def stretch_by_kind(self, split_backward: bool = False) -> dict | None:
        """`stretch` as `by_kind` gives the durations (None without stragglers)."""
        if self.stretch is None or split_backward or WEIGHT not in self.stretch:
            return self.stretch
        return {FORWARD: self.stretch[FORWARD],
                BACKWARD: _sum_rows(self.stretch[BACKWARD], self.stretch[WEIGHT])}


def _sum_rows(first: list[list[float]], second: list[list[float]]) -> list[list[float]]:
    return [[a + b for a, b in zip(xs, ys, strict=True)]
            for xs, ys in zip(first, second, strict=True)]


def sample_durations(
    cost: CostModel, pp_size: int, num_chunks: int, num_microbatches: int, seed: int,
    split_backward: bool = False, iteration: int = 0,
) -> Durations:
    """Durations from the cost model; `split_backward` samples B and W apart (the backward's
    time split by `cost.weight_share`, an independent jitter on each). The cost model's
    stragglers stretch the tasks they hit (drawn per seed, iteration, microbatch, the
    task's pipeline stage, local chunk and kind: variability.py, the runtime's draws)."""
    if cost.slow_stage is not None and not 0 <= cost.slow_stage < pp_size:
        raise ValueError(f"CostModel: slow_stage {cost.slow_stage} not in [0, {pp_size})")
    rng = random.Random(seed)
    per_microbatch = _lognormal_sampler(rng, cost.cv)
    factors = [per_microbatch() for _ in range(num_microbatches)]
    jitter = _lognormal_sampler(rng, cost.jitter)
    topology = PipelineTopology(pp_size, num_chunks)
    forward, backward, weight = [], [], []
    for v in range(topology.num_virtual_stages):
        base = cost.forward / num_chunks
        if topology.placement(v)[0] == cost.slow_stage:
            base *= cost.slow_factor
        forward.append([base * f * jitter() for f in factors])
        if not split_backward:
            backward.append([base * cost.backward_ratio * f * jitter() for f in factors])
            continue
        share = cost.weight_share
        backward.append([base * cost.backward_ratio * (1 - share) * f * jitter()
                         for f in factors])
        weight.append([base * cost.backward_ratio * share * f * jitter() for f in factors])
    stretch = None
    if cost.straggler is not None:
        tables = {FORWARD: forward, BACKWARD: backward}
        if split_backward:
            tables[WEIGHT] = weight
        stretch = {}
        for kind, table in tables.items():
            stretch[kind] = []
            for v, row in enumerate(table):
                stage, chunk = topology.placement(v)
                added = [0.0] * num_microbatches
                for i in range(num_microbatches):
                    factor = cost.straggler.factor_of(seed, iteration, i, stage, kind, chunk)
                    added[i] = row[i] * (factor - 1)
                    row[i] += added[i]
                stretch[kind].append(added)
    return Durations(forward, backward, factors, weight if split_backward else None, stretch)


def link_latency(link: LinkProfile, pp_size: int, seed: int, iteration: int = 0,
                 message_bytes: int = 0, base: float = 0.0):
    """The engine's latency function for this link: `base` on every edge plus the link's
    time on the edges it affects."""

    def latency(src: int, dst: int, task: Task) -> float:
        if not link.affects(src, dst, pp_size):
            return base
        return base + link.hop_ms(seed, iteration, src, dst, task[0], task[1], task[2],
                                  message_bytes)

    return latency


@dataclass
class SimResult:
    schedule: str
    makespan: float
    bubble: list[float]  # per rank: idle fraction of the makespan
    peak_in_flight: list[int]  # per rank, from F to the release (W with the split, else B)
    peak_activations: list[int]  # per rank, from F to B
    orders: list[list[Task]] | None = field(default=None, repr=False)
    trace: list[dict] | None = field(default=None, repr=False)

    @property
    def mean_bubble(self) -> float:
        return sum(self.bubble) / len(self.bubble)


def _runner(schedule: str, stage: StageConfig, topology: PipelineTopology,
            microbatch_order: list[int] | None, costs: list[float] | None = None):
    if schedule in DPP_SCHEDULES:
        return GreedyPolicy(stage, microbatch_order=microbatch_order, costs=costs,
                            static=schedule == "dpp-static")
    if schedule == "gpipe":
        return StaticReplay(stage.rank, topology, gpipe_order(stage))
    if schedule in ("1f1b", "interleaved", "zb-h1"):
        return StaticReplay(stage.rank, topology, static_order(stage, microbatch_order))
    raise ValueError(f"unknown schedule {schedule!r}; choose from {', '.join(SCHEDULES)}")


def simulate(
    schedule: str,
    pp_size: int,
    num_microbatches: int,
    durations: Durations,
    *,
    num_chunks: int = 1,
    slack: int = 0,
    latency: float | Callable[[int, int, Task], float] = 0.0,
    record: bool = False,
    microbatch_costs: list[float] | None = None,
    microbatch_order: list[int] | None = None,
    split_backward: bool = False,
    weight_slices: int = DEFAULTS.weight_slices,
    defer_weights: bool = DEFAULTS.defer_weights,
    cores: float | None = None,
    weights_by_backward: bool = False,
) -> SimResult:
    """Run one schedule to completion. `record` keeps each rank's task order and a trace.
    `microbatch_costs`: what is known of each microbatch's cost before the iteration (its
    token count; in the cost models the per-microbatch factor, not the per-task jitter).
    Only DPP uses it, to order the microbatches (policy.microbatch_order_for) and to cap
    the cost each rank holds, as the runtime caps tokens.
    `microbatch_order` runs the microbatches in this order instead (DPP: replaying a
    recorded run; static schedules: DPP's order, default 0..m-1). `split_backward`: DPP
    places B and W tasks (zb-h1 always does; the other static schedules never), each W in
    `weight_slices` parts (the static schedules run each W whole), deferred as ZB-H1 defers
    them with `defer_weights` (zb-h1 always), else each right after its B. `latency`: a
    number, or a function of the edge and the message (`link_latency`). `cores`: the ranks
    share this many processors (megatron/dpp/engine.py; default one a rank).
    `weights_by_backward`: DPP runs its pending W tasks shortest B first (StageConfig)."""
    p, m, chunks = pp_size, num_microbatches, num_chunks
    if schedule == "1f1b" and chunks != 1:
        raise ValueError("schedule 1f1b has one chunk per rank; use interleaved or dpp")
    if schedule == "zb-h1" and chunks != 1:
        raise ValueError("schedule zb-h1 has one chunk per rank")
    if schedule == "interleaved" and chunks < 2:
        raise ValueError("schedule interleaved needs num_chunks >= 2")
    _check_durations(durations, p, chunks, m)
    dpp = schedule in DPP_SCHEDULES
    split = schedule in SPLIT_SCHEDULES or (dpp and split_backward)
    topology = PipelineTopology(p, chunks)
    slices = weight_slices if dpp and split else 1
    defer = defer_weights or not dpp
    stages = [StageConfig(r, p, chunks, m, slack=slack, split_backward=split,
                          defer_weights=defer, weight_slices=slices,
                          weights_by_backward=weights_by_backward and dpp and split)
              for r in range(p)]
    if dpp and microbatch_order is None:
        microbatch_order = microbatch_order_for(stages[0], microbatch_costs)
    runners = [_runner(schedule, s, topology, microbatch_order, microbatch_costs)
               for s in stages]
    return _result(schedule, run_pipeline(
        topology, runners, durations.by_kind(split), latency, record, weight_slices=slices,
        cores=cores, waits=durations.stretch_by_kind(split)), slices)


def replay(plans: list[list[Task]], durations: Durations, *, num_chunks: int = 1,
           latency: float = 0.0, record: bool = False) -> SimResult:
    """Run exactly these per-rank orders (e.g. what a traced run executed, read from its
    actions CSV files), each task once its inputs are here. The plans are checked first
    (megatron.dpp.plan.check_plans: complete, deadlock-free)."""
    p, m = len(plans), len(durations.microbatch_factor)
    _check_durations(durations, p, num_chunks, m)
    topology = PipelineTopology(p, num_chunks)
    check_plans(plans, topology, m)
    split = any(task.kind == WEIGHT for plan in plans for task in plan)
    runners = [StaticReplay(r, topology, plan) for r, plan in enumerate(plans)]
    return _result("replay", run_pipeline(topology, runners, durations.by_kind(split), latency,
                                          record))


def _check_durations(durations: Durations, p: int, chunks: int, m: int) -> None:
    if len(durations.forward) != p * chunks or len(durations.forward[0]) != m:
        raise ValueError("durations do not match pp_size * num_chunks x num_microbatches")


def _result(schedule: str, run, weight_slices: int = 1) -> SimResult:
    """The engine's result; a W run in parts is one task of the orders, at its last part
    (the orders stay plans `replay` can run), and one trace event per part."""
    makespan = run.makespan
    bubble = [1.0 - b / makespan for b in run.busy]
    orders = trace = None
    if run.timeline is not None:
        orders = [[] for _ in run.busy]
        trace = []
        parts: dict[tuple[int, Task], int] = {}
        for rank, task, start, duration in run.timeline:
            trace.append(_trace_event(rank, task, start, duration))
            if task.kind == WEIGHT and weight_slices > 1:
                parts[rank, task] = parts.get((rank, task), 0) + 1
                if parts[rank, task] < weight_slices:
                    continue
            orders[rank].append(task)
    return SimResult(schedule, makespan, bubble, run.peak_in_flight, run.peak_activations,
                     orders, trace)


CATEGORIES = {FORWARD: "forward", BACKWARD: "backward", WEIGHT: "weight"}


def _trace_event(rank: int, task: Task, start: float, duration: float) -> dict:
    return {
        "name": f"{task.kind}{task.microbatch}c{task.chunk}",
        "cat": CATEGORIES[task.kind],
        "ph": "X",
        "pid": 0,
        "tid": rank,
        "ts": start * 1000.0,
        "dur": duration * 1000.0,
        "args": {
            "stage": rank,
            "chunk": task.chunk,
            "microbatch": task.microbatch,
            "kind": task.kind,
        },
    }


def write_trace(path: str, result: SimResult) -> None:
    """Chrome trace JSON (chrome://tracing, Perfetto): one event per task, one row per
    stage, 1 ms per unit of simulated time."""
    if result.trace is None:
        raise ValueError("write_trace needs a result simulated with record=True")
    with open(path, "w") as f:
        json.dump({"traceEvents": result.trace, "displayTimeUnit": "ms"}, f)


def compare(
    pp_size: int,
    num_microbatches: int,
    cost: CostModel,
    *,
    num_chunks: int = 1,
    slack: int = 0,
    seed: int = 0,
    schedules: tuple[str, ...] = SCHEDULES,
    record: bool = False,
    known_costs: bool = True,
    split_backward: bool = False,
    weight_slices: int = DEFAULTS.weight_slices,
    defer_weights: bool = DEFAULTS.defer_weights,
    iteration: int = 0,
    cores: float | None = None,
    weights_by_backward: bool = False,
) -> dict[str, SimResult]:
    """Simulate several schedules on the same sampled durations and the same link. Single-
    chunk schedules (1f1b, gpipe, zb-h1) run the rank's work as one chunk; interleaved, dpp
    and dpp-static use num_chunks. With `split_backward` DPP places W tasks, zb-h1 runs (it
    is skipped otherwise), and every static schedule runs the microbatches in DPP's order.
    The cost model's link and stragglers are drawn from `seed` and `iteration`; `cores`:
    the ranks share this many processors (`simulate`)."""
    results = {}
    samples = {}
    static_order_given = None
    if split_backward and known_costs:
        dpp_stage = StageConfig(0, pp_size, num_chunks, num_microbatches, slack=slack,
                                split_backward=True)
        factors = sample_durations(cost, pp_size, num_chunks, num_microbatches, seed,
                                   True).microbatch_factor
        static_order_given = microbatch_order_for(dpp_stage, factors)
    for schedule in schedules:
        chunks = 1 if schedule in ("1f1b", "gpipe", "zb-h1") else num_chunks
        if (schedule == "interleaved" and chunks < 2) or (
                schedule in SPLIT_SCHEDULES and not split_backward):
            continue
        if chunks not in samples:
            samples[chunks] = sample_durations(cost, pp_size, chunks, num_microbatches, seed,
                                               split_backward, iteration)
        dpp = schedule in DPP_SCHEDULES
        latency = cost.latency
        if cost.link is not None:
            latency = link_latency(cost.link, pp_size, seed, iteration, cost.message_bytes,
                                   cost.latency)
        results[schedule] = simulate(
            schedule,
            pp_size,
            num_microbatches,
            samples[chunks],
            num_chunks=chunks,
            slack=slack if dpp else 0,
            latency=latency,
            record=record,
            microbatch_costs=samples[chunks].microbatch_factor if known_costs else None,
            microbatch_order=None if dpp else static_order_given,
            split_backward=split_backward and dpp,
            weight_slices=weight_slices,
            defer_weights=defer_weights,
            cores=cores,
            weights_by_backward=weights_by_backward,
        )
    return results
