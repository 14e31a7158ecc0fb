"""megatron/dpp/sim/exact.py and the simulator's --exact: the shortest schedule that keeps each
stage's F, B and W tasks in the microbatch order at a given memory, by OR-tools' CP-SAT (an
optional package: without it the flag is refused with a line naming it)."""

from __future__ import annotations

import json
import sys

import pytest

from megatron.dpp.sim.bounds import in_order_bound, sums_in_order
from megatron.dpp.sim.exact import ExactSolverMissing, shortest_in_order
from megatron.dpp.sim.simulate import main
from megatron.dpp.sim.simulator import CostModel, Durations, sample_durations, simulate
from megatron.dpp.variability import StragglerProfile

FLAGS = ["--pp", "3", "--microbatches", "6", "--split-backward", "--slack", "1",
         "--forward-ms", "4", "--emulate-straggler", "all:0.3:3", "--schedules", "1f1b", "dpp"]


def _without_ortools(monkeypatch):
    monkeypatch.setitem(sys.modules, "ortools", None)  # `import ortools` raises ImportError
    monkeypatch.setitem(sys.modules, "ortools.sat.python", None)


def test_without_ortools_the_flag_is_refused_naming_it(monkeypatch, capsys):
    _without_ortools(monkeypatch)
    with pytest.raises(SystemExit):
        main([*FLAGS, "--exact", "5"])
    assert "--exact needs OR-tools (pip install ortools" in capsys.readouterr().err
    times = {"F": [[1.0]], "B": [[2.0]], "W": [[1.0]]}
    with pytest.raises(ExactSolverMissing, match="pip install ortools"):
        shortest_in_order(times, 1, 1, [1])


@pytest.mark.parametrize("flags, named", [
    (["--pp", "2", "--microbatches", "4"], "--split-backward"),
    ([*FLAGS, "--cores", "2"], "--cores"),
    ([*FLAGS, "--emulate-link-ms", "5"], "--emulate-link-ms"),
    ([*FLAGS, "--latency", "0.5"], "--latency"),
])
def test_what_the_exact_model_leaves_out_is_refused(flags, named, capsys):
    with pytest.raises(SystemExit):
        main([*flags, "--exact", "5"])
    err = capsys.readouterr().err
    assert "--exact schedules one chunk a rank with the split backward" in err and named in err


def test_a_time_limit_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        main([*FLAGS, "--exact", "0"])
    assert "--exact must be > 0 seconds, got 0.0" in capsys.readouterr().err


def test_the_shortest_in_order_schedule_of_a_hand_computed_case():
    """The bounds' two-rank case (rank 1 holds two, its W(0) 6, rank 0's last B and W 5 + 1):
    with the W tasks in order nothing beats 39 (the bound), and DPP's rule takes 39."""
    pytest.importorskip("ortools", reason="OR-tools is optional (pip install ortools)")
    durations = Durations(forward=[[1.0] * 4, [2.0] * 4], backward=[[5.0] * 4, [4.0] * 4],
                          microbatch_factor=[1.0] * 4,
                          weight=[[1.0] * 4, [6.0, 2.0, 2.0, 2.0]])
    times = durations.by_kind(split_backward=True)
    result = shortest_in_order(times, 2, 4, [3, 2], seconds=30)
    assert result.proven and result.makespan == pytest.approx(39)
    # holding one microbatch a rank, each microbatch's chain F F B B W ends before the next
    # one's F (rank 1's W runs beside rank 0's B): 4 x (1 + 2 + 4 + 5 + 1)
    assert shortest_in_order(times, 2, 4, [1, 1], seconds=30).makespan == pytest.approx(52)


def test_the_shortest_lies_between_the_bound_and_every_in_order_schedule_and_the_cli_says_so(
        capsys):
    """Stragglers on three ranks, six microbatches, three draws: for 1F1B and DPP's rule and
    plan at slack 0-2 (each kept its W tasks in order) the proven shortest schedule at the
    memory each held lies between the in-order bound with W in order and the schedule's own
    makespan; the simulator's line gives the mean and each row's ratio to it."""
    pytest.importorskip("ortools", reason="OR-tools is optional (pip install ortools)")
    model = CostModel(forward=4.0, straggler=StragglerProfile.parse("all:0.3:3"),
                      weight_share=0.3)
    p, m = 3, 6
    for iteration in range(3):
        durations = sample_durations(model, p, 1, m, 0, True, iteration)
        times = durations.by_kind(split_backward=True)
        runs = [simulate("1f1b", p, m, durations, record=True)]
        runs += [simulate(name, p, m, durations, slack=slack, split_backward=True, record=True,
                          defer_weights=False)
                 for name in ("dpp", "dpp-static") for slack in (0, 1, 2)]
        for run in runs:
            assert sums_in_order(run.orders, list(range(m)))
            result = shortest_in_order(times, p, m, run.peak_in_flight, seconds=30)
            bound = in_order_bound(times, p, m, run.peak_in_flight, weights_in_order=True)
            assert result.proven
            assert bound - 1e-6 <= result.makespan <= run.makespan + 1e-6
    main([*FLAGS, "--iterations", "2", "--exact", "30", "--json"])
    report = json.loads(capsys.readouterr().out)["schedules"]
    for entry in report.values():
        assert entry["exact_proven"] == 2
        assert (entry["weights_in_order_bound"] - 1e-6 <= entry["exact_in_order"]
                <= entry["makespan"] + 1e-6)
    main([*FLAGS, "--iterations", "2", "--exact", "30"])
    last = capsys.readouterr().out.splitlines()[-1]
    dpp = report["dpp"]
    assert last.startswith("the shortest of them at the row's memory, knowing every task time")
    assert last.endswith(f"dpp {dpp['exact_in_order']:.2f} (it took "
                         f"{dpp['makespan'] / dpp['exact_in_order']:.3f}x)")
