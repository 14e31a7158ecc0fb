"""Measured vs simulated bubble: replay a traced pipeline run's own forward and backward
durations in the simulator (megatron/dpp/sim/simulator.py) and compare, per iteration and
stage, the bubble the run had with the bubble the simulator predicts. A W run in parts counts
as the sum of its parts.

    python profiling/sim_compare.py runs/dpp-trace                # schedule from the header
    python profiling/sim_compare.py runs/1f1b-trace/trace.json --json
    python profiling/sim_compare.py /tmp/sim.json --schedule dpp --slack 2

The trace is a --trace directory, profiling/aggregate.py's trace.json or a simulator trace.
A DPP run's --trace directory also holds the actions each rank executed, in order
(trace-rank<R>.actions.csv): the simulator then replays exactly that order per stage (the
stage's lowest rank) instead of simulating the policy (`--actions DIR` names the files'
directory when the trace is a merged trace.json).
Bubble, makespan: profiling/report.py's definitions (1 - busy / makespan; makespan from the
iteration's first forward/backward start to its last end on any stage). Durations: the
measured span of every (virtual stage, microbatch), the mean over a stage's ranks (tensor /
data parallel), so the simulated busy time is the one report.py averages. Latency: the
median over messages of consumer start minus producer end, counting only consumers whose
rank was idle when the producer ended (it was waiting for that very input); messages
between each stage's lowest ranks, which are pipeline peers. Each iteration is simulated
with its own estimate unless --latency is given. A positive difference: the run idled
more than the simulator predicts (host overheads, send costs, clock error). The makespan's gap
to a replay with zero latency is attributed to the message hops (the replay at the measured
latency minus that at zero) and to the runtime beyond the replay (the rest). Lower bound: no
schedule of the iteration's measured tasks, at any memory and in any order, is shorter than
the busiest rank's work after its cheapest lead-in (megatron/dpp/sim/bounds.py): the run's
makespan over it is the most any schedule could gain. With one chunk a rank also the
in-order bound: no schedule that runs each stage's microbatches in the run's order and holds
on each stage at most what the run held or its slack allows (from F to W) is shorter.
"""

from __future__ import annotations

import glob
import os
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the `profiling` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron.dpp.actions import BACKWARD, FORWARD, WEIGHT, Task, read_actions  # noqa: E402
from megatron.dpp.config import DEFAULTS  # noqa: E402
from megatron.dpp.plan import StageConfig  # noqa: E402
from megatron.dpp.policy import GreedyPolicy  # noqa: E402
from megatron.dpp.sim.bounds import in_order_bound, memory_free_bound  # noqa: E402
from megatron.dpp.sim.simulator import SCHEDULES, Durations, replay, simulate  # noqa: E402
from megatron.dpp.topology import PipelineTopology  # noqa: E402
from profiling.aggregate import Span, TraceError, load_spans, load_trace  # noqa: E402
from profiling.plot_timeline import select  # noqa: E402
from profiling.report import (  # noqa: E402
    COMPUTE_KINDS,
    iteration_reports,
    peak_in_flight,
    trace_tool_parser,
    write_result,
)

TASK_KIND = {"forward": FORWARD, "backward": BACKWARD, "weight": WEIGHT}
_ACTIONS_FILE = re.compile(r"trace-rank(\d+)\.actions\.csv$")


def pipeline_shape(trace: dict, compute: list[Span]) -> tuple[int, int]:
    """(pp_size, num_chunks): from the header of a real run, else from the spans."""
    meta = trace.get("otherData", {})
    pp = meta.get("pp_size") or 1 + max(s.stage for s in compute)
    chunks = meta.get("num_chunks") or 1 + max(s.chunk or 0 for s in compute)
    return pp, chunks


def measured_durations(compute: list[Span], pp: int, chunks: int) -> Durations:
    """Durations of one iteration: each (kind, virtual stage, microbatch) averaged over the
    stage's ranks. Raises TraceError when a task is missing or unlabelled."""
    topology = PipelineTopology(pp, chunks)
    # per rank first: a W run in parts is one span per part, and the task is their sum
    per_rank: dict[tuple[str, int, int, int], float] = defaultdict(float)
    for span in compute:
        if span.microbatch is None:
            raise TraceError(f"iteration {span.iteration}: a {span.kind} on rank {span.rank} "
                             "has no microbatch label")
        v = topology.virtual_stage(span.stage, span.chunk or 0)
        per_rank[span.kind, v, span.microbatch, span.rank] += span.duration
    samples: dict[tuple[str, int, int], list[float]] = defaultdict(list)
    for (kind, v, microbatch, _), duration in per_rank.items():
        samples[kind, v, microbatch].append(duration)
    m = 1 + max(key[2] for key in samples)
    table = {}
    # W spans: a run with the split backward (its B spans are the input gradients only)
    for kind in (k for k in COMPUTE_KINDS if k != "weight" or any(s.kind == k for s in compute)):
        table[kind] = [[0.0] * m for _ in range(pp * chunks)]
        for v in range(pp * chunks):
            for i in range(m):
                values = samples.get((kind, v, i))
                if not values:
                    raise TraceError(f"iteration {compute[0].iteration}: no {kind} of "
                                     f"microbatch {i} on virtual stage {v}")
                table[kind][v][i] = sum(values) / len(values)
    return Durations(table["forward"], table["backward"], [1.0] * m, table.get("weight"))


