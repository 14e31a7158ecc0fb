"""Bubble report of a traced or simulated pipeline run: per iteration and stage, busy time,
bubble fraction, receive-wait time, peak in-flight microbatches, peak memory, and the
iteration's first forward against the median forward (a first forward that waits for the
host, reading the iteration's data say, stands out).

    python profiling/report.py traces                 # a --trace directory
    python profiling/report.py traces/trace.json      # profiling/aggregate.py's output
    python profiling/report.py /tmp/dpp.json --json   # python -m megatron.dpp.sim.simulate --trace

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
    args = parser.parse_args(argv)
    try:
        reports = report_of(args.trace)
    except TraceError as error:
        parser.exit(2, f"{parser.prog}: {error}\n")
    if not reports:
        parser.exit(2, f"{parser.prog}: {args.trace}: no forward/backward spans\n")
    return write_result(args.json, {"iterations": reports}, format_reports(reports))


if __name__ == "__main__":
    sys.exit(main())
