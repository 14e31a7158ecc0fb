"""profiling/bench_two_pods.py's parts that run without a trainer: the flags of each
schedule, what it reads from the logs, and the simulator's prediction from a trace."""

from __future__ import annotations

import pytest

from megatron.dpp.sim.bounds import memory_free_bound
from megatron.dpp.sim.simulate import main as simulate_main
from megatron.dpp.sim.simulator import CostModel, compare, sample_durations, simulate
from profiling import bench_two_pods, sim_compare

LOG = """\
[05:07:50 rank0] INFO megatron.dpp.slack_measurement: DPP slack 2: measured hop 31.2 ms = 2.9 forwards (10.8 ms); simulated speedup 1.00/1.18/1.41 at slack 0/1/2
[05:07:50 rank3] INFO megatron.trainer:  iteration        1/      10 | consumed samples: 32 | elapsed time per iteration (ms): 1444.3 | learning rate: 6.000000E-05 | global batch size:    32 | lm loss: 6.922725E+00 | loss scale: 1.0 |
[05:07:52 rank3] INFO megatron.trainer:  iteration        2/      10 | consumed samples: 64 | elapsed time per iteration (ms): 1548.4 | learning rate: 4.000000E-05 | global batch size:    32 | lm loss: 6.901632E+00 | loss scale: 1.0 |
"""


def test_the_static_plan_runs_at_the_dynamic_runs_slack():
    extra = ["--emulate-link-ms", "30"]
    assert bench_two_pods.config_flags("1f1b", None, extra) == extra
    # a schedule's flags are its own: adding to them (a traced run) leaves the others'
    bench_two_pods.config_flags("1f1b", None, extra).append("--trace")
    assert extra == ["--emulate-link-ms", "30"]
    assert bench_two_pods.config_flags("dpp", None, extra) == ["--use-dpp", *extra]
    assert bench_two_pods.config_flags("dpp-static", 2, extra) == [
        "--use-dpp", "--dpp-static", "--dpp-max-inflight", "2", *extra]


def test_dpp_flags_go_to_both_dpp_runs_only():
    extra, split = ["--emulate-straggler", "all:0.1:3"], ("--dpp-split-backward",)
    assert bench_two_pods.config_flags("1f1b", None, extra, split) == extra
    assert bench_two_pods.config_flags("dpp", None, extra, split) == [
        "--use-dpp", "--dpp-split-backward", *extra]
    assert bench_two_pods.config_flags("dpp-static", 1, extra, split) == [
        "--use-dpp", "--dpp-static", "--dpp-max-inflight", "1", "--dpp-split-backward", *extra]


def test_megatron_cores_interleaved_schedule_runs_beside_the_others_when_asked(capsys):
    extra = ["--emulate-straggler", "all:0.1:3"]
    assert bench_two_pods.schedules(False) == ("1f1b", "dpp", "dpp-static")
    assert bench_two_pods.schedules(True)[-1] == "interleaved"
    assert bench_two_pods.config_flags("interleaved", 2, extra, ("--dpp-split-backward",),
                                       interleaved=2) == [
        "--virtual-pipeline-model-parallel-size", "2", *extra]

    def run(name, round_, slack):
        text = LOG if name == "dpp" else LOG.splitlines()[1]
        return {"name": name, "ms_per_iter": 500.0 - 10 * len(name),
                "peak_mb_per_rank": [500.0, 490.0]}, text

    runs, slack, _ = bench_two_pods.run_schedules(2, run, names=bench_two_pods.schedules(True))
    assert [len(r) for r in runs.values()] == [2, 2, 2, 2]
    results = {name: bench_two_pods.median_of_runs(values) for name, values in runs.items()}
    lines = bench_two_pods.table(results, slack, "", None)
    assert lines[4].split()[:6] == ["interleaved", "390.0", "1.179x", "-", "500/490", "-"]
    assert any(line.startswith("interleaved: each stage holds other layers") for line in lines)
    # the tiny GPT's 4 layers do not split into 4 stages x 2 chunks
    with pytest.raises(SystemExit):
        bench_two_pods.main(["--out", "unused", "--pp", "4", "--interleaved", "2"])
    assert "do not split into 4 x 2 chunks of whole layers" in capsys.readouterr().err


