"""profiling/sim_compare.py: replaying a simulator trace's own durations through the same
schedule reproduces its bubble exactly (durations, latency and schedule rebuilt right);
a different schedule, slack or latency does not; a real PP=2 CPU run compares within a
loose bound, and a DPP run's recorded actions are replayed exactly."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from megatron.dpp.actions import Task, read_actions, write_actions
from megatron.dpp.config import DEFAULTS
from megatron.dpp.plan import check_plans
from megatron.dpp.sim.simulate import main as simulate_main
from megatron.dpp.sim.simulator import replay
from megatron.dpp.topology import PipelineTopology
from profiling import sim_compare
from profiling.aggregate import TraceError, load_spans, load_trace
from tests.distributed import run_ranks
from tests.trainer_runs import TINY, train_runs, with_flags

COST = ["--cv", "0.5", "--jitter", "0.2", "--seed", "5"]


def simulated_trace(tmp_path, schedule, pp=4, microbatches=12, chunks=1, slack=2,
                    latency=0.0) -> str:
    """A Chrome trace written by `python -m megatron.dpp.sim.simulate --trace` (random costs)."""
    path = str(tmp_path / f"{schedule}-{chunks}-{slack}-{latency}.json")
    simulate_main(["--pp", str(pp), "--microbatches", str(microbatches), "--chunks",
                   str(chunks), "--slack", str(slack), "--latency", str(latency), *COST,
                   "--schedules", schedule, "--trace", path, "--trace-schedule", schedule,
                   "--json"])
    return path


def differences(result) -> list[float]:
    (iteration,) = result["iterations"]
    return [row["difference_pp"] for row in iteration["stages"]]


@pytest.mark.parametrize("schedule,chunks,slack,latency", [
    ("1f1b", 1, 0, 0.0), ("1f1b", 1, 0, 0.3), ("interleaved", 2, 0, 0.2), ("dpp", 1, 2, 0.0),
    ("dpp", 1, 2, 0.3), ("dpp", 2, 1, 0.1), ("gpipe", 1, 0, 0.0)])
def test_same_schedule_reproduces_the_bubble(tmp_path, capsys, schedule, chunks, slack,
                                             latency):
    path = simulated_trace(tmp_path, schedule, chunks=chunks, slack=slack, latency=latency)
    capsys.readouterr()
    result = sim_compare.compare(path, schedule, slack)
    (iteration,) = result["iterations"]
    assert iteration["latency_ms"] == pytest.approx(latency, abs=1e-6)
    assert iteration["latency_samples"] > 0
    assert iteration["simulated_makespan_ms"] == pytest.approx(iteration["measured_makespan_ms"])
    assert differences(result) == pytest.approx([0.0] * 4, abs=1e-6)
    assert all(0.0 < row["measured_bubble"] < 1.0 for row in iteration["stages"])
    assert iteration["lower_bound_ms"] <= iteration["zero_latency_makespan_ms"] + 1e-9


def test_the_lower_bound_is_the_busiest_ranks_work(tmp_path, capsys):
    """A rank three times slower than the others: no schedule is faster than its work after
    the cheapest lead-in, and 1F1B on 32 microbatches comes within 10 % of that."""
    path = str(tmp_path / "slow.json")
    simulate_main(["--pp", "4", "--microbatches", "32", "--slow-stage", "2", "--slow-factor",
                   "3", "--schedules", "1f1b", "--trace", path, "--trace-schedule", "1f1b"])
    capsys.readouterr()
    (row,) = sim_compare.compare(path, "1f1b")["iterations"]
    # the slow rank: 32 x (F + B) = 32 x 3 x 3 after two forwards on the ranks before it
    assert row["lower_bound_ms"] == pytest.approx(32 * 9 + 2)
    assert 1 < row["measured_makespan_ms"] / row["lower_bound_ms"] < 1.1
    assert sim_compare.main([path, "--schedule", "1f1b"]) == 0
    assert "no schedule of these tasks takes less than 290.00 ms" in capsys.readouterr().out


def test_a_different_model_differs(tmp_path, capsys):
    path = simulated_trace(tmp_path, "1f1b", latency=0.3)
    dpp = simulated_trace(tmp_path, "dpp", slack=2)
    capsys.readouterr()
    assert max(map(abs, differences(sim_compare.compare(path, "gpipe")))) > 1.0
    assert max(map(abs, differences(sim_compare.compare(path, "1f1b", latency=0.0)))) > 1.0
    assert max(map(abs, differences(sim_compare.compare(dpp, "dpp", slack=0)))) > 1.0
    assert max(map(abs, differences(sim_compare.compare(dpp, "1f1b")))) > 1.0


def test_cli_table_json_and_errors(tmp_path, capsys):
    path = simulated_trace(tmp_path, "dpp", slack=2)
    capsys.readouterr()
    assert sim_compare.main([path, "--schedule", "dpp", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["schedule"] == "dpp" and result["slack"] == DEFAULTS.slack
    assert [row["stage"] for row in result["mean"]] == [0, 1, 2, 3]
    assert sim_compare.main([path, "--schedule", "dpp"]) == 0
    table = capsys.readouterr().out
    stage_lines = [line for line in table.splitlines() if line.startswith("  ") and
                   line.split()[0].isdigit()]
    assert "simulated schedule: dpp slack 2" in table
    assert [line.split()[-1] for line in stage_lines] == ["+0.00"] * 4
    with pytest.raises(SystemExit):  # a simulator trace has no header naming its schedule
        sim_compare.main([path])
    assert "give --schedule" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        sim_compare.main([path, "--schedule", "interleaved"])  # the trace has one chunk
    assert "interleaved needs num_chunks >= 2" in capsys.readouterr().err


MICROBATCHES = 4
RUN = with_flags(TINY, pipeline_model_parallel_size=2, global_batch_size=2 * MICROBATCHES,
                 train_iters=3, trace=True, trace_iters=[2, 3])


@pytest.fixture(scope="module")
def real_runs(tmp_path_factory):
    """Trace directories of a DPP (slack 1, the backward whole: one span a task, as
    megatron-core's runs have) and a 1F1B PP=2 CPU run (one pair of processes for both)."""
    root = tmp_path_factory.mktemp("real")
    dirs = {name: str(root / name) for name in ("dpp", "1f1b")}
    flags = [with_flags(RUN, trace_dir=dirs["dpp"], use_dpp=True, dpp_transport="torch",
                        dpp_max_inflight=1, no_dpp_split_backward=True),
             with_flags(RUN, trace_dir=dirs["1f1b"])]
    run_ranks(2, train_runs, flags, 2)
    return dirs


@pytest.mark.slow
def test_real_pp2_runs(real_runs):
    """A DPP and a 1F1B CPU run: the schedule comes from the header, and the times keep
    the order the run's own dependencies impose: no bound above the zero-latency replay of
    the measured tasks, that replay no longer than the run (which waited for the same
    inputs, plus hops and host work) nor than the replay with the measured hop. How near
    the simulated bubble comes to the measured one depends on the machine's load, so it is
    a benchmark's question (docs/profiling.md), not this test's."""
    tolerance = 1e-6  # ms: the spans' rounding
    for name, directory in real_runs.items():
        result = sim_compare.compare(directory)
        assert result["schedule"] == name
        assert result["slack"] == (1 if name == "dpp" else 0)  # the header's --dpp-max-inflight
        assert [row["iteration"] for row in result["iterations"]] == [2, 3]
        for iteration in result["iterations"]:
            assert iteration["latency_samples"] > 0 and iteration["latency_ms"] >= 0
            ideal = iteration["zero_latency_makespan_ms"]
            assert iteration["lower_bound_ms"] <= iteration["in_order_bound_ms"] + tolerance
            assert iteration["in_order_bound_ms"] <= ideal + tolerance, (name, iteration)
            assert ideal <= iteration["measured_makespan_ms"] + tolerance, (name, iteration)
            assert ideal <= iteration["simulated_makespan_ms"] + tolerance, (name, iteration)
            for row in iteration["stages"]:
                assert 0.0 <= row["simulated_bubble"] < 1.0
                assert 0.0 <= row["measured_bubble"] < 1.0


@pytest.mark.slow
def test_dpp_trace_replays_the_executed_order(real_runs, tmp_path):
    """--trace under DPP writes each rank's executed actions (the order of its compute
    spans, a complete plan); sim_compare replays exactly them: rewriting stage 0's order of
    iteration 2 (to GPipe's, also valid) changes the simulation to that order's replay,
    and an order that can never finish is refused naming the rank and action."""
    dpp = real_runs["dpp"]
    assert not list(Path(real_runs["1f1b"]).glob("*.csv"))  # megatron-core's own schedule
    trace = load_trace(dpp)
    spans, _ = load_spans(trace)
    recorded = {}
    for rank in (0, 1):
        by_iteration = read_actions(str(Path(dpp) / f"trace-rank{rank}.actions.csv"))
        assert sorted(by_iteration) == [2, 3]
        for iteration, stages in by_iteration.items():
            (actions,) = stages.values()
            ran = sorted((s for s in spans if s.rank == rank and s.iteration == iteration
                          and s.kind in ("forward", "backward")), key=lambda s: s.start)
            assert actions == [Task(sim_compare.TASK_KIND[s.kind], s.chunk or 0, s.microbatch)
                               for s in ran]
            recorded.setdefault(iteration, {})[rank] = actions
    for stages in recorded.values():
        check_plans([stages[0], stages[1]], PipelineTopology(2), MICROBATCHES)
    result = sim_compare.compare(dpp)
    assert result["replayed"]

    changed = tmp_path / "changed"
    shutil.copytree(dpp, changed)
    late = [Task("F", 0, i) for i in range(MICROBATCHES)]
    late += [Task("B", 0, i) for i in reversed(range(MICROBATCHES))]
    rewrite(changed / "trace-rank0.actions.csv", {2: {0: late}, 3: {0: recorded[3][0]}})
    replayed = sim_compare.compare(str(changed))
    (first, second), original = replayed["iterations"], result["iterations"]
    compute = [s for s in spans if s.iteration == 2 and s.kind in ("forward", "backward")]
    durations = sim_compare.measured_durations(compute, 2, 1)
    expected = replay([late, recorded[2][1]], durations, latency=first["latency_ms"])
    assert first["simulated_makespan_ms"] == expected.makespan
    # each replays its own order (GPipe's may be shorter or longer on measured times)
    executed = replay([recorded[2][0], recorded[2][1]], durations,
                      latency=original[0]["latency_ms"])
    assert original[0]["simulated_makespan_ms"] == executed.makespan
    assert second == original[1]

    stuck = list(recorded[3][0])
    stuck.insert(0, stuck.pop(stuck.index(Task("B", 0, 0))))  # a backward before its forward
    rewrite(changed / "trace-rank0.actions.csv", {2: {0: late}, 3: {0: stuck}})
    with pytest.raises(TraceError, match=r"iteration 3: .*rank 0, action 0: B\(chunk 0, "
                                         r"microbatch 0\) can never run"):
        sim_compare.compare(str(changed))


@pytest.mark.slow
def test_each_iteration_is_simulated_with_the_slack_and_rule_it_ran(real_runs, tmp_path):
    """DPP's iteration records say what each training call ran (the header holds the
    largest slack it may choose); without recorded actions each iteration is simulated
    with its own slack and rule, and an explicit slack still wins."""
    trace = load_trace(real_runs["dpp"])
    _, iterations = load_spans(trace)
    assert {(r["dpp_slack"], r["dpp_static"]) for r in iterations.values()} == {(1, False)}
    as_run = sim_compare.compare(real_runs["dpp"])
    assert [(row["schedule"], row["slack"]) for row in as_run["iterations"]] == [
        ("dpp", 1), ("dpp", 1)]
    for event in trace["traceEvents"]:  # iteration 2 ran the plan in order at slack 0
        if event.get("cat") == "iteration" and event["args"]["iteration"] == 2:
            event["args"].update(dpp_slack=0, dpp_static=True)
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace))
    noted = sim_compare.compare(str(path))
    assert not noted["replayed"]
    assert [(row["schedule"], row["slack"]) for row in noted["iterations"]] == [
        ("dpp-static", 0), ("dpp", 1)]
    assert "iteration 2 (dpp-static slack 0)" in sim_compare.format_comparison(noted)
    given = sim_compare.compare(str(path), slack=2)
    assert [(row["schedule"], row["slack"]) for row in given["iterations"]] == [
        ("dpp-static", 2), ("dpp", 2)]


