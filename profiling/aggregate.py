"""Merge the per-rank span files that `--trace` writes (DIR/trace-rank<R>.jsonl) into one
Chrome trace for Perfetto (ui.perfetto.dev) or chrome://tracing.

    python profiling/aggregate.py --benchmark-dir traces            # -> traces/trace.json

One process row per rank (named by stage, tensor- and data-parallel rank), with threads
for compute (forward/backward boxes named F<microbatch>/B<microbatch>, plus c<chunk> with
virtual chunks), communication (send, receive-wait), optimizer/grad sync, and iterations
(which carry the rank's peak memory). Times are on rank 0's clock: each rank measured its
offset at start (megatron/dpp/tracing.py). Every event's args hold rank, stage,
chunk, microbatch and iteration; the simulator's traces (python -m megatron.dpp.sim.simulate
--trace FILE) use the same categories and args, so `load_spans` reads both.
"""

from __future__ import annotations

import argparse
import glob
import json
import logging
import os
import re
import sys
from dataclasses import dataclass

log = logging.getLogger("aggregate")

FORMAT = "megatron-dpp-trace"  # megatron/dpp/tracing.py writes this header
COMPUTE, COMMUNICATION, STEP, ITERATION = 0, 1, 2, 3
THREAD_NAMES = {COMPUTE: "compute", COMMUNICATION: "send / receive-wait",
                STEP: "grad sync / optimizer", ITERATION: "iteration"}
THREAD_OF = {"forward": COMPUTE, "backward": COMPUTE, "weight": COMPUTE,
             "send": COMMUNICATION,
             "recv_wait": COMMUNICATION, "grad_sync": STEP, "optimizer": STEP}
_RANK_FILE = re.compile(r"trace-rank(\d+)\.jsonl$")


class TraceError(ValueError):
    """A trace file or directory that cannot be read; the message names the file."""


@dataclass(frozen=True)
class Span:
    """One span of a merged (or simulated) trace, times in ms."""

    kind: str
    rank: int
    stage: int
    iteration: int
    microbatch: int | None
    chunk: int | None
    start: float
    duration: float

    @property
    def end(self) -> float:
        return self.start + self.duration


def read_rank_file(path: str) -> tuple[dict, list[dict], list[dict]]:
    """(header, iteration records, span records) of one rank's file."""
    with open(path) as f:
        lines = f.read().splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append((number, json.loads(line)))
        except json.JSONDecodeError as error:
            raise TraceError(f"{path}:{number}: not JSON ({error.msg})") from None
    if not records or records[0][1].get("format") != FORMAT:
        raise TraceError(f"{path}:1: not a {FORMAT} header (written by --trace?)")
    header = records[0][1]
    iterations, spans = [], []
    for number, record in records[1:]:
        if "kind" in record:
            missing = {"it", "start_us", "dur_us"} - record.keys()
            if missing or record["kind"] not in THREAD_OF:
                raise TraceError(f"{path}:{number}: bad span record {line_preview(record)}")
            spans.append(record)
        elif "iteration" in record:
            iterations.append(record)
        else:
            raise TraceError(f"{path}:{number}: neither a span nor an iteration record")
    return header, iterations, spans


def line_preview(record: dict) -> str:
    text = json.dumps(record)
    return text if len(text) < 120 else text[:117] + "..."


def rank_files(directory: str) -> dict[int, str]:
    if not os.path.isdir(directory):
        raise TraceError(f"--benchmark-dir {directory}: not a directory")
    files = {}
    for path in glob.glob(os.path.join(directory, "trace-rank*.jsonl")):
        match = _RANK_FILE.search(os.path.basename(path))
        if match:
            files[int(match.group(1))] = path
    if not files:
        raise TraceError(f"{directory}: no trace-rank<R>.jsonl files (train with --trace "
                         f"--trace-dir {directory})")
    return files


def merge(directory: str) -> dict:
    """The Chrome trace (a dict) of every rank file in `directory`."""
    files = rank_files(directory)
    events: list[dict] = []
    first = None
    for rank in sorted(files):
        header, iterations, spans = read_rank_file(files[rank])
        if header.get("rank") != rank:
            raise TraceError(f"{files[rank]}:1: header says rank {header.get('rank')}")
        if first is None:
            first = (files[rank], header)
        elif header.get("run_id") != first[1].get("run_id"):
            raise TraceError(f"{files[rank]}: run_id {header.get('run_id')} differs from "
                             f"{first[0]}'s {first[1].get('run_id')} (two runs in one directory?)")
        events += _rank_events(header, iterations, spans)
    world = first[1]["world_size"]
    missing = sorted(set(range(world)) - set(files))
    if missing:
        raise TraceError(f"{directory}: world size {world} but no file for ranks "
                         f"{', '.join(map(str, missing))}")
    meta = {k: first[1][k] for k in ("run_id", "world_size", "pp_size", "num_chunks",
                                     "schedule", "dpp_slack", "timing") if k in first[1]}
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": meta}