def run_order(compute: list[Span]) -> list[int]:
    """The microbatch order the run used: its first stage's forwards by start time (DPP
    runs variable-length microbatches in cost order)."""
    forwards = [s for s in compute if s.kind == "forward" and s.stage == 0 and not s.chunk]
    rank = min(s.rank for s in forwards)  # one of the stage's tensor-parallel ranks
    return [s.microbatch for s in sorted(forwards, key=lambda s: s.start) if s.rank == rank]


def sums_in_order(compute: list[Span], pp: int, order: list[int]) -> bool:
    """Whether each stage (its lowest rank, one chunk) summed its weight gradients in
    `order`: its W spans (a W run in parts: each part after the one before), or where it ran
    each backward whole its B spans, by start time."""
    for stage in range(pp):
        spans = [s for s in compute if s.stage == stage and s.kind != "forward"]
        rank = min(s.rank for s in spans)
        kind = "weight" if any(s.kind == "weight" for s in spans) else "backward"
        ran = [s.microbatch for s in sorted(spans, key=lambda s: s.start)
               if s.rank == rank and s.kind == kind]
        if [k for n, k in enumerate(ran) if n == 0 or ran[n - 1] != k] != order:
            return False
    return True


def held_peaks(compute: list[Span], pp: int) -> list[int]:
    """Per stage (its lowest rank, one chunk): the most microbatches held at once from the
    start of their F to the end of their release (report.peak_in_flight)."""
    peaks = []
    for stage in range(pp):
        spans = [s for s in compute if s.stage == stage]
        rank = min(s.rank for s in spans)
        peaks.append(peak_in_flight([s for s in spans if s.rank == rank]))
    return peaks


def slack_caps(pp: int, m: int, slack: int) -> list[int]:
    """Per stage: the most microbatches DPP's plan at this slack may hold from F to W (each
    W after its B)."""
    return [GreedyPolicy(StageConfig(r, pp, 1, m, slack=slack, split_backward=True,
                                     defer_weights=False)).cap
            for r in range(pp)]


def estimate_latency(compute: list[Span], pp: int, chunks: int) -> tuple[float, int]:
    """(median latency, number of samples) of one iteration; (0.0, 0) with no sample."""
    lead = select(compute, None)
    topology = PipelineTopology(pp, chunks)
    ends = {(s.stage, Task(TASK_KIND[s.kind], s.chunk or 0, s.microbatch)): s.end
            for s in lead}
    gaps = []
    for stage in {s.stage for s in lead}:
        idle_since = float("-inf")  # before its first task a rank waits from the start
        for span in sorted((s for s in lead if s.stage == stage), key=lambda s: s.start):
            # the task whose output is this one's input (none: local data or loss)
            source = topology.source(stage, Task(TASK_KIND[span.kind], span.chunk or 0,
                                                 span.microbatch))
            produced = None if source is None else ends.get(source)
            if produced is not None and produced > idle_since:
                gaps.append(span.start - produced)
            idle_since = span.end
    if not gaps:
        return 0.0, 0
    # clock alignment error can make a gap negative; a latency cannot be
    return max(0.0, statistics.median(gaps)), len(gaps)


def executed_actions(directory: str) -> dict[int, dict[int, list[Task]]]:
    """iteration -> stage -> the actions that stage ran, from the trace-rank<R>.actions.csv
    files of a DPP --trace directory (a stage's lowest rank; tensor-parallel ranks run the
    same order). Empty when there are none."""
    files = {}
    for path in glob.glob(os.path.join(directory, "trace-rank*.actions.csv")):
        match = _ACTIONS_FILE.search(os.path.basename(path))
        if match:
            files[int(match.group(1))] = path
    out: dict[int, dict[int, list[Task]]] = {}
    for rank in sorted(files):
        try:
            recorded = read_actions(files[rank])
        except ValueError as error:
            raise TraceError(str(error)) from None
        for iteration, stages in recorded.items():
            if iteration is None:
                raise TraceError(f"{files[rank]}: no iteration column (not written by --trace)")
            for stage, actions in stages.items():
                out.setdefault(iteration, {}).setdefault(stage, actions)
    return out