def rewrite(path, by_iteration):
    with open(path, "w", newline="") as file:
        for k, (iteration, plans) in enumerate(sorted(by_iteration.items())):
            write_actions(file, plans, iteration, header=k == 0)


def test_a_w_run_in_parts_counts_as_the_sum_of_its_parts():
    """A W traced as 4 part spans on one rank is one task of their summed time (the mean of
    the parts made W count a quarter); stage ranks are still averaged."""
    from profiling.aggregate import Span

    def span(kind, rank, stage, duration, start=0.0):
        return Span(kind, rank, stage, 0, 0, 0, start, duration)

    compute = [span("forward", 0, 0, 1.0), span("backward", 0, 0, 2.0),
               span("forward", 1, 1, 1.0), span("backward", 1, 1, 2.0),
               *(span("weight", 0, 0, 0.5, start=3.0 + k) for k in range(4)),
               *(span("weight", 1, 1, 1.0, start=3.0 + k) for k in range(4))]
    durations = sim_compare.measured_durations(compute, 2, 1)
    assert durations.weight == [[2.0], [4.0]]
    assert durations.backward == [[2.0], [2.0]]


def test_a_w_run_in_parts_releases_its_microbatch_at_its_last_part():
    """Two microbatches, each W in 4 parts: the second forward starts after the first W's
    first part, so both are held at once (2), not 1 less per part; once every part has
    ended nothing is held, and a third forward after that makes 1 again."""
    from profiling.aggregate import Span
    from profiling.report import peak_in_flight

    def span(kind, microbatch, start, duration=0.5):
        return Span(kind, 0, 0, 0, microbatch, 0, start, duration)

    spans = [span("forward", 0, 0.0), span("backward", 0, 1.0),
             *(span("weight", 0, 2.0 + k) for k in range(4)),
             span("forward", 1, 2.6), span("backward", 1, 6.0),
             *(span("weight", 1, 7.0 + k) for k in range(4)),
             span("forward", 2, 11.0), span("backward", 2, 12.0), span("weight", 2, 13.0)]
    assert peak_in_flight(spans) == 2
    assert peak_in_flight(spans[:6] + spans[12:]) == 1


