"""profiling/sim_compare.py: replaying a simulator trace's own durations through the same
schedule reproduces its bubble exactly (durations, latency and schedule rebuilt right);
a different schedule, slack or latency does not; a real PP=2 CPU run compares within a
loose bound."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from megatron.dpp.simulate import main as simulate_main
from profiling import sim_compare
from tests.distributed import run_ranks
from tests.trainer_runs import TINY, train_runs, with_flags

COST = ["--cv", "0.5", "--jitter", "0.2", "--seed", "5"]


def simulated_trace(tmp_path, schedule, pp=4, microbatches=12, chunks=1, slack=2,
                    latency=0.0) -> str:
    """A Chrome trace written by `python -m megatron.dpp.simulate --trace` (random costs)."""
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
    assert result["schedule"] == "dpp" and result["slack"] == sim_compare.DEFAULT_SLACK
    assert [row["stage"] for row in result["mean"]] == [0, 1, 2, 3]
    assert sim_compare.main([path, "--schedule", "dpp"]) == 0
    table = capsys.readouterr().out
    assert "simulated schedule: dpp slack 2" in table and table.count("+0.00") == 4
    with pytest.raises(SystemExit):  # a simulator trace has no header naming its schedule
        sim_compare.main([path])
    assert "give --schedule" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        sim_compare.main([path, "--schedule", "interleaved"])  # the trace has one chunk
    assert "interleaved needs num_chunks >= 2" in capsys.readouterr().err
    # the copied default must follow the runtime's
    source = Path("megatron/dpp/schedule.py").read_text()
    assert re.search(rf"^DEFAULT_SLACK = {sim_compare.DEFAULT_SLACK}$", source, re.M)


MICROBATCHES = 4
RUN = with_flags(TINY, pipeline_model_parallel_size=2, global_batch_size=2 * MICROBATCHES,
                 train_iters=3, trace=True, trace_iters=[2, 3])


def test_real_pp2_runs(tmp_path):
    """A DPP and a 1F1B CPU run (one pair of processes): the schedule comes from the
    header, and the simulator's bubble is near the measured one. CPU stages idle on host
    work outside the spans (data, sends), so the bound is loose."""
    dirs = {name: str(tmp_path / name) for name in ("dpp", "1f1b")}
    flags = [with_flags(RUN, trace_dir=dirs["dpp"], use_dpp=True, dpp_transport="torch",
                        dpp_max_inflight=1),
             with_flags(RUN, trace_dir=dirs["1f1b"])]
    run_ranks(2, train_runs, flags, 2)
    for name, directory in dirs.items():
        result = sim_compare.compare(directory)
        assert result["schedule"] == name
        assert result["slack"] == (1 if name == "dpp" else 0)  # the header's --dpp-max-inflight
        assert [row["iteration"] for row in result["iterations"]] == [2, 3]
        for iteration in result["iterations"]:
            assert iteration["latency_samples"] > 0
            for row in iteration["stages"]:
                assert abs(row["difference_pp"]) < 25.0, (name, iteration)
