"""Discrete-event simulation of pipeline schedules: static 1F1B, interleaved 1F1B, GPipe
and DPP (the GreedyPolicy of megatron.dpp.policy, the same code the runtime uses), and
replays of recorded per-rank orders.

The event loop is megatron/dpp/engine.py's: each rank runs one task at a time; a forward
of virtual stage v > 0 needs the activation of virtual stage v - 1, a backward of v < V - 1
the gradient of v + 1 (megatron/dpp/topology.py); both travel with a fixed latency. This
module adds the task durations (a cost model, see `CostModel`), the comparison grid and
the command line.

    python -m megatron.dpp.simulate --pp 8 --microbatches 32 --cv 0.5
    python -m megatron.dpp.simulate --grid
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field

from megatron.dpp.actions import BACKWARD, FORWARD, Task
from megatron.dpp.engine import StaticReplay, run_pipeline
from megatron.dpp.plan import StageConfig, check_plans, gpipe_order, static_order
from megatron.dpp.policy import GreedyPolicy, microbatch_order_for
from megatron.dpp.topology import PipelineTopology

SCHEDULES = ("1f1b", "interleaved", "gpipe", "dpp")


@dataclass(frozen=True)
class CostModel:
    """Task durations, in units of one stage's mean forward time.

    cv: lognormal per-microbatch cost factor with this coefficient of variation, the same
        factor on every stage (a long sequence is long everywhere).
    jitter: independent lognormal factor per task with this coefficient of variation.
    slow_stage / slow_factor: one rank runs slow_factor times slower.
    latency: time from a task's end to its output's arrival at the neighbour.
    A chunk of a rank with num_chunks chunks costs 1 / num_chunks of the rank's work.
    """

    forward: float = 1.0
    backward_ratio: float = 2.0
    cv: float = 0.0
    jitter: float = 0.0
    slow_stage: int | None = None
    slow_factor: float = 1.0
    latency: float = 0.0

    def __post_init__(self):
        for name in ("forward", "backward_ratio", "slow_factor"):
            if getattr(self, name) <= 0:
                raise ValueError(f"CostModel: {name} must be > 0, got {getattr(self, name)}")
        for name in ("cv", "jitter", "latency"):
            if getattr(self, name) < 0:
                raise ValueError(f"CostModel: {name} must be >= 0, got {getattr(self, name)}")

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
    """forward[v][i], backward[v][i]: duration of microbatch i on virtual stage v."""

    forward: list[list[float]]
    backward: list[list[float]]
    microbatch_factor: list[float]

    def by_kind(self) -> dict[str, list[list[float]]]:
        """The engine's view: task kind -> [virtual stage][microbatch]."""
        return {FORWARD: self.forward, BACKWARD: self.backward}


def sample_durations(
    cost: CostModel, pp_size: int, num_chunks: int, num_microbatches: int, seed: int
) -> Durations:
    if cost.slow_stage is not None and not 0 <= cost.slow_stage < pp_size:
        raise ValueError(f"CostModel: slow_stage {cost.slow_stage} not in [0, {pp_size})")
    rng = random.Random(seed)
    per_microbatch = _lognormal_sampler(rng, cost.cv)
    factors = [per_microbatch() for _ in range(num_microbatches)]
    jitter = _lognormal_sampler(rng, cost.jitter)
    topology = PipelineTopology(pp_size, num_chunks)
    forward, backward = [], []
    for v in range(topology.num_virtual_stages):
        base = cost.forward / num_chunks
        if topology.placement(v)[0] == cost.slow_stage:
            base *= cost.slow_factor
        forward.append([base * f * jitter() for f in factors])
        backward.append([base * cost.backward_ratio * f * jitter() for f in factors])
    return Durations(forward, backward, factors)


@dataclass
class SimResult:
    schedule: str
    makespan: float
    bubble: list[float]  # per rank: idle fraction of the makespan
    peak_in_flight: list[int]  # per rank
    orders: list[list[Task]] | None = field(default=None, repr=False)
    trace: list[dict] | None = field(default=None, repr=False)

    @property
    def mean_bubble(self) -> float:
        return sum(self.bubble) / len(self.bubble)


def _runner(schedule: str, stage: StageConfig, topology: PipelineTopology,
            microbatch_order: list[int] | None):
    if schedule == "dpp":
        return GreedyPolicy(stage, microbatch_order=microbatch_order)
    if schedule == "gpipe":
        return StaticReplay(stage.rank, topology, gpipe_order(stage))
    if schedule in ("1f1b", "interleaved"):
        return StaticReplay(stage.rank, topology, static_order(stage))
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
) -> SimResult:
    """Run one schedule to completion. `record` keeps each rank's task order and a trace.
    `microbatch_costs`: what is known of each microbatch's cost before the iteration (its
    token count; in the cost models the per-microbatch factor, not the per-task jitter).
    Only DPP uses it, to order the microbatches (policy.microbatch_order_for); the static
    schedules keep megatron's order 0..m-1. `microbatch_order` gives DPP's order directly
    (replaying a recorded run)."""
    p, m, chunks = pp_size, num_microbatches, num_chunks
    if schedule == "1f1b" and chunks != 1:
        raise ValueError("schedule 1f1b has one chunk per rank; use interleaved or dpp")
    if schedule == "interleaved" and chunks < 2:
        raise ValueError("schedule interleaved needs num_chunks >= 2")
    _check_durations(durations, p, chunks, m)
    topology = PipelineTopology(p, chunks)
    stages = [StageConfig(r, p, chunks, m, slack=slack) for r in range(p)]
    if schedule == "dpp" and microbatch_order is None:
        microbatch_order = microbatch_order_for(stages[0], microbatch_costs)
    runners = [_runner(schedule, s, topology, microbatch_order) for s in stages]
    return _result(schedule, run_pipeline(topology, runners, durations.by_kind(), latency,
                                          record))