def test_the_gap_splits_into_hops_and_the_runtime(tmp_path, capsys):
    """A simulator trace written with a latency: replayed at that latency it has no runtime
    gap, and the hops account for the whole difference to the zero-latency replay."""
    path = simulated_trace(tmp_path, "1f1b", latency=0.3)
    result = sim_compare.compare(path, schedule="1f1b", latency=0.3)
    (row,) = result["iterations"]
    assert row["zero_latency_makespan_ms"] < row["simulated_makespan_ms"]
    assert abs(row["measured_makespan_ms"] - row["simulated_makespan_ms"]) < 1e-6
    assert sim_compare.main([path, "--schedule", "1f1b", "--latency", "0.3"]) == 0
    assert "message hops +" in capsys.readouterr().out


def test_the_in_order_bound_counts_what_the_run_held(tmp_path, capsys):
    """DPP's rule on a slow last stage with stragglers, the split backward: each stage's
    held count read from the trace is what the simulator counted (at least the slack's cap),
    and the in-order bound at it lies between the memory-free bound and the makespan; the
    rule ran its W tasks in the microbatch order, whose bound lies between that one and the
    makespan. With the W tasks shortest B first, that bound is left out."""
    path = str(tmp_path / "split.json")
    simulate_main(["--pp", "4", "--microbatches", "12", "--slack", "2", "--split-backward",
                   "--weight-share", "0.2", "--slow-stage", "3", "--slow-factor", "1.5",
                   "--emulate-straggler", "all:0.2:3", "--schedules", "dpp", "--trace", path,
                   "--json"])
    report = json.loads(capsys.readouterr().out)
    (row,) = sim_compare.compare(path, "dpp", 2)["iterations"]
    caps = sim_compare.slack_caps(4, 12, 2)
    assert caps == [6, 5, 4, 3]
    peaks = report["schedules"]["dpp"]["peak_in_flight_per_stage"]
    assert row["held"] == [max(peak, cap) for peak, cap in zip(peaks, caps, strict=True)]
    assert row["lower_bound_ms"] <= row["in_order_bound_ms"] <= row["measured_makespan_ms"]
    assert (row["in_order_bound_ms"] <= row["weights_in_order_bound_ms"]
            <= row["measured_makespan_ms"])
    assert sim_compare.main([path, "--schedule", "dpp", "--slack", "2"]) == 0
    out = capsys.readouterr().out
    assert (f"holding at most {'/'.join(map(str, row['held']))} from F to W per stage takes "
            f"less than {row['in_order_bound_ms']:.2f} ms") in out
    assert (f"nor with its W tasks in that order too (its weight gradients summed as the run "
            f"summed them) less than {row['weights_in_order_bound_ms']:.2f} ms") in out
    simulate_main(["--pp", "4", "--microbatches", "12", "--slack", "2", "--split-backward",
                   "--weight-share", "0.2", "--slow-stage", "3", "--slow-factor", "1.5",
                   "--emulate-straggler", "all:0.2:3", "--schedules", "dpp", "--trace", path,
                   "--weights-by-backward"])
    capsys.readouterr()
    (row,) = sim_compare.compare(path, "dpp", 2)["iterations"]
    assert "in_order_bound_ms" in row and "weights_in_order_bound_ms" not in row
