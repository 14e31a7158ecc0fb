"""Discrete-event simulation of pipeline schedules: static 1F1B, interleaved 1F1B, GPipe,
ZB-H1 and DPP (the GreedyPolicy of megatron.dpp.policy, the same code the runtime uses),
and replays of recorded per-rank orders.

The event loop is megatron/dpp/engine.py's: each rank runs one task at a time; a forward
of virtual stage v > 0 needs the activation of virtual stage v - 1, a backward of v < V - 1
the gradient of v + 1 (megatron/dpp/topology.py); both travel with a fixed latency. This
module adds the task durations (a cost model, see `CostModel`), the comparison grid and
the command line.

    python -m megatron.dpp.simulate --pp 8 --microbatches 32 --cv 0.5
    python -m megatron.dpp.simulate --pp 8 --microbatches 32 --split-backward --slack 0
    python -m megatron.dpp.simulate --grid
    python -m megatron.dpp.simulate --grid --split-backward

With the split backward each backward is a B (input gradient) and a W (weight gradient)
task, half of the backward's time each by default (F = B = W); the static baselines then
get the microbatch order DPP runs, so a comparison measures the schedule, not the order.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field

from megatron.dpp.actions import BACKWARD, FORWARD, WEIGHT, Task
from megatron.dpp.config import DEFAULTS
from megatron.dpp.engine import StaticReplay, run_pipeline
from megatron.dpp.plan import StageConfig, check_plans, gpipe_order, static_order
from megatron.dpp.policy import GreedyPolicy, microbatch_order_for
from megatron.dpp.topology import PipelineTopology

SCHEDULES = ("1f1b", "interleaved", "gpipe", "zb-h1", "dpp")
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
        return self.cv > 0 or self.jitter > 0


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
        whole = [[b + w for b, w in zip(bs, ws, strict=True)]
                 for bs, ws in zip(self.backward, self.weight, strict=True)]
        return {FORWARD: self.forward, BACKWARD: whole}


def sample_durations(
    cost: CostModel, pp_size: int, num_chunks: int, num_microbatches: int, seed: int,
    split_backward: bool = False,
) -> Durations:
    """Durations from the cost model; `split_backward` samples B and W apart (the backward's
    time split by `cost.weight_share`, an independent jitter on each)."""
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
    return Durations(forward, backward, factors, weight if split_backward else None)


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
    if schedule == "dpp":
        return GreedyPolicy(stage, microbatch_order=microbatch_order, costs=costs)
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
    latency: float = 0.0,
    record: bool = False,
    microbatch_costs: list[float] | None = None,
    microbatch_order: list[int] | None = None,
    split_backward: bool = False,
    weight_slices: int = DEFAULTS.weight_slices,
) -> SimResult:
    """Run one schedule to completion. `record` keeps each rank's task order and a trace.
    `microbatch_costs`: what is known of each microbatch's cost before the iteration (its
    token count; in the cost models the per-microbatch factor, not the per-task jitter).
    Only DPP uses it, to order the microbatches (policy.microbatch_order_for) and to cap
    the cost each rank holds, as the runtime caps tokens.
    `microbatch_order` runs the microbatches in this order instead (DPP: replaying a
    recorded run; static schedules: DPP's order, default 0..m-1). `split_backward`: DPP
    places B and W tasks (zb-h1 always does; the other static schedules never), each W in
    `weight_slices` parts (the static schedules run each W whole)."""
    p, m, chunks = pp_size, num_microbatches, num_chunks
    if schedule == "1f1b" and chunks != 1:
        raise ValueError("schedule 1f1b has one chunk per rank; use interleaved or dpp")
    if schedule == "zb-h1" and chunks != 1:
        raise ValueError("schedule zb-h1 has one chunk per rank")
    if schedule == "interleaved" and chunks < 2:
        raise ValueError("schedule interleaved needs num_chunks >= 2")
    _check_durations(durations, p, chunks, m)
    split = schedule in SPLIT_SCHEDULES or (schedule == "dpp" and split_backward)
    topology = PipelineTopology(p, chunks)
    slices = weight_slices if schedule == "dpp" and split else 1
    stages = [StageConfig(r, p, chunks, m, slack=slack, split_backward=split,
                          weight_slices=slices) for r in range(p)]
    if schedule == "dpp" and microbatch_order is None:
        microbatch_order = microbatch_order_for(stages[0], microbatch_costs)
    runners = [_runner(schedule, s, topology, microbatch_order, microbatch_costs)
               for s in stages]
    return _result(schedule, run_pipeline(topology, runners, durations.by_kind(split), latency,
                                          record, weight_slices=slices), slices)


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
) -> dict[str, SimResult]:
    """Simulate several schedules on the same sampled durations. Single-chunk schedules
    (1f1b, gpipe, zb-h1) run the rank's work as one chunk; interleaved and dpp use
    num_chunks. With `split_backward` DPP places W tasks, zb-h1 runs (it is skipped
    otherwise), and every static schedule runs the microbatches in DPP's order."""
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
                                               split_backward)
        dpp = schedule == "dpp"
        results[schedule] = simulate(
            schedule,
            pp_size,
            num_microbatches,
            samples[chunks],
            num_chunks=chunks,
            slack=slack if dpp else 0,
            latency=cost.latency,
            record=record,
            microbatch_costs=samples[chunks].microbatch_factor if known_costs else None,
            microbatch_order=None if dpp else static_order_given,
            split_backward=split_backward and dpp,
            weight_slices=weight_slices,
        )
    return results