def test_repeated_runs_give_their_median_and_a_failure_fails_the_row():
    runs = [{"name": "dpp", "ms_per_iter": t, "losses": {1: 6.9}} for t in (500.0, 420.0, 610.0)]
    merged = bench_two_pods.median_of_runs(runs)
    assert merged["ms_per_iter"] == 500.0 and merged["runs_ms"] == [500.0, 420.0, 610.0]
    failed = {"name": "dpp", "error": "exit 1"}
    assert bench_two_pods.median_of_runs([runs[0], failed]) == failed
    # the memory a row held: each rank's highest over the runs, not the first run's
    highs = ([450.0, 440.0], [460.0, 430.0], [455.0, 435.0])
    peaks = [{**run, "peak_mb_per_rank": high} for run, high in zip(runs, highs, strict=True)]
    assert bench_two_pods.median_of_runs(peaks)["peak_mb_per_rank"] == [460.0, 440.0]
    lines = bench_two_pods.table({"1f1b": {**merged, "name": "1f1b", "peak_mb_per_rank": []}},
                                 None, "", None)
    assert lines[1].endswith("runs: 500.0 420.0 610.0")


def test_the_slack_and_losses_are_read_from_the_log():
    slack, reason = bench_two_pods.chosen_slack(LOG)
    assert slack == 2 and reason.startswith("DPP slack 2: measured hop 31.2 ms")
    assert bench_two_pods.losses(LOG) == {1: 6.922725, 2: 6.901632}
    assert bench_two_pods.chosen_slack(LOG.splitlines()[1]) is None


def test_the_prediction_from_a_1f1b_trace(tmp_path, capsys):
    """A 1F1B trace of the simulator itself (a hop of 3 forwards): the prediction gives the
    traced 1F1B back exactly, plus the time outside the pipeline, and DPP at slack 2 what
    the simulator gives it on the same durations."""
    path = tmp_path / "1f1b.json"
    cost = ["--cv", "0.3", "--seed", "4", "--latency", "3"]
    simulate_main(["--pp", "4", "--microbatches", "16", *cost, "--schedules", "1f1b",
                   "--trace", str(path), "--trace-schedule", "1f1b", "--json"])
    capsys.readouterr()
    makespan = compare(4, 16, CostModel(cv=0.3, latency=3.0), seed=4,
                       schedules=("1f1b",))["1f1b"].makespan
    predicted = bench_two_pods.predict(path, 2, iteration_ms=makespan + 5.0)
    assert predicted["hop_ms"] == pytest.approx(3.0)
    assert predicted["outside_ms"] == pytest.approx(5.0)
    assert predicted["1f1b"]["iteration_ms"] == pytest.approx(makespan + 5.0)
    assert predicted["dpp"]["makespan_ms"] < 0.8 * makespan
    assert predicted["dpp-static"]["makespan_ms"] > predicted["dpp"]["makespan_ms"]
    # the bound on any schedule of the traced tasks, below every schedule's makespan
    durations = sample_durations(CostModel(cv=0.3, latency=3.0), 4, 1, 16, seed=4)
    assert predicted["bound_ms"] == pytest.approx(memory_free_bound(durations.by_kind(False),
                                                                    4, 16))
    assert predicted["bound_ms"] < predicted["dpp"]["makespan_ms"]
    results = {name: {"ms_per_iter": predicted[name]["iteration_ms"], "peak_mb_per_rank": [],
                      "losses": {}} for name in bench_two_pods.SCHEDULES}
    last = bench_two_pods.table(results, 2, "", predicted)[-1]
    ratio = predicted["dpp-static"]["makespan_ms"] / predicted["bound_ms"]
    assert last.startswith("no schedule of those tasks, at any memory, takes less than")
    assert last.endswith(f"the plan in order at slack 2 is simulated at "
                         f"{predicted['dpp-static']['makespan_ms']:.1f} ms, {ratio:.3f}x that")
    # a run that chose the plan in order: its row simulates that rule
    chosen = bench_two_pods.predict(path, 2, iteration_ms=makespan + 5.0, dpp_static=True)
    assert chosen["dpp"] == chosen["dpp-static"] == predicted["dpp-static"]


