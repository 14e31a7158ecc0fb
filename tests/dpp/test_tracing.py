"""--trace: per-rank span files from a real PP=2 CPU run (DPP and megatron-core's 1F1B)
merge into one Chrome trace with every microbatch's forward and backward on every stage in
causal order; the report reproduces the simulator's own numbers from its trace; the
timeline tool draws real and simulated runs; tracing off records nothing."""

from __future__ import annotations

import inspect
import json

import pytest
import torch

from megatron.dpp import tracing
from megatron.dpp.actions import Task
from megatron.dpp.sim.simulator import CostModel, Durations, compare, simulate, write_trace
from profiling import aggregate, plot_timeline, report
from tests.distributed import run_ranks
from tests.trainer_runs import TINY, train_runs, with_flags

MICROBATCHES = 4
TRACED = [2, 3]
RUN = with_flags(TINY, pipeline_model_parallel_size=2, global_batch_size=2 * MICROBATCHES,
                 train_iters=3, log_throughput=True)


@pytest.fixture(scope="module")
def traced_runs(tmp_path_factory):
    """Trace directories of a DPP and a 1F1B run (one pair of processes for both)."""
    root = tmp_path_factory.mktemp("traces")
    dirs = {name: str(root / name) for name in ("dpp", "1f1b")}
    flags = {name: with_flags(RUN, trace=True, trace_dir=path, trace_iters=TRACED)
             for name, path in dirs.items()}
    flags["dpp"] += ["--use-dpp", "--dpp-transport", "torch"]
    results = run_ranks(2, train_runs, [flags["dpp"], flags["1f1b"]], 2)
    return dirs, results


def _merged(directory):
    path = directory + "/trace.json"
    assert aggregate.main(["--benchmark-dir", directory, "--output", path]) == 0
    with open(path) as f:
        return json.load(f)  # valid JSON: what Perfetto / chrome://tracing load


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["dpp", "1f1b"])
def test_trace_has_causal_forward_backward_on_every_stage(traced_runs, schedule):
    trace = _merged(traced_runs[0][schedule])
    assert trace["otherData"]["schedule"] == schedule
    assert {e["pid"] for e in trace["traceEvents"]} == {0, 1}, "events from every rank"
    spans, iterations = aggregate.load_spans(trace)
    assert sorted({s.iteration for s in spans}) == TRACED, "--trace-iters selects"
    assert {(rank, it) for rank, it in iterations} == {(r, i) for r in (0, 1) for i in TRACED}
    for iteration in TRACED:
        tasks = {(s.kind, s.stage, s.microbatch): s for s in spans
                 if s.iteration == iteration and s.kind in ("forward", "backward")}
        assert len(tasks) == 2 * 2 * MICROBATCHES, "one F and one B per microbatch and stage"
        for i in range(MICROBATCHES):
            assert tasks["forward", 0, i].end <= tasks["forward", 1, i].start
            assert tasks["backward", 1, i].end <= tasks["backward", 0, i].start
            for stage in (0, 1):
                assert tasks["forward", stage, i].end <= tasks["backward", stage, i].start
        kinds = {s.kind for s in spans if s.iteration == iteration}
        assert {"send", "recv_wait", "grad_sync", "optimizer"} <= kinds


@pytest.mark.slow
def test_report_and_timeline_of_real_runs(traced_runs, tmp_path):
    dirs, results = traced_runs
    reports = report.report_of(dirs["dpp"])
    assert [r["iteration"] for r in reports] == TRACED
    for row in reports[0]["stages"]:
        assert 0.0 <= row["bubble"] < 1.0 and row["busy_ms"] > 0
        assert row["peak_memory_mb"] > 0
    png = tmp_path / "real.png"
    plot_timeline.main([dirs["1f1b"], dirs["dpp"], "--labels", "1F1B", "DPP",
                        "--iteration", "3", "-o", str(png)])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    memory_lines = [m for _, m in results[-1][0]["logs"] if m.startswith("memory per rank")]
    assert len(memory_lines) == 3 and all("0: " in m and "1: " in m for m in memory_lines)