GRID_PP = (2, 4, 8, 16, 32, 64)
GRID_SLACKS = (0, 2)


# the acceptance grid's cost models; GRID_EXTRA_MODELS run only when named (--grid-models)
GRID_MODELS = ("uniform", "cv 0.5", "jitter 0.3", "slow stage 1.3x")
GRID_EXTRA_MODELS = ("cv 0.5 + jitter 0.3",)


def grid_cost_models(pp_size: int, names: tuple[str, ...] = GRID_MODELS) -> dict[str, CostModel]:
    models = {
        "uniform": CostModel(),
        "cv 0.5": CostModel(cv=0.5),
        "jitter 0.3": CostModel(jitter=0.3),
        "slow stage 1.3x": CostModel(slow_stage=pp_size // 2, slow_factor=1.3),
        # DPP knows the per-microbatch factor, not the jitter on top of it
        "cv 0.5 + jitter 0.3": CostModel(cv=0.5, jitter=0.3),
    }
    unknown = [name for name in names if name not in models]
    if unknown:
        raise ValueError(f"unknown grid cost models {unknown}; choose from {list(models)}")
    return {name: models[name] for name in names}


def _grid_unit(args):
    pp_size, model_name, seed, slacks, known_costs = args
    cost = grid_cost_models(pp_size, (model_name,))[model_name]
    m = 4 * pp_size
    durations = sample_durations(cost, pp_size, 1, m, seed)
    static = simulate("1f1b", pp_size, m, durations)
    out = {"pp": pp_size, "model": model_name, "seed": seed, "1f1b": _summary(static)}
    for slack in slacks:
        costs = durations.microbatch_factor if known_costs else None
        out[f"dpp+{slack}"] = _summary(
            simulate("dpp", pp_size, m, durations, slack=slack, microbatch_costs=costs))
    return out


def _summary(result: SimResult) -> dict:
    return {
        "makespan": result.makespan,
        "mean_bubble": result.mean_bubble,
        "peak_in_flight": max(result.peak_in_flight),
    }


def _split_grid_unit(args):
    """One (p, cost model, seed) of the split-backward grid: per slack, DPP with W tasks,
    and 1F1B and ZB-H1 fed DPP's microbatch order."""
    pp_size, model_name, seed, slacks, known_costs, weight_slices = args
    cost = grid_cost_models(pp_size, (model_name,))[model_name]
    m = 4 * pp_size
    durations = sample_durations(cost, pp_size, 1, m, seed, split_backward=True)
    costs = durations.microbatch_factor if known_costs else None
    out = {"pp": pp_size, "model": model_name, "seed": seed}
    for slack in slacks:
        stage = StageConfig(0, pp_size, 1, m, slack=slack, split_backward=True)
        order = microbatch_order_for(stage, costs)
        runs = {name: simulate(name, pp_size, m, durations, microbatch_order=order)
                for name in ("1f1b", "zb-h1")}
        runs["dpp"] = simulate("dpp", pp_size, m, durations, slack=slack,
                               microbatch_costs=costs, microbatch_order=order,
                               split_backward=True, weight_slices=weight_slices)
        out[slack] = {name: _split_summary(result, runs["1f1b"])
                      for name, result in runs.items()}
    return out


def _split_summary(result: SimResult, one_f_one_b: SimResult) -> dict:
    return {
        "makespan": result.makespan,
        "mean_bubble": result.mean_bubble,
        # microbatches held from F to W (to B for 1F1B), the most on any rank
        "peak_in_flight": max(result.peak_in_flight),
        # from F to B, the most any rank holds beyond what it holds in 1F1B
        "activations_over_1f1b": max(
            ours - theirs for ours, theirs in zip(result.peak_activations,
                                                  one_f_one_b.peak_activations, strict=True)),
    }


def run_grid(
    pps,
    slacks,
    seeds: int,
    jobs: int,
    known_costs: bool = True,
    seed_offset: int = 0,
    models: tuple[str, ...] = GRID_MODELS,
    split_backward: bool = False,
    weight_slices: int = DEFAULTS.weight_slices,
) -> list[dict]:
    """Every (p, cost model, seed) of the acceptance grid; one row per (p, model, slack).
    known_costs: DPP knows each microbatch's cost factor in advance (not the jitter).
    Random models run seeds seed_offset .. seed_offset + seeds - 1 (held-out seeds: an
    offset past the grid's 10); a deterministic model runs once. `split_backward`: DPP
    with W tasks (each in `weight_slices` parts) against 1F1B and ZB-H1 fed its microbatch
    order (`format_split_grid`)."""
    models = tuple(models)
    units = [
        (p, name, seed_offset + seed, tuple(slacks), known_costs)
        for p in sorted(pps, reverse=True)  # biggest first: better load balance
        for name, cost in grid_cost_models(p, models).items()
        for seed in range(seeds if cost.is_random else 1)
    ]
    if split_backward:
        unit = _split_grid_unit
        units = [u + (weight_slices,) for u in units]
    else:
        unit = _grid_unit
    if jobs > 1:
        import multiprocessing

        with multiprocessing.get_context("fork").Pool(jobs) as pool:
            outputs = pool.map(unit, units, chunksize=1)
    else:
        outputs = [unit(u) for u in units]
    rows = []
    for p in sorted(pps):
        for name in grid_cost_models(p, models):
            cell = [o for o in outputs if o["pp"] == p and o["model"] == name]
            for slack in slacks:
                if split_backward:
                    rows.append(_split_row(p, name, slack, [o[slack] for o in cell]))
                    continue
                ratios = [o["1f1b"]["makespan"] / o[f"dpp+{slack}"]["makespan"] for o in cell]
                rows.append(
                    {
                        "pp": p,
                        "microbatches": 4 * p,
                        "model": name,
                        "slack": slack,
                        "seeds": len(cell),
                        "ratio_mean": sum(ratios) / len(ratios),
                        "ratio_min": min(ratios),
                        "bubble_1f1b": _mean(o["1f1b"]["mean_bubble"] for o in cell),
                        "bubble_dpp": _mean(o[f"dpp+{slack}"]["mean_bubble"] for o in cell),
                        "peak_1f1b": max(o["1f1b"]["peak_in_flight"] for o in cell),
                        "peak_dpp": max(o[f"dpp+{slack}"]["peak_in_flight"] for o in cell),
                    }
                )
    return rows


def _split_row(p: int, model: str, slack: int, runs: list[dict]) -> dict:
    row = {"pp": p, "microbatches": 4 * p, "model": model, "slack": slack, "seeds": len(runs)}
    for base in ("1f1b", "zb-h1"):
        ratios = [run[base]["makespan"] / run["dpp"]["makespan"] for run in runs]
        row[f"ratio_{base}_mean"] = _mean(ratios)
        row[f"ratio_{base}_min"] = min(ratios)
    for name in ("1f1b", "zb-h1", "dpp"):
        row[f"bubble_{name}"] = _mean(run[name]["mean_bubble"] for run in runs)
        row[f"peak_{name}"] = max(run[name]["peak_in_flight"] for run in runs)
        row[f"activations_over_1f1b_{name}"] = max(run[name]["activations_over_1f1b"]
                                                   for run in runs)
    return row


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def format_grid(rows: list[dict]) -> str:
    lines = [
        "| p | m | cost model | slack | DPP / 1F1B mean | min | bubble 1F1B | bubble DPP "
        "| peak in-flight 1F1B | peak in-flight DPP |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['pp']} | {row['microbatches']} | {row['model']} | +{row['slack']} "
            f"| {row['ratio_mean']:.3f}x | {row['ratio_min']:.3f}x "
            f"| {row['bubble_1f1b']:.3f} | {row['bubble_dpp']:.3f} "
            f"| {row['peak_1f1b']} | {row['peak_dpp']} |"
        )
    # "variance cells": every non-uniform cost model (cv, jitter, slow stage); the random
    # ones alone (cv, jitter) are reported too
    variance = [r for r in rows if r["model"] != "uniform" and r["pp"] <= 8]
    every_model = GRID_MODELS + GRID_EXTRA_MODELS
    random_models = {
        name for name, cost in grid_cost_models(2, every_model).items() if cost.is_random
    }
    for slack in sorted({r["slack"] for r in rows}):
        cells = [r["ratio_mean"] for r in variance if r["slack"] == slack]
        if cells:
            lines.append(
                f"\nslack +{slack}: mean DPP / 1F1B over variance cells with p <= 8: "
                f"{_mean(cells):.3f}x"
            )
        cells = [
            r["ratio_mean"]
            for r in variance
            if r["slack"] == slack and r["model"] in random_models
        ]
        if cells:
            lines.append(
                f"slack +{slack}: mean over the random cells (cv, jitter) with p <= 8: "
                f"{_mean(cells):.3f}x"
            )
        worst = min(r["ratio_mean"] for r in rows if r["slack"] == slack)
        lines.append(f"slack +{slack}: worst cell mean {worst:.3f}x")
    return "\n".join(lines)


def format_split_grid(rows: list[dict]) -> str:
    """The split-backward grid: DPP (with W tasks) against 1F1B and ZB-H1, both fed DPP's
    microbatch order; memory as the most any rank holds from F to W, and the most any
    rank holds from F to B beyond its 1F1B count."""
    lines = [
        "| p | m | cost model | slack | DPP / 1F1B mean | min | DPP / ZB-H1 mean | min "
        "| bubble ZB-H1 | bubble DPP | F-to-W peak 1F1B / ZB-H1 / DPP "
        "| F-to-B over 1F1B ZB-H1 / DPP |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['pp']} | {row['microbatches']} | {row['model']} | +{row['slack']} "
            f"| {row['ratio_1f1b_mean']:.3f}x | {row['ratio_1f1b_min']:.3f}x "
            f"| {row['ratio_zb-h1_mean']:.3f}x | {row['ratio_zb-h1_min']:.3f}x "
            f"| {row['bubble_zb-h1']:.3f} | {row['bubble_dpp']:.3f} "
            f"| {row['peak_1f1b']} / {row['peak_zb-h1']} / {row['peak_dpp']} "
            f"| +{row['activations_over_1f1b_zb-h1']} / +{row['activations_over_1f1b_dpp']} |"
        )
    variance = [r for r in rows if r["model"] != "uniform" and r["pp"] <= 8]
    for slack in sorted({r["slack"] for r in rows}):
        cells = [r for r in variance if r["slack"] == slack]
        if cells:
            lines.append(
                f"\nslack +{slack}: mean over variance cells with p <= 8: DPP / ZB-H1 "
                f"{_mean(r['ratio_zb-h1_mean'] for r in cells):.3f}x, DPP / 1F1B "
                f"{_mean(r['ratio_1f1b_mean'] for r in cells):.3f}x")
        same = [r for r in rows if r["slack"] == slack]
        lines.append(f"slack +{slack}: worst cell mean DPP / 1F1B "
                     f"{min(r['ratio_1f1b_mean'] for r in same):.3f}x, worst single run "
                     f"{min(r['ratio_1f1b_min'] for r in same):.3f}x; DPP / ZB-H1 worst cell "
                     f"mean {min(r['ratio_zb-h1_mean'] for r in same):.3f}x")
    return "\n".join(lines)


def _single_report(args, cost: CostModel) -> dict:
    results = compare(
        args.pp,
        args.microbatches,
        cost,
        num_chunks=args.chunks,
        slack=args.slack,
        seed=args.seed,
        schedules=tuple(args.schedules),
        record=bool(args.trace),
        known_costs=not args.costs_unknown,
        split_backward=args.split_backward,
        weight_slices=args.weight_slices,
    )
    report = {"config": {**vars(args), "cost": asdict(cost)}, "schedules": {}}
    for name, result in results.items():
        entry = {
            "makespan": result.makespan,
            "bubble_per_stage": result.bubble,
            "mean_bubble": result.mean_bubble,
            "peak_in_flight_per_stage": result.peak_in_flight,
            "peak_activations_per_stage": result.peak_activations,
        }
        for base in ("1f1b", "interleaved", "zb-h1"):
            if base in results and base != name:
                entry[f"speedup_vs_{base}"] = results[base].makespan / result.makespan
        report["schedules"][name] = entry
    if args.trace:
        name = args.trace_schedule if args.trace_schedule in results else "dpp"
        if name not in results:
            raise SystemExit(f"--trace: schedule {name!r} was not simulated")
        write_trace(args.trace, results[name])
    return report


def _format_single(report: dict) -> str:
    lines = []
    for name, entry in report["schedules"].items():
        ratios = ", ".join(
            f"{key.removeprefix('speedup_vs_')} {value:.3f}x"
            for key, value in entry.items()
            if key.startswith("speedup_vs_")
        )
        lines.append(
            f"{name:12s} makespan {entry['makespan']:10.2f}  mean bubble "
            f"{entry['mean_bubble']:.3f}  peak in-flight {max(entry['peak_in_flight_per_stage'])}"
            f"  speedup: {ratios}"
        )
        lines.append(
            "             bubble per stage: "
            + " ".join(f"{b:.2f}" for b in entry["bubble_per_stage"])
        )
        held, activations = entry["peak_in_flight_per_stage"], entry["peak_activations_per_stage"]
        lines.append("             peak in flight per stage: " + " ".join(map(str, held))
                     + ("" if held == activations else
                        " (F to W; F to B: " + " ".join(map(str, activations)) + ")"))
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m megatron.dpp.simulate", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--pp", type=int, default=4, help="pipeline stages")
    parser.add_argument("--microbatches", type=int, default=16)
    parser.add_argument("--chunks", type=int, default=1, help="virtual chunks per rank")
    parser.add_argument("--slack", type=int, default=2, help="DPP extra in-flight microbatches")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cv", type=float, default=0.0, help="per-microbatch cost CV")
    parser.add_argument("--jitter", type=float, default=0.0, help="per-task cost CV")
    parser.add_argument("--slow-stage", type=int, default=None)
    parser.add_argument("--slow-factor", type=float, default=1.0)
    parser.add_argument("--latency", type=float, default=0.0, help="message latency")
    parser.add_argument("--backward-ratio", type=float, default=2.0)
    parser.add_argument("--split-backward", action="store_true",
                        help="B and W tasks: DPP places W, zb-h1 runs, the static schedules "
                             "get DPP's microbatch order")
    parser.add_argument("--weight-share", type=float, default=0.5,
                        help="with --split-backward: W's share of the backward's time")
    parser.add_argument("--weight-slices", type=int, default=DEFAULTS.weight_slices,
                        help="with --split-backward: DPP runs each W in this many parts")
    parser.add_argument(
        "--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES, metavar="NAME"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.add_argument("--trace", metavar="FILE", help="write a Chrome trace JSON")
    parser.add_argument("--trace-schedule", default="dpp", choices=SCHEDULES)
    parser.add_argument("--grid", action="store_true", help="run the acceptance grid")
    parser.add_argument("--grid-pp", type=int, nargs="+", default=list(GRID_PP))
    parser.add_argument("--grid-slacks", type=int, nargs="+", default=list(GRID_SLACKS))
    parser.add_argument("--seeds", type=int, default=10, help="grid: seeds per random cell")
    parser.add_argument("--seed-offset", type=int, default=0,
                        help="grid: first seed (e.g. 100 for seeds the grid never ran)")
    parser.add_argument("--grid-models", nargs="+", default=list(GRID_MODELS),
                        choices=list(GRID_MODELS + GRID_EXTRA_MODELS), metavar="MODEL",
                        help="grid: cost models, by name (quote names with spaces)")
    parser.add_argument("--jobs", type=int, default=2, help="grid: worker processes")
    parser.add_argument("--costs-unknown", action="store_true",
                        help="DPP does not know the microbatches' costs before the iteration "
                             "(they run in the natural order)")
    return parser


def _check_args(parser, args):
    positive = ("pp", "microbatches", "chunks", "seeds", "jobs", "weight_slices")
    for name in positive:
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.slack < 0 or any(s < 0 for s in args.grid_slacks):
        parser.error("slack must be >= 0")
    if args.seed_offset < 0:
        parser.error(f"--seed-offset must be >= 0, got {args.seed_offset}")
    if any(p < 1 for p in args.grid_pp):
        parser.error(f"--grid-pp values must be >= 1, got {args.grid_pp}")


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    _check_args(parser, args)
    if args.grid:
        started = time.perf_counter()
        rows = run_grid(args.grid_pp, args.grid_slacks, args.seeds, args.jobs,
                        not args.costs_unknown, args.seed_offset, tuple(args.grid_models),
                        args.split_backward, args.weight_slices)
        elapsed = time.perf_counter() - started
        if args.json:
            json.dump({"rows": rows, "seconds": elapsed}, sys.stdout, indent=1)
            sys.stdout.write("\n")
        else:
            table = format_split_grid(rows) if args.split_backward else format_grid(rows)
            sys.stdout.write(table + f"\n\ngrid took {elapsed:.1f} s\n")
        return 0
    try:
        cost = CostModel(
            backward_ratio=args.backward_ratio,
            cv=args.cv,
            jitter=args.jitter,
            slow_stage=args.slow_stage,
            slow_factor=args.slow_factor,
            latency=args.latency,
            weight_share=args.weight_share,
        )
        report = _single_report(args, cost)
    except ValueError as error:
        parser.error(str(error))
    if args.json:
        json.dump(report, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(_format_single(report) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