def compare(path: str, schedule: str | None = None, slack: int | None = None,
            latency: float | None = None, actions: str | None = None) -> dict:
    """Per iteration: measured and simulated makespan and per-stage bubble, plus means.
    A DPP run with recorded actions (`actions`: their directory, default the trace
    directory) is replayed in exactly its executed order."""
    trace = load_trace(path)
    spans, iterations = load_spans(trace)
    header_schedule = trace.get("otherData", {}).get("schedule")
    schedule = schedule or header_schedule
    if schedule not in SCHEDULES:
        said = f"names {header_schedule!r}" if header_schedule else "has none (simulator trace?)"
        raise TraceError(f"{path}: which schedule? the trace header {said}; give --schedule "
                         f"({', '.join(SCHEDULES)})")
    # the run's slack from the header; traces written before it was recorded there ran
    # with the runtime's default
    slack_given = slack is not None
    if schedule != "dpp":
        slack = 0
    elif slack is None:
        recorded = trace.get("otherData", {}).get("dpp_slack")
        slack = DEFAULTS.slack if recorded is None else recorded
    if actions is None and os.path.isdir(path):
        actions = path
    executed = (executed_actions(actions)
                if actions is not None and schedule == header_schedule == "dpp" else {})
    rows = []
    for report in iteration_reports(spans, iterations):
        compute = [s for s in spans
                   if s.iteration == report["iteration"] and s.kind in COMPUTE_KINDS]
        pp, chunks = pipeline_shape(trace, compute)
        durations = measured_durations(compute, pp, chunks)
        estimated, samples = estimate_latency(compute, pp, chunks)
        used = estimated if latency is None else latency

        ran_slack, ran = slack, schedule
        if schedule == "dpp":  # the slack and rule this iteration ran (chosen at run time)
            noted = _noted_schedule(iterations, report["iteration"])
            if noted is not None:
                ran_slack = slack if slack_given else noted["dpp_slack"]
                ran = "dpp-static" if noted["dpp_static"] else "dpp"

        def run(hop_ms: float, compute=compute, durations=durations, pp=pp, chunks=chunks,
                report=report, ran=ran, ran_slack=ran_slack):
            if executed:
                return replay(_stage_plans(executed, report["iteration"], pp, actions),
                              durations, num_chunks=chunks, latency=hop_ms)
            return simulate(
                ran, pp, len(durations.microbatch_factor), durations,
                num_chunks=chunks, slack=ran_slack, latency=hop_ms,
                microbatch_order=run_order(compute) if schedule == "dpp" else None,
                split_backward=durations.weight is not None)

        try:
            result, ideal = run(used), run(0.0)
        except ValueError as error:
            raise TraceError(f"{path}: iteration {report['iteration']}: {error}") from None
        stages = [{"stage": row["stage"], "measured_bubble": row["bubble"],
                   "simulated_bubble": result.bubble[row["stage"]],
                   "difference_pp": 100.0 * (row["bubble"] - result.bubble[row["stage"]])}
                  for row in report["stages"]]
        times = durations.by_kind(split_backward=durations.weight is not None)
        bound = memory_free_bound(times, pp, len(durations.microbatch_factor),
                                  PipelineTopology(pp, chunks))
        row = {"iteration": report["iteration"], "schedule": ran, "slack": ran_slack,
               "latency_ms": used,
               "latency_samples": samples, "measured_makespan_ms": report["makespan_ms"],
               "simulated_makespan_ms": result.makespan,
               "zero_latency_makespan_ms": ideal.makespan, "lower_bound_ms": bound,
               "stages": stages}
        if chunks == 1:
            m = len(durations.microbatch_factor)
            held = [max(pair) for pair in zip(held_peaks(compute, pp),
                                              slack_caps(pp, m, ran_slack), strict=True)]
            order = run_order(compute)
            row["held"] = held
            row["in_order_bound_ms"] = in_order_bound(times, pp, m, held, order)
            if durations.weight is not None and sums_in_order(compute, pp, order):
                row["weights_in_order_bound_ms"] = in_order_bound(times, pp, m, held, order,
                                                                  weights_in_order=True)
        rows.append(row)
    if not rows:
        raise TraceError(f"{path}: no forward/backward spans")
    return {"schedule": schedule, "slack": slack, "replayed": bool(executed),
            "iterations": rows, "mean": _mean(rows)}


def _noted_schedule(iterations: dict, iteration: int) -> dict | None:
    """The DPP slack and rule the trace's iteration records say the iteration ran (None:
    a trace written before they were recorded)."""
    for (_, number), record in sorted(iterations.items()):
        if number == iteration and "dpp_slack" in record:
            return record
    return None


def _stage_plans(executed: dict, iteration: int, pp: int, directory: str) -> list[list[Task]]:
    stages = executed.get(iteration, {})
    missing = [stage for stage in range(pp) if stage not in stages]
    if missing:
        raise TraceError(f"{directory}: no recorded actions of iteration {iteration} for "
                         f"stages {missing}")
    return [stages[stage] for stage in range(pp)]