def test_report_matches_simulator(tmp_path):
    results = compare(4, 12, CostModel(cv=0.5), slack=2, seed=3, schedules=("1f1b", "dpp"),
                      record=True)
    for name, result in results.items():
        path = str(tmp_path / f"{name}.json")
        write_trace(path, result)
        (measured,) = report.report_of(path)
        assert measured["makespan_ms"] == pytest.approx(result.makespan)
        assert [row["bubble"] for row in measured["stages"]] == pytest.approx(result.bubble)
        assert [row["peak_in_flight"] for row in measured["stages"]] == result.peak_in_flight
    png = tmp_path / "sim.png"
    plot_timeline.plot([str(tmp_path / "1f1b.json"), str(tmp_path / "dpp.json")],
                       ["1F1B", "DPP"], str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_sets_the_first_forward_beside_the_median(tmp_path):
    """A 1F1B run whose first microbatch's forward on stage 0 takes 5 units, every other
    task its usual time: stage 0 reports a first forward of 5 against a median of 1, the
    other stages 1 and 1."""
    p, m = 3, 6
    durations = Durations([[5.0 if (stage, k) == (0, 0) else 1.0 for k in range(m)]
                           for stage in range(p)], [[2.0] * m for _ in range(p)], [1.0] * m)
    path = str(tmp_path / "slow-first.json")
    write_trace(path, simulate("1f1b", p, m, durations, record=True))
    (measured,) = report.report_of(path)
    assert [row["first_forward_ms"] for row in measured["stages"]] == pytest.approx([5, 1, 1])
    assert [row["median_forward_ms"] for row in measured["stages"]] == pytest.approx([1, 1, 1])
    assert "first F ms  median F ms" in report.format_reports([measured])


def test_tracer_records_only_traced_iterations(tmp_path):
    path = str(tmp_path / "trace-rank0.jsonl")
    meta = {"rank": 0, "world_size": 1, "stage": 0, "pp_size": 2, "num_chunks": 1,
            "schedule": "1f1b", "run_id": 1}
    tracer = tracing.Tracer(path, meta, torch.device("cpu"), origin_ns=0, iterations=[2])
    timers = tracer.megatron_timers(label_compute=True)
    for iteration in (1, 2):
        tracer.begin_iteration(iteration, num_microbatches=3)
        for name in ["forward-compute"] * 2 + ["backward-compute", "forward-send-backward-recv"]:
            timers(name).start(barrier=True)
            timers(name).stop()
        with tracer.span("optimizer"):
            pass
        tracer.end_iteration()
    tracer.close()
    header, iterations, spans = aggregate.read_rank_file(path)
    assert header["schedule"] == "1f1b" and [r["iteration"] for r in iterations] == [2]
    # stage 0 of 2 under 1F1B: forwards 0, 1 (one warm-up), then backward 0
    assert [(s["kind"], s["mb"]) for s in spans] == [
        ("forward", 0), ("forward", 1), ("backward", 0), ("recv_wait", None),
        ("optimizer", None)]
    assert all(s["it"] == 2 and s["dur_us"] >= 0 for s in spans)


# what the trainer and the DPP schedule call on whichever tracer they hold
TRACER_API = ("span", "start", "stop", "record_actions", "begin_iteration", "end_iteration",
              "megatron_timers", "close")


def test_null_tracer_and_bad_inputs(tmp_path, monkeypatch):
    for name in TRACER_API:  # tracing off must accept every call tracing on takes
        assert (inspect.signature(getattr(tracing.NullTracer, name)).parameters
                == inspect.signature(getattr(tracing.Tracer, name)).parameters), name
    monkeypatch.chdir(tmp_path)
    null = tracing.NullTracer()
    null.begin_iteration(1, num_microbatches=2)
    with null.span("forward", 0, 0):
        null.stop(null.start("backward", 0, 0))
    null.record_actions(0, [Task("F", 0, 0)])
    null.end_iteration()
    null.close()
    assert list(tmp_path.iterdir()) == [], "tracing off writes nothing"
    assert null.megatron_timers(label_compute=True) is None  # megatron-core's timers stay off
    with pytest.raises(aggregate.TraceError, match="no trace-rank"):
        aggregate.merge(str(tmp_path))
    (tmp_path / "trace-rank0.jsonl").write_text('{"format": "megatron-dpp-trace", "rank": 0}\n'
                                                '{"kind": "forward"\n')
    with pytest.raises(aggregate.TraceError, match=r"trace-rank0\.jsonl:2: not JSON"):
        aggregate.merge(str(tmp_path))
    from megatron.trainer.config.arguments import ArgumentError, parse_args

    with pytest.raises(ArgumentError, match="--trace-iters needs --trace"):
        parse_args(with_flags(RUN, trace_iters=[2]), world_size=2)
    with pytest.raises(ArgumentError, match="--trace-iters 0: iterations count from 1"):
        parse_args(with_flags(RUN, trace=True, trace_iters=[0, 2]), world_size=2)


def clock_offsets(rank):
    """Rank function: `_clock_offset_ns` with both ranks on one host, then with rank 1
    posing as another host."""
    import socket

    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        same = tracing._clock_offset_ns(torch.device("cpu"))
        real = socket.gethostname
        socket.gethostname = lambda: f"{real()}-elsewhere" if rank == 1 else real()
        try:
            other = tracing._clock_offset_ns(torch.device("cpu"))
        finally:
            socket.gethostname = real
    finally:
        dist.destroy_process_group()
    return same, other


def test_clock_offsets_are_measured_across_hosts_only():
    """On rank 0's host the clock is shared: offset 0, no round trip. A rank on another
    host measures it; here the true offset is 0, so the estimate is within half its
    round trip of 0."""
    (same0, other0), (same1, (offset, round_trip)) = run_ranks(2, clock_offsets)
    assert same0 == same1 == other0 == (0, 0)
    assert round_trip > 0 and abs(offset) <= round_trip / 2 + 1  # + 1: integer halving