def replay(plans: list[list[Task]], durations: Durations, *, num_chunks: int = 1,
           latency: float = 0.0, record: bool = False) -> SimResult:
    """Run exactly these per-rank orders (e.g. what a traced run executed, read from its
    actions CSV files), each task once its inputs are here. The plans are checked first
    (megatron.dpp.plan.check_plans: complete, deadlock-free)."""
    p, m = len(plans), len(durations.microbatch_factor)
    _check_durations(durations, p, num_chunks, m)
    topology = PipelineTopology(p, num_chunks)
    check_plans(plans, topology, m)
    runners = [StaticReplay(r, topology, plan) for r, plan in enumerate(plans)]
    return _result("replay", run_pipeline(topology, runners, durations.by_kind(), latency,
                                          record))


def _check_durations(durations: Durations, p: int, chunks: int, m: int) -> None:
    if len(durations.forward) != p * chunks or len(durations.forward[0]) != m:
        raise ValueError("durations do not match pp_size * num_chunks x num_microbatches")


def _result(schedule: str, run) -> SimResult:
    makespan = run.makespan
    bubble = [1.0 - b / makespan for b in run.busy]
    orders = trace = None
    if run.timeline is not None:
        orders = [[] for _ in run.busy]
        trace = []
        for rank, task, start, duration in run.timeline:
            orders[rank].append(task)
            trace.append(_trace_event(rank, task, start, duration))
    return SimResult(schedule, makespan, bubble, run.peak_in_flight, orders, trace)


def _trace_event(rank: int, task: Task, start: float, duration: float) -> dict:
    return {
        "name": f"{task.kind}{task.microbatch}c{task.chunk}",
        "cat": "backward" if task.kind == BACKWARD else "forward",
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
) -> dict[str, SimResult]:
    """Simulate several schedules on the same sampled durations. Single-chunk schedules
    (1f1b, gpipe) run the rank's work as one chunk; interleaved and dpp use num_chunks."""
    results = {}
    samples = {}
    for schedule in schedules:
        chunks = 1 if schedule in ("1f1b", "gpipe") else num_chunks
        if schedule == "interleaved" and chunks < 2:
            continue
        if chunks not in samples:
            samples[chunks] = sample_durations(cost, pp_size, chunks, num_microbatches, seed)
        results[schedule] = simulate(
            schedule,
            pp_size,
            num_microbatches,
            samples[chunks],
            num_chunks=chunks,
            slack=slack if schedule == "dpp" else 0,
            latency=cost.latency,
            record=record,
            microbatch_costs=samples[chunks].microbatch_factor if known_costs else None,
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


def run_grid(
    pps,
    slacks,
    seeds: int,
    jobs: int,
    known_costs: bool = True,
    seed_offset: int = 0,
    models: tuple[str, ...] = GRID_MODELS,
) -> list[dict]:
    """Every (p, cost model, seed) of the acceptance grid; one row per (p, model, slack).
    known_costs: DPP knows each microbatch's cost factor in advance (not the jitter).
    Random models run seeds seed_offset .. seed_offset + seeds - 1 (held-out seeds: an
    offset past the grid's 10); a deterministic model runs once."""
    models = tuple(models)
    units = [
        (p, name, seed_offset + seed, tuple(slacks), known_costs)
        for p in sorted(pps, reverse=True)  # biggest first: better load balance
        for name, cost in grid_cost_models(p, models).items()
        for seed in range(seeds if cost.is_random else 1)
    ]
    if jobs > 1:
        import multiprocessing

        with multiprocessing.get_context("fork").Pool(jobs) as pool:
            outputs = pool.map(_grid_unit, units, chunksize=1)
    else:
        outputs = [_grid_unit(u) for u in units]
    rows = []
    for p in sorted(pps):
        for name in grid_cost_models(p, models):
            cell = [o for o in outputs if o["pp"] == p and o["model"] == name]
            for slack in slacks:
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
    )
    report = {"config": {**vars(args), "cost": asdict(cost)}, "schedules": {}}
    for name, result in results.items():
        entry = {
            "makespan": result.makespan,
            "bubble_per_stage": result.bubble,
            "mean_bubble": result.mean_bubble,
            "peak_in_flight_per_stage": result.peak_in_flight,
        }
        for base in ("1f1b", "interleaved"):
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
    positive = ("pp", "microbatches", "chunks", "seeds", "jobs")
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
                        not args.costs_unknown, args.seed_offset, tuple(args.grid_models))
        elapsed = time.perf_counter() - started
        if args.json:
            json.dump({"rows": rows, "seconds": elapsed}, sys.stdout, indent=1)
            sys.stdout.write("\n")
        else:
            sys.stdout.write(format_grid(rows) + f"\n\ngrid took {elapsed:.1f} s\n")
        return 0
    try:
        cost = CostModel(
            backward_ratio=args.backward_ratio,
            cv=args.cv,
            jitter=args.jitter,
            slow_stage=args.slow_stage,
            slow_factor=args.slow_factor,
            latency=args.latency,
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