def test_the_prediction_splits_the_backward_as_the_dpp_run_did(tmp_path, capsys):
    """The W share of a traced DPP run with the split backward (the simulator's, W 30 % of
    each backward), per stage; a run without the split has none. With it the prediction
    splits each traced 1F1B backward so and simulates the DPP rows with the split, the
    dynamic rule running its pending W tasks shortest B first: exactly what the simulator
    gives on the split durations; 1F1B's row stays the traced one."""
    cost = ["--cv", "0.3", "--seed", "4", "--latency", "1", "--weight-share", "0.3",
            "--split-backward"]
    for name in ("1f1b", "dpp"):
        simulate_main(["--pp", "4", "--microbatches", "16", *cost, "--schedules", name,
                       "--trace", str(tmp_path / f"{name}.json"), "--trace-schedule", name,
                       "--json"])
    capsys.readouterr()
    shares = bench_two_pods.weight_shares(tmp_path / "dpp.json")
    assert shares == pytest.approx([0.3] * 4)
    assert bench_two_pods.weight_shares(tmp_path / "1f1b.json") is None
    model = CostModel(cv=0.3, latency=1.0, weight_share=0.3)
    durations = sample_durations(model, 4, 1, 16, seed=4, split_backward=True)
    whole = bench_two_pods.predict(tmp_path / "1f1b.json", 2, iteration_ms=0.0)
    split = bench_two_pods.predict(tmp_path / "1f1b.json", 2, iteration_ms=0.0, shares=shares)
    assert split["1f1b"] == whole["1f1b"]
    for name in ("dpp", "dpp-static"):
        expected = simulate(name, 4, 16, durations, slack=2, latency=1.0, split_backward=True,
                            weights_by_backward=True).makespan
        assert split[name]["makespan_ms"] == pytest.approx(expected)
        assert whole[name]["makespan_ms"] != pytest.approx(expected)
    results = {name: {"ms_per_iter": 1.0, "peak_mb_per_rank": [], "losses": {}}
               for name in bench_two_pods.SCHEDULES}
    assert ("each backward split into B and W at the DPP run's W share, 30/30/30/30 % by "
            "stage") in "\n".join(bench_two_pods.table(results, 2, "", split))
    from megatron.dpp.slack_choice import SlackChoice

    def slack_line(static: bool) -> str:
        gain = 1.002 if static else 1.05
        return SlackChoice(1, {0: 10.0, 1: 9.0}, 1.0, 5.0, None, None, None, 2, static,
                           plan_ms={0: 10.0, 1: 9.0 * gain}).line()

    assert bench_two_pods.PLAN_CHOSEN in slack_line(static=True)
    assert bench_two_pods.PLAN_CHOSEN not in slack_line(static=False)


def test_the_table_names_ratios_and_failures():
    results = {
        "1f1b": {"ms_per_iter": 600.0, "peak_mb_per_rank": [500.0, 490.0], "losses": {1: 6.9}},
        "dpp": {"ms_per_iter": 400.0, "peak_mb_per_rank": [510.0, 495.0], "losses": {1: 6.9}},
        "dpp-static": {"name": "dpp-static", "error": "exit 1"},
    }
    lines = bench_two_pods.table(results, 2, "DPP slack 2: why", None)
    assert lines[1].split()[:3] == ["1f1b", "600.0", "1.000x"]
    assert lines[2].split() == ["dpp", "400.0", "1.500x", "2", "510/495", "yes"]
    assert lines[3] == "dpp-static   FAILED (exit 1)"
    assert lines[-1] == "DPP slack 2: why"


def test_the_prediction_under_an_emulated_link_draws_each_messages_hop(tmp_path, capsys):
    """A 1F1B trace of the simulator under a jittery link (30 ms + U(0, 20) ms on every
    edge, seed 4): fed the same link and seed, the prediction draws each message's own hop
    and gives the traced 1F1B back exactly; a median hop for every message does not."""
    path = tmp_path / "1f1b.json"
    link = ["--emulate-link-ms", "30,20", "--emulate-link-edges", "all", "--seed", "4"]
    simulate_main(["--pp", "4", "--microbatches", "16", "--cv", "0.3", *link,
                   "--schedules", "1f1b", "--trace", str(path), "--trace-schedule", "1f1b",
                   "--json"])
    capsys.readouterr()
    emulation = bench_two_pods.emulation_of(["--use-dpp", *link])
    assert emulation.seed == 4 and emulation.link.jitter_ms == 20.0
    cost = CostModel(forward=10.0, cv=0.3, link=emulation.link)
    makespan = compare(4, 16, cost, seed=4, schedules=("1f1b",))["1f1b"].makespan
    drawn = bench_two_pods.predict(path, 2, makespan, emulation, message_bytes=0)
    assert drawn["1f1b"]["makespan_ms"] == pytest.approx(makespan)
    assert "link 30 ms + U(0, 20) ms on every pipeline edge" in bench_two_pods.table(
        {}, 2, "", drawn)[-2]
    flat = bench_two_pods.predict(path, 2, makespan)
    assert abs(flat["1f1b"]["makespan_ms"] / makespan - 1) > 0.01
    assert bench_two_pods.emulation_of([]).link is None
    assert bench_two_pods.emulation_of([]).seed == bench_two_pods.TRAINER_SEED


