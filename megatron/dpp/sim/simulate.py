"""The simulator's command line (megatron/dpp/sim/simulator.py: the cost models, schedules and
replays; megatron/dpp/sim/simulate_grid.py: the comparison grid).

    python -m megatron.dpp.sim.simulate --pp 8 --microbatches 32 --cv 0.5
    python -m megatron.dpp.sim.simulate --pp 8 --microbatches 32 --split-backward --slack 0
    python -m megatron.dpp.sim.simulate --grid
    python -m megatron.dpp.sim.simulate --grid --split-backward
    python -m megatron.dpp.sim.simulate --forward-ms 10 --emulate-link-ms 30 \
        --emulate-link-edges all --schedules 1f1b dpp dpp-static
    python -m megatron.dpp.sim.simulate --forward-ms 10 --emulate-straggler all:0.1:3 \
        --iterations 20 --schedules 1f1b dpp-static dpp
    python -m megatron.dpp.sim.simulate --forward-ms 5 --emulate-straggler all:0.1:3 \
        --cores 2 --schedules 1f1b dpp-static dpp
    python -m megatron.dpp.sim.simulate --forward-ms 10 --emulate-straggler all:0.1:3 \
        --split-backward --slack 2 --schedules 1f1b dpp-static dpp --exact 60

The --emulate-* flags are the trainer's: the same link and straggler draws for the same
--seed (megatron/dpp/variability.py); with them every time is in milliseconds. --cores N
models N processors shared by all ranks (CPU processes on a small host: the task times are
then each task's own compute time, a straggler's added time a sleep that takes no core).
--exact (OR-tools, installed apart) solves for the shortest schedule that keeps each stage's
F, B and W tasks in the microbatch order at each row's memory, knowing every task time.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict

from megatron.dpp.actions import FORWARD
from megatron.dpp.config import DEFAULTS
from megatron.dpp.sim.bounds import (
    in_order_bound,
    memory_free_bound,
    shared_cores_bound,
    sums_in_order,
)
from megatron.dpp.sim.exact import ExactResult, shortest_in_order
from megatron.dpp.sim.simulate_grid import (
    GRID_EXTRA_MODELS,
    GRID_MODELS,
    GRID_PP,
    GRID_SLACKS,
    format_grid,
    format_split_grid,
    run_grid,
)
from megatron.dpp.sim.simulator import (
    SCHEDULES,
    CostModel,
    compare,
    sample_durations,
    write_trace,
)
from megatron.dpp.variability import LinkProfile, StragglerProfile


def _single_report(args, cost: CostModel) -> dict:
    """Each schedule's result; over several --iterations the mean makespan (the speedups
    divide means) and the last iteration's other figures; and the mean lower bound on any
    schedule of the same tasks (megatron/dpp/sim/bounds.py), one chunk a rank; with one chunk
    also each schedule's mean in-order bound at the microbatches it held, and where it summed
    its weight gradients in that order in every iteration, the bound for such schedules."""
    makespans: dict[str, list[float]] = {}
    in_order: dict[str, list[float]] = {}
    weights_in_order: dict[str, list[float]] = {}
    exact: dict[str, list[ExactResult]] = {}
    bounds = []
    for iteration in range(args.iteration, args.iteration + args.iterations):
        durations = sample_durations(cost, args.pp, 1, args.microbatches, args.seed,
                                     args.split_backward, iteration)
        times = durations.by_kind(args.split_backward)
        bound = memory_free_bound(times, args.pp, args.microbatches)
        if args.cores is not None:
            bound = max(bound, shared_cores_bound(
                times, durations.stretch_by_kind(args.split_backward), args.cores))
        bounds.append(bound)
        results = compare(
            args.pp,
            args.microbatches,
            cost,
            num_chunks=args.chunks,
            slack=args.slack,
            seed=args.seed,
            schedules=tuple(args.schedules),
            record=bool(args.trace) or args.chunks == 1,
            known_costs=not args.costs_unknown,
            split_backward=args.split_backward,
            weight_slices=args.weight_slices,
            defer_weights=args.defer_weights,
            weights_by_backward=args.weights_by_backward,
            iteration=iteration,
            cores=args.cores,
        )
        for name, result in results.items():
            makespans.setdefault(name, []).append(result.makespan)
            if args.chunks == 1:
                order = [task.microbatch for task in result.orders[0] if task.kind == FORWARD]
                in_order.setdefault(name, []).append(in_order_bound(
                    times, args.pp, args.microbatches, result.peak_in_flight, order))
                if args.split_backward and sums_in_order(result.orders, order):
                    weights_in_order.setdefault(name, []).append(in_order_bound(
                        times, args.pp, args.microbatches, result.peak_in_flight, order,
                        weights_in_order=True))
                    if args.exact is not None:
                        exact.setdefault(name, []).append(shortest_in_order(
                            times, args.pp, args.microbatches, result.peak_in_flight, order,
                            args.exact))
    mean = {name: sum(values) / len(values) for name, values in makespans.items()}
    report = {"config": {**vars(args), "cost": _plain(asdict(cost))}, "schedules": {},
              "lower_bound": sum(bounds) / len(bounds)}
    for name, result in results.items():
        entry = {
            "makespan": mean[name],
            "bubble_per_stage": result.bubble,
            "mean_bubble": result.mean_bubble,
            "peak_in_flight_per_stage": result.peak_in_flight,
            "peak_activations_per_stage": result.peak_activations,
        }
        if name in in_order:
            entry["in_order_bound"] = sum(in_order[name]) / len(in_order[name])
        if len(weights_in_order.get(name, ())) == args.iterations:
            entry["weights_in_order_bound"] = (sum(weights_in_order[name])
                                               / len(weights_in_order[name]))
            if name in exact:
                entry["exact_in_order"] = sum(r.makespan for r in exact[name]) / len(exact[name])
                entry["exact_proven"] = sum(r.proven for r in exact[name])
        for base in ("1f1b", "interleaved", "zb-h1", "dpp-static"):
            if base in results and base != name:
                entry[f"speedup_vs_{base}"] = mean[base] / mean[name]
        report["schedules"][name] = entry
    if args.trace:
        name = args.trace_schedule if args.trace_schedule in results else "dpp"
        if name not in results:
            raise SystemExit(f"--trace: schedule {name!r} was not simulated")
        write_trace(args.trace, results[name])
    return report


def _plain(value):
    """JSON-ready: the straggler's stage set as a sorted list."""
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, frozenset):
        return sorted(value)
    return value


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
    bound = report["lower_bound"]
    shared = report["config"]["cores"]
    lines.append(f"no schedule of these tasks, at any memory, takes less than {bound:.2f} (the "
                 "busiest rank's work after its cheapest lead-in"
                 + (f", or all ranks' compute over {shared} cores" if shared else "")
                 + "); each over it: "
                 + ", ".join(f"{name} {entry['makespan'] / bound:.3f}x"
                             for name, entry in report["schedules"].items()))
    for key, said in (
            ("in_order_bound", "no schedule that runs each stage's forwards and backwards in "
             "the same microbatch order and holds what the row held from F to W on each stage"),
            ("weights_in_order_bound", "no such schedule that runs each stage's W tasks in "
             "that order too (as the trainer does where it cannot time a B: on GPUs)")):
        bounded = {name: entry for name, entry in report["schedules"].items() if key in entry}
        if bounded:
            lines.append(f"{said} takes less than: " + ", ".join(
                f"{name} {entry[key]:.2f} (it took {entry['makespan'] / entry[key]:.3f}x)"
                for name, entry in bounded.items()))
    solved = {name: entry for name, entry in report["schedules"].items()
              if "exact_in_order" in entry}
    if solved:
        iterations = report["config"]["iterations"]

        def unproven(entry):
            proven = entry["exact_proven"]
            return "" if proven == iterations else (f"; the best found, proven shortest in "
                                                    f"{proven} of {iterations} iterations")

        lines.append("the shortest of them at the row's memory, knowing every task time "
                     "(CP-SAT): " + ", ".join(
                         f"{name} {entry['exact_in_order']:.2f} (it took "
                         f"{entry['makespan'] / entry['exact_in_order']:.3f}x{unproven(entry)})"
                         for name, entry in solved.items()))
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m megatron.dpp.sim.simulate",
        description="Simulate pipeline schedules (1F1B, interleaved 1F1B, GPipe, ZB-H1, DPP) on "
                    "sampled task durations, or run the comparison grid (--grid)."
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
    parser.add_argument("--latency", type=float, default=0.0,
                        help="message latency on every edge, in forwards (or ms with "
                             "--forward-ms)")
    parser.add_argument("--forward-ms", type=float, default=None,
                        help="a forward's time in ms: every time is then in ms (the default "
                             "10 with --emulate-*)")
    parser.add_argument("--emulate-link-ms", metavar="D[,J]",
                        help="a message on an emulated edge is usable D ms (+ U(0, J) ms) "
                             "after it was sent")
    parser.add_argument("--emulate-link-gbps", type=float, default=None,
                        help="with --emulate-link-ms: add message bytes / this (GB/s)")
    parser.add_argument("--emulate-link-edges", choices=("pods", "all"), default="pods",
                        help="the emulated edges: between the two pods (halves of the "
                             "pipeline) or all")
    parser.add_argument("--message-bytes", type=int, default=0,
                        help="each message's size, for --emulate-link-gbps")
    parser.add_argument("--emulate-straggler", metavar="STAGES:PROB:FACTOR",
                        help="with probability PROB a task on STAGES (all, or numbers joined "
                             "by commas) takes FACTOR times as long")
    parser.add_argument("--iteration", type=int, default=0,
                        help="the training iteration whose link and straggler draws to use (the "
                             "trainer counts its iterations from 1)")
    parser.add_argument("--iterations", type=int, default=1,
                        help="simulate this many iterations from --iteration on (each with its "
                             "own draws) and report the mean makespan of each schedule")
    parser.add_argument("--cores", type=int, default=None,
                        help="the ranks share this many processors (default: one a rank); a "
                             "straggler's added time then takes none")
    parser.add_argument("--backward-ratio", type=float, default=2.0)
    parser.add_argument("--split-backward", action="store_true",
                        help="B and W tasks: DPP places W, zb-h1 runs, the static schedules "
                             "get DPP's microbatch order")
    parser.add_argument("--weight-share", type=float, default=0.5,
                        help="with --split-backward: W's share of the backward's time")
    parser.add_argument("--weight-slices", type=int, default=DEFAULTS.weight_slices,
                        help="with --split-backward: DPP runs each W in this many parts")
    parser.add_argument("--defer-weights", action=argparse.BooleanOptionalAction,
                        default=DEFAULTS.defer_weights,
                        help="with --split-backward: DPP defers each W as ZB-H1 does (every "
                             "stage holds up to stage 0's microbatches from F to W) instead "
                             "of running it after its B (each stage holds its 1F1B count)")
    parser.add_argument("--weights-by-backward", action="store_true",
                        help="with --split-backward: DPP's rule runs, of its pending W tasks, "
                             "the one whose B was shortest first (as the trainer does on CPU, "
                             "where the host times each B; on GPUs it keeps them in "
                             "microbatch order)")
    parser.add_argument("--exact", type=float, metavar="SECONDS",
                        help="with --split-backward: also the shortest schedule, knowing every "
                             "task time, that keeps each stage's F, B and W tasks in the "
                             "microbatch order at each row's memory (OR-tools' CP-SAT, "
                             "installed apart; SECONDS a solve)")
    parser.add_argument(
        "--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES, metavar="NAME"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.add_argument("--trace", metavar="FILE", help="write a Chrome trace JSON")
    parser.add_argument("--trace-schedule", default="dpp", choices=SCHEDULES)
    parser.add_argument("--grid", action="store_true", help="run the comparison grid")
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
    positive = ("pp", "microbatches", "chunks", "seeds", "jobs", "weight_slices", "iterations")
    for name in positive:
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.slack < 0 or any(s < 0 for s in args.grid_slacks):
        parser.error("slack must be >= 0")
    if args.seed_offset < 0:
        parser.error(f"--seed-offset must be >= 0, got {args.seed_offset}")
    if any(p < 1 for p in args.grid_pp):
        parser.error(f"--grid-pp values must be >= 1, got {args.grid_pp}")
    if args.cores is not None and args.cores < 1:
        parser.error(f"--cores must be >= 1, got {args.cores}")
    if args.cores is not None and args.grid:
        parser.error("--grid gives each rank a processor: drop --cores")
    if args.weights_by_backward and (args.grid or not args.split_backward):
        parser.error("--weights-by-backward orders W tasks: it needs --split-backward and "
                     "no --grid")
    if args.exact is not None:
        if args.exact <= 0:
            parser.error(f"--exact must be > 0 seconds, got {args.exact}")
        if (args.grid or not args.split_backward or args.chunks != 1 or args.cores is not None
                or args.latency or args.emulate_link_ms is not None):
            parser.error("--exact schedules one chunk a rank with the split backward, a "
                         "processor a rank and no message time: it needs --split-backward "
                         "and no --grid, --chunks, --cores, --latency or --emulate-link-ms")
        try:
            import ortools  # noqa: F401
        except ImportError:
            parser.error("--exact needs OR-tools (pip install ortools; not a requirement of "
                         "this project)")
    if args.forward_ms is not None and args.forward_ms <= 0:
        parser.error(f"--forward-ms must be > 0, got {args.forward_ms}")
    if args.message_bytes < 0 or args.iteration < 0:
        parser.error("--message-bytes and --iteration must be >= 0")
    if args.emulate_link_gbps is not None and args.emulate_link_ms is None:
        parser.error("--emulate-link-gbps needs --emulate-link-ms (use 0 for no delay)")
    if args.grid and (args.emulate_link_ms or args.emulate_straggler):
        parser.error("--grid runs its own cost models: drop --emulate-*")


def _cost_model(args) -> CostModel:
    """The cost model of the flags; with --emulate-* (or --forward-ms) in milliseconds."""
    link = straggler = None
    if args.emulate_link_ms is not None:
        link = LinkProfile.parse(args.emulate_link_ms, args.emulate_link_gbps,
                                 args.emulate_link_edges)
    if args.emulate_straggler is not None:
        straggler = StragglerProfile.parse(args.emulate_straggler)
    forward = args.forward_ms
    if forward is None:
        forward = 10.0 if link or straggler else 1.0
    return CostModel(forward=forward, link=link, straggler=straggler,
                     message_bytes=args.message_bytes,
                     **{name: getattr(args, name) for name in (
                         "backward_ratio", "cv", "jitter", "slow_stage", "slow_factor",
                         "latency", "weight_share")})


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    _check_args(parser, args)
    if args.grid:
        started = time.perf_counter()
        rows = run_grid(args.grid_pp, args.grid_slacks, args.seeds, args.jobs,
                        not args.costs_unknown, args.seed_offset, tuple(args.grid_models),
                        args.split_backward, args.weight_slices, args.defer_weights)
        elapsed = time.perf_counter() - started
        if args.json:
            json.dump({"rows": rows, "seconds": elapsed}, sys.stdout, indent=1)
            sys.stdout.write("\n")
        else:
            table = format_split_grid(rows) if args.split_backward else format_grid(rows)
            sys.stdout.write(table + f"\n\ngrid took {elapsed:.1f} s\n")
        return 0
    try:
        cost = _cost_model(args)
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