def _mean(rows: list[dict]) -> list[dict]:
    """Per stage: each number averaged over the iterations."""
    by_stage: dict[int, list[dict]] = defaultdict(list)
    for row in rows:
        for stage in row["stages"]:
            by_stage[stage["stage"]].append(stage)
    keys = ("measured_bubble", "simulated_bubble", "difference_pp")
    return [{"stage": stage, **{k: statistics.fmean(r[k] for r in runs) for k in keys}}
            for stage, runs in sorted(by_stage.items())]


def format_comparison(result: dict) -> str:
    slack = f" slack {result['slack']}" if result["schedule"] == "dpp" else ""
    replayed = ", replaying the executed actions" if result["replayed"] else ""
    lines = [f"simulated schedule: {result['schedule']}{slack}{replayed}"]
    header = "  stage  measured  simulated  difference (points)"
    for row in result["iterations"]:
        ran = (f" ({row['schedule']} slack {row['slack']})"
               if row["schedule"] != result["schedule"] or row["slack"] != result["slack"]
               else "")
        lines.append(f"iteration {row['iteration']}{ran}: makespan measured "
                     f"{row['measured_makespan_ms']:.2f} ms, simulated "
                     f"{row['simulated_makespan_ms']:.2f} ms; latency {row['latency_ms']:.3f}"
                     f" ms ({row['latency_samples']} samples)")
        hops = row["simulated_makespan_ms"] - row["zero_latency_makespan_ms"]
        rest = row["measured_makespan_ms"] - row["simulated_makespan_ms"]
        lines.append(f"  the gap to the zero-latency replay ({row['zero_latency_makespan_ms']:.2f}"
                     f" ms): message hops {hops:+.2f} ms, the runtime beyond the replay "
                     f"(host decisions, launches) {rest:+.2f} ms")
        lines.append(f"  no schedule of these tasks takes less than {row['lower_bound_ms']:.2f} ms "
                     f"(the busiest rank's work after its cheapest lead-in): the run took "
                     f"{row['measured_makespan_ms'] / row['lower_bound_ms']:.3f}x that")
        if "in_order_bound_ms" in row:
            lines.append(f"  no schedule of them in this microbatch order holding at most "
                         f"{'/'.join(map(str, row['held']))} from F to W per stage takes less "
                         f"than {row['in_order_bound_ms']:.2f} ms: the run took "
                         f"{row['measured_makespan_ms'] / row['in_order_bound_ms']:.3f}x that")
        if "weights_in_order_bound_ms" in row:
            bound = row["weights_in_order_bound_ms"]
            lines.append(f"  nor with its W tasks in that order too (its weight gradients summed "
                         f"as the run summed them) less than {bound:.2f} ms: the run took "
                         f"{row['measured_makespan_ms'] / bound:.3f}x that")
        lines.append(header)
        lines += [_stage_line(stage) for stage in row["stages"]]
    if len(result["iterations"]) > 1:
        lines.append(f"mean over {len(result['iterations'])} iterations:")
        lines.append(header)
        lines += [_stage_line(stage) for stage in result["mean"]]
    return "\n".join(lines)


def _stage_line(row: dict) -> str:
    # rounded first: a difference of -1e-17 (Python 3.12's compensated float sum) is +0.00
    difference = round(row["difference_pp"], 2) + 0.0
    return (f"  {row['stage']:5d}  {row['measured_bubble']:8.3f}  "
            f"{row['simulated_bubble']:9.3f}  {difference:+19.2f}")


def main(argv=None) -> int:
    parser = trace_tool_parser(__doc__)
    parser.add_argument("--schedule", choices=SCHEDULES, default=None,
                        help="schedule to simulate (default: the trace header's)")
    parser.add_argument("--slack", type=int, default=None,
                        help="dpp: the run's --dpp-max-inflight (default: the trace header's, "
                             f"else {DEFAULTS.slack})")
    parser.add_argument("--actions", default=None, metavar="DIR",
                        help="directory of a DPP run's trace-rank<R>.actions.csv (default: the "
                             "trace directory)")
    parser.add_argument("--latency", type=float, default=None,
                        help="message latency in ms (default: estimated per iteration)")
    args = parser.parse_args(argv)
    if args.slack is not None and args.slack < 0:
        parser.error(f"--slack must be >= 0, got {args.slack}")
    if args.latency is not None and args.latency < 0:
        parser.error(f"--latency must be >= 0, got {args.latency}")
    try:
        result = compare(args.trace, args.schedule, args.slack, args.latency, args.actions)
    except TraceError as error:
        parser.exit(2, f"{parser.prog}: {error}\n")
    return write_result(args.json, result, format_comparison(result))


if __name__ == "__main__":
    sys.exit(main())