def test_losses_equal_exactly_or_within_the_tests_tolerance_or_not():
    reference = {1: 6.948030, 2: 6.870213}
    assert bench_two_pods.same_losses(dict(reference), reference) == "yes"
    # a float sum in another order: the last printed digit
    assert bench_two_pods.same_losses({1: 6.948030, 2: 6.870214}, reference) == "~1e-07"
    assert bench_two_pods.same_losses({1: 6.948030, 2: 6.9}, reference) == "NO"
    assert bench_two_pods.same_losses({1: 6.948030}, reference) == "NO"


def test_each_rounds_static_plan_runs_at_that_rounds_chosen_slack():
    """Rounds whose dynamic runs choose slack 2, then 1: each static plan gets its round's
    slack, the rows say 1-2, and a round whose dynamic run logged none runs no static plan."""
    chosen = iter([2, 1, None])
    asked = []

    def run(name, round_, slack):
        asked.append((name, round_, slack))
        text = LOG.splitlines()[1]
        if name == "dpp":
            found = next(chosen)
            if found is not None:
                text = LOG.replace("DPP slack 2", f"DPP slack {found}")
        return {"name": name, "ms_per_iter": 500.0 + round_, "peak_mb_per_rank": []}, text

    runs, slack, reason = bench_two_pods.run_schedules(3, run)
    assert asked == [("1f1b", 0, None), ("dpp", 0, None), ("dpp-static", 0, 2),
                     ("1f1b", 1, None), ("dpp", 1, None), ("dpp-static", 1, 1),
                     ("1f1b", 2, None), ("dpp", 2, None)]
    assert slack == 2 and reason.endswith("; run 2 chose slack 1")
    assert runs["dpp-static"][2] == {"name": "dpp-static",
                                     "error": "the dynamic run logged no slack"}
    first_two = {name: bench_two_pods.median_of_runs(values[:2]) for name, values in runs.items()}
    assert first_two["dpp"]["slack"] == first_two["dpp-static"]["slack"] == "1-2"
    lines = bench_two_pods.table(first_two, slack, reason, None)
    assert lines[2].split()[3] == lines[3].split()[3] == "1-2"
    assert lines[4] == "dpp / dpp-static at slack 1-2: 1.000x"


def test_each_traced_dpp_run_against_the_in_order_bound_of_its_tasks(tmp_path, monkeypatch,
                                                                       capsys):
    """The rule's and the plan in order's traces (the simulator's, a slow last stage with
    stragglers): each gap is the run's makespan over the in-order bound of its own tasks at
    the slack's memory with the W tasks in order too (as both ran them), at least 1, and the
    table's last line names both."""
    traces = {}
    for name in ("dpp", "dpp-static"):
        traces[name] = tmp_path / f"{name}.json"
        simulate_main(["--pp", "4", "--microbatches", "16", "--slack", "2", "--split-backward",
                       "--weight-share", "0.2", "--slow-stage", "3", "--slow-factor", "1.5",
                       "--emulate-straggler", "all:0.1:3", "--schedules", name, "--trace",
                       str(traces[name]), "--trace-schedule", name])
    capsys.readouterr()
    monkeypatch.setattr(bench_two_pods, "trace_dir", lambda out, name: traces[name])
    gaps = bench_two_pods.in_order_gaps(tmp_path)
    for name, path in traces.items():
        (row,) = sim_compare.compare(str(path), "dpp", 2)["iterations"]
        assert gaps[name] == pytest.approx(row["measured_makespan_ms"]
                                           / row["weights_in_order_bound_ms"])
        assert gaps[name] >= 1.0
    results = {name: {"ms_per_iter": 100.0, "peak_mb_per_rank": [], "losses": {}}
               for name in bench_two_pods.SCHEDULES}
    predicted = {"hop_ms": 0.1, "iterations": 1, "outside_ms": 0.0, "bound_ms": 90.0,
                 "link": None, "in_order_gaps": gaps,
                 **{name: {"makespan_ms": 95.0, "iteration_ms": 95.0}
                    for name in bench_two_pods.SCHEDULES}}
    last = bench_two_pods.table(results, 2, "", predicted)[-1]
    assert last.endswith(f"dpp {gaps['dpp']:.3f}x, dpp-static {gaps['dpp-static']:.3f}x")


