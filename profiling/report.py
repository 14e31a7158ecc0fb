"""Bubble report of a traced or simulated pipeline run: per iteration and stage, busy time,
bubble fraction, receive-wait time, peak in-flight microbatches, peak memory, and the
iteration's first forward against the median forward (a first forward that waits for the
host, reading the iteration's data say, stands out). With --costs, each stage's task times
over all iterations instead (a W run in parts counts as one task, the sum of its parts) and
the simulator's cost flags fitted to their 10th percentiles and to their medians.

    python profiling/report.py traces                 # a --trace directory
    python profiling/report.py traces/trace.json      # profiling/aggregate.py's output
    python profiling/report.py /tmp/dpp.json --json   # python -m megatron.dpp.sim.simulate --trace
    python profiling/report.py traces --costs

Definitions are the simulator's (megatron/dpp/sim/simulator.py), so simulated and measured
runs compare directly: the iteration's makespan runs from its first forward/backward start
to its last end on any stage; busy = the stage's forward + backward time; bubble =
1 - busy / makespan; in-flight = forwards started minus backwards finished. A stage with
several ranks (tensor / data parallel) reports their mean (busy, bubble, wait) or maximum
(in-flight, memory). Times in ms (simulated traces: one time unit = 1 ms).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the `profiling` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron.dpp.slack_choice import quantile  # noqa: E402
from profiling.aggregate import Span, TraceError, load_spans, load_trace  # noqa: E402

COMPUTE_KINDS = ("forward", "backward", "weight")


def peak_in_flight(spans: list[Span]) -> int:
    """Most microbatches whose forward has started and backward (with the split backward:
    W, whose last part ends it when DPP runs it in parts) not finished; at equal times a
    finish counts before a start (the simulator's order)."""
    release = "weight" if any(s.kind == "weight" for s in spans) else "backward"
    released: dict[tuple, float] = {}
    for span in spans:
        if span.kind == release:
            key = (span.chunk, span.microbatch)
            released[key] = max(released.get(key, span.end), span.end)
    changes = [(s.start, 1) for s in spans if s.kind == "forward"]
    changes += [(end, -1) for end in released.values()]
    count = peak = 0
    # rounded to the nanosecond: a simulated task starts exactly when its input's producer
    # ends, which the trace's microsecond floats may put a hair apart
    for _, delta in sorted((round(time, 6), delta) for time, delta in changes):
        count += delta
        peak = max(peak, count)
    return peak


def iteration_reports(spans: list[Span], iterations: dict) -> list[dict]:
    """One dict per iteration: makespan, mean bubble, and per-stage rows."""
    by_iteration: dict[int, list[Span]] = defaultdict(list)
    for span in spans:
        by_iteration[span.iteration].append(span)
    reports = []
    for iteration in sorted(by_iteration):
        its = by_iteration[iteration]
        compute = [s for s in its if s.kind in COMPUTE_KINDS]
        if not compute:
            continue
        start = min(s.start for s in compute)
        makespan = max(s.end for s in compute) - start
        per_rank: dict[int, list[Span]] = defaultdict(list)
        for span in its:
            per_rank[span.rank].append(span)
        stage_rows: dict[int, list[dict]] = defaultdict(list)
        for rank, rank_spans in per_rank.items():
            busy = sum(s.duration for s in rank_spans if s.kind in COMPUTE_KINDS)
            memory = iterations.get((rank, iteration), {}).get("peak_memory_bytes")
            forwards = sorted((s for s in rank_spans if s.kind == "forward"),
                              key=lambda s: s.start)
            stage_rows[rank_spans[0].stage].append({
                "busy_ms": busy,
                "first_forward_ms": forwards[0].duration if forwards else 0.0,
                "median_forward_ms": (statistics.median(s.duration for s in forwards)
                                      if forwards else 0.0),
                "bubble": 1.0 - busy / makespan if makespan > 0 else 0.0,
                "recv_wait_ms": sum(s.duration for s in rank_spans if s.kind == "recv_wait"),
                "peak_in_flight": peak_in_flight(rank_spans),
                "peak_memory_mb": None if memory is None else memory / 2**20,
            })
        stages = [_stage_row(stage, rows) for stage, rows in sorted(stage_rows.items())]
        reports.append({
            "iteration": iteration,
            "makespan_ms": makespan,
            "mean_bubble": sum(r["bubble"] for r in stages) / len(stages),
            "stages": stages,
        })
    return reports


def _stage_row(stage: int, rows: list[dict]) -> dict:
    def mean(key):
        return sum(r[key] for r in rows) / len(rows)

    memories = [r["peak_memory_mb"] for r in rows if r["peak_memory_mb"] is not None]
    return {
        "stage": stage,
        "ranks": len(rows),
        "busy_ms": mean("busy_ms"),
        "bubble": mean("bubble"),
        "recv_wait_ms": mean("recv_wait_ms"),
        "first_forward_ms": mean("first_forward_ms"),
        "median_forward_ms": mean("median_forward_ms"),
        "peak_in_flight": max(r["peak_in_flight"] for r in rows),
        "peak_memory_mb": max(memories) if memories else None,
    }


def format_reports(reports: list[dict]) -> str:
    lines = []
    for report in reports:
        lines.append(f"iteration {report['iteration']}: makespan {report['makespan_ms']:.2f} ms"
                     f"  mean bubble {report['mean_bubble']:.3f}")
        lines.append("  stage  ranks   busy ms  bubble  recv-wait ms  peak in-flight  peak MB"
                     "  first F ms  median F ms")
        for row in report["stages"]:
            memory = "-" if row["peak_memory_mb"] is None else f"{row['peak_memory_mb']:.1f}"
            lines.append(f"  {row['stage']:5d}  {row['ranks']:5d}  {row['busy_ms']:8.2f}  "
                         f"{row['bubble']:6.3f}  {row['recv_wait_ms']:12.2f}  "
                         f"{row['peak_in_flight']:14d}  {memory:>7s}  "
                         f"{row['first_forward_ms']:10.2f}  {row['median_forward_ms']:11.2f}")
    if len(reports) > 1:
        mean = sum(r["mean_bubble"] for r in reports) / len(reports)
        lines.append(f"mean bubble over {len(reports)} iterations: {mean:.3f}")
    return "\n".join(lines)


def report_of(path: str) -> list[dict]:
    return iteration_reports(*load_spans(load_trace(path)))


# the quantiles --costs fits the simulator's flags to
COST_QUANTILES = {"10th percentile": 0.1, "median": 0.5}
# a stage whose work is this much above the others' median is the model's slow stage
SLOW_STAGE_MIN_FACTOR = 1.05


def task_costs(spans: list[Span]) -> dict[int, dict[str, list[float]]]:
    """Per stage and task kind, every task's time (ms) over all iterations and the stage's
    ranks; a W run in parts is one task, the sum of its parts."""
    totals: dict[tuple, float] = defaultdict(float)
    for span in spans:
        if span.kind in COMPUTE_KINDS:
            key = (span.stage, span.kind, span.rank, span.iteration, span.chunk, span.microbatch)
            totals[key] += span.duration
    costs: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for (stage, kind, *_), duration in totals.items():
        costs[stage][kind].append(duration)
    return costs


def cost_flags(costs: dict[int, dict[str, list[float]]], share: float) -> str:
    """The simulator's cost model (`python -m megatron.dpp.sim.simulate`) fitted to each
    stage's `share` quantile of its F, B and W times: the forward, B + W over F and W's
    share of B + W are the medians over the stages; the stage with the most work is the
    slow stage where it does 5 % more than the others' median."""
    split = all("weight" in kinds for kinds in costs.values())
    stage = {s: {kind: quantile(times, share) for kind, times in kinds.items()}
             for s, kinds in costs.items()}
    work = {s: sum(times.values()) for s, times in stage.items()}
    slow = max(work, key=work.get)
    others = [s for s in stage if s != slow] or [slow]
    factor = work[slow] / statistics.median(work[s] for s in others)
    if factor < SLOW_STAGE_MIN_FACTOR:
        others = list(stage)

    def backward(s: int) -> float:
        return stage[s]["backward"] + (stage[s]["weight"] if split else 0.0)

    flags = [f"--forward-ms {statistics.median(stage[s]['forward'] for s in others):.2f}",
             f"--backward-ratio "
             f"{statistics.median(backward(s) / stage[s]['forward'] for s in others):.2f}"]
    if split:
        flags += ["--split-backward", "--weight-share "
                  f"{statistics.median(stage[s]['weight'] / backward(s) for s in others):.2f}"]
    if factor >= SLOW_STAGE_MIN_FACTOR:
        flags += [f"--slow-stage {slow}", f"--slow-factor {factor:.2f}"]
    return " ".join(flags)


def format_costs(costs: dict[int, dict[str, list[float]]]) -> str:
    kinds = [k for k in COMPUTE_KINDS if any(k in stage for stage in costs.values())]
    lines = ["task times, ms (10th percentile / median / 90th percentile; a W in parts: "
             "their sum)", "  stage  " + "".join(f"{kind:>24s}" for kind in kinds)]
    for stage in sorted(costs):
        cells = ["/".join(f"{quantile(costs[stage][kind], q):.2f}" for q in (0.1, 0.5, 0.9))
                 if kind in costs[stage] else "-" for kind in kinds]
        lines.append(f"  {stage:5d}  " + "".join(f"{cell:>24s}" for cell in cells))
    for name, share in COST_QUANTILES.items():
        lines.append(f"the simulator's cost flags at each stage's {name}: "
                     f"{cost_flags(costs, share)}")
    return "\n".join(lines)


def trace_tool_parser(doc: str) -> argparse.ArgumentParser:
    """The command line the trace tools share: a trace, and --json."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("trace", help="a --trace directory or a Chrome trace JSON file")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return parser


def write_result(as_json: bool, result, text: str) -> int:
    """A trace tool's answer on stdout: `result` as JSON, or `text`; the exit status."""
    if as_json:
        json.dump(result, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(text + "\n")
    return 0


def main(argv=None) -> int:
    parser = trace_tool_parser(__doc__)
    parser.add_argument("--costs", action="store_true",
                        help="each stage's task times and the simulator's cost flags fitted "
                             "to them, instead of the per-iteration report")
    args = parser.parse_args(argv)
    try:
        spans, iterations = load_spans(load_trace(args.trace))
    except TraceError as error:
        parser.exit(2, f"{parser.prog}: {error}\n")
    reports = iteration_reports(spans, iterations)
    if not reports:
        parser.exit(2, f"{parser.prog}: {args.trace}: no forward/backward spans\n")
    if args.costs:
        if any(span.chunk for span in spans):
            parser.exit(2, f"{parser.prog}: {args.trace}: several model chunks a stage; "
                           "--costs fits the model of one chunk a stage\n")
        costs = task_costs(spans)
        return write_result(args.json, {
            "task_ms": {stage: dict(kinds) for stage, kinds in costs.items()},
            "flags": {name: cost_flags(costs, share) for name, share in COST_QUANTILES.items()},
        }, format_costs(costs))
    return write_result(args.json, {"iterations": reports}, format_reports(reports))


if __name__ == "__main__":
    sys.exit(main())