def _rank_events(header: dict, iterations: list[dict], spans: list[dict]) -> list[dict]:
    rank, stage = header["rank"], header["stage"]
    chunked = header.get("num_chunks", 1) > 1
    events = [
        {"ph": "M", "name": "process_name", "pid": rank, "args": {
            "name": f"rank {rank}: stage {stage}, tp {header.get('tp_rank', 0)}, "
                    f"dp {header.get('dp_rank', 0)}"}},
        {"ph": "M", "name": "process_sort_index", "pid": rank,
         "args": {"sort_index": stage * header["world_size"] + rank}},
    ]
    for tid, name in THREAD_NAMES.items():
        events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid,
                       "args": {"name": name}})
    for record in iterations:
        args = {"rank": rank, "stage": stage, "iteration": record["iteration"],
                "microbatches": record.get("microbatches"),
                "peak_memory_bytes": record.get("peak_memory_bytes"),
                **{key: record[key] for key in ("dpp_slack", "dpp_static") if key in record}}
        events.append({"name": f"iteration {record['iteration']}", "cat": "iteration",
                       "ph": "X", "pid": rank, "tid": ITERATION, "ts": record["start_us"],
                       "dur": max(0.0, record["end_us"] - record["start_us"]), "args": args})
        if record.get("peak_memory_bytes") is not None:
            events.append({"name": "peak memory (MB)", "ph": "C", "pid": rank,
                           "ts": record["end_us"],
                           "args": {"MB": round(record["peak_memory_bytes"] / 2**20, 1)}})
    for record in spans:
        kind = record["kind"]
        events.append({
            "name": span_name(kind, record.get("mb"), record.get("chunk"), chunked),
            "cat": kind, "ph": "X", "pid": rank, "tid": THREAD_OF[kind],
            "ts": record["start_us"], "dur": record["dur_us"],
            "args": {"rank": rank, "stage": stage, "iteration": record["it"],
                     "microbatch": record.get("mb"), "chunk": record.get("chunk")},
        })
    return events


def span_name(kind: str, microbatch, chunk, chunked: bool) -> str:
    suffix = "" if microbatch is None else f"{microbatch}" + (f"c{chunk}" if chunked else "")
    if kind in ("forward", "backward", "weight"):
        return kind[0].upper() + suffix
    names = {"send": "send", "recv_wait": "wait", "grad_sync": "grad sync",
             "optimizer": "optimizer step"}
    return names[kind] + (f" {suffix}" if suffix else "")


def load_trace(path: str) -> dict:
    """A Chrome trace from a --trace directory (merged now) or a .json trace file."""
    if os.path.isdir(path):
        return merge(path)
    try:
        with open(path) as f:
            trace = json.load(f)
    except (OSError, json.JSONDecodeError) as error:
        raise TraceError(f"{path}: cannot read a Chrome trace ({error})") from None
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise TraceError(f"{path}: no traceEvents list (not a Chrome trace)")
    return trace


def load_spans(trace: dict) -> tuple[list[Span], dict[tuple[int, int], dict]]:
    """Spans (ms) and per (rank, iteration) records (microbatches, peak_memory_bytes, and
    under DPP dpp_slack and dpp_static: what the iteration ran) of a
    merged or simulated trace. Simulated traces have one rank per stage and iteration 0."""
    spans, iterations = [], {}
    for event in trace["traceEvents"]:
        if event.get("ph") != "X":
            continue
        args = event.get("args", {})
        stage = args.get("stage", event.get("tid", 0))
        rank = args.get("rank", stage)
        iteration = args.get("iteration", 0)
        if event.get("cat") == "iteration":
            iterations[(rank, iteration)] = args
        elif event.get("cat") in THREAD_OF:
            spans.append(Span(event["cat"], rank, stage, iteration, args.get("microbatch"),
                              args.get("chunk"), event["ts"] / 1000.0,
                              event.get("dur", 0.0) / 1000.0))
    return spans, iterations


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--benchmark-dir", required=True,
                        help="the --trace-dir of a run (holds trace-rank<R>.jsonl)")
    parser.add_argument("--output", default=None, help="default: BENCHMARK_DIR/trace.json")
    args = parser.parse_args(argv)
    try:
        trace = merge(args.benchmark_dir)
    except TraceError as error:
        parser.exit(2, f"{parser.prog}: {error}\n")
    output = args.output or os.path.join(args.benchmark_dir, "trace.json")
    with open(output, "w") as f:
        json.dump(trace, f)
    spans, _ = load_spans(trace)
    log.info("%s: %d spans from %d ranks, iterations %s", output, len(spans),
             trace["otherData"]["world_size"], sorted({s.iteration for s in spans}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