def test_a_given_slack_runs_the_dynamic_rule_against_the_plan_at_it():
    extra = ["--emulate-straggler", "all:0.1:3"]
    assert bench_two_pods.config_flags("dpp", 2, extra, forced=True) == [
        "--use-dpp", "--no-dpp-static", "--dpp-max-inflight", "2", *extra]
    assert bench_two_pods.config_flags("dpp-static", 2, extra, forced=True) == [
        "--use-dpp", "--dpp-static", "--dpp-max-inflight", "2", *extra]
    asked = []

    def run(name, round_, slack):
        asked.append((name, slack))
        # a run at a given slack logs no choice
        return {"name": name, "ms_per_iter": 500.0, "peak_mb_per_rank": []}, ""

    runs, slack, reason = bench_two_pods.run_schedules(2, run, forced=2)
    assert asked == [("1f1b", 2), ("dpp", 2), ("dpp-static", 2)] * 2
    assert slack == 2 and "given" in reason
    assert [r["slack"] for r in runs["dpp"] + runs["dpp-static"]] == [2] * 4
    assert bench_two_pods.PLAN_CHOSEN not in reason


def _write_run(folder, label, times, slack=None):
    """A run's log as the trainer writes it: a slack line (dynamic runs), one line an
    iteration with its time and loss, a memory line."""
    lines = [] if slack is None else [f"[00:00:00 rank0] INFO x: DPP slack {slack}: chosen"]
    lines += [f"[00:00:0{i} rank3] INFO megatron.trainer:  iteration {i + 1:8d}/{len(times):8d} "
              f"| elapsed time per iteration (ms): {t} | tokens/s: 4453 | lm loss: 6.9E+00 |"
              for i, t in enumerate(times)]
    lines.append("[00:00:09 rank3] INFO megatron.trainer: memory per rank (max RSS, MB): "
                 "0: 445.7 | 1: 440.0")
    (folder / f"{label}.log").write_text("\n".join(lines) + "\n")


def test_the_table_of_rounds_already_logged_pools_folders_and_leaves_partial_rounds_out(
        tmp_path, capsys):
    """Two folders of side-by-side benchmarks: the first holds two whole rounds and a third
    stopped mid-run, the second one whole round. The table pools the three whole rounds
    (medians of the measured iterations, each round's plan at its dynamic run's slack) and
    names a folder with none."""
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    for folder, rounds in ((first, [(500, 450, 460, 2), (520, 470, 480, 1)]),
                           (second, [(540, 490, 500, 2)])):
        for round_, (one_f_one_b, dpp, plan, slack) in enumerate(rounds):
            suffix = "" if round_ == 0 else f"-{round_ + 1}"
            # iteration 1 is the warm-up left out: its time must not count
            _write_run(folder, f"1f1b{suffix}", [9999, one_f_one_b, one_f_one_b + 2])
            _write_run(folder, f"dpp{suffix}", [9999, dpp, dpp + 2], slack)
            _write_run(folder, f"dpp-static{suffix}", [9999, plan, plan + 2])
    _write_run(first, "1f1b-3", [9999, 100, 100])
    _write_run(first, "dpp-3", [9999, 100], 2)  # stopped before its last iteration
    assert bench_two_pods.logged_rounds([first, second], 3) == [(first, 0), (first, 1),
                                                                 (second, 0)]
    out = tmp_path / "pooled"
    code = bench_two_pods.main(["--tabulate", str(first), str(second), "--warmup", "1",
                                "--iters", "2", "--out", str(out)])
    lines = capsys.readouterr().out.splitlines()
    assert code == 0 and (out / "table.txt").read_text().splitlines() == lines
    rows = {line.split()[0]: line for line in lines[1:4]}
    assert rows["1f1b"].split()[1] == "521.0"
    assert rows["1f1b"].endswith("runs: 501.0 521.0 541.0")
    assert rows["dpp"].split()[1:4] == ["471.0", "1.106x", "1-2"]
    assert rows["dpp-static"].endswith("runs: 461.0 481.0 501.0")
    assert lines[4] == "dpp / dpp-static at slack 1-2: 1.021x"
    # within each round: 501/451, 521/471, 541/491 over 1F1B; 461/451, ... over the plan
    assert lines[5] == ("dpp per round: over 1f1b median 1.106x mean 1.106x; over dpp-static "
                        "median 1.021x mean 1.021x sd 0.001")
    assert lines[6].endswith("; run 2 chose slack 1")
    with pytest.raises(SystemExit):
        bench_two_pods.main(["--tabulate", str(tmp_path / "empty")])
    assert "no whole round" in capsys.readouterr().err
    # options that shape runs would be ignored: refused by name
    with pytest.raises(SystemExit):
        bench_two_pods.main(["--tabulate", str(first), "--repeat", "3", "--simulate"])
    assert "--tabulate runs nothing: --simulate --repeat would not apply" in (
        capsys.readouterr().err)
