"""`profiling/report.py --costs`: each stage's task times from a trace, a W run in parts
counted whole, and the simulator's cost flags fitted to them, checked on traces of the
simulator itself, whose cost model is known."""

from __future__ import annotations

import json

import pytest

from megatron.dpp.sim.simulate import main as simulate_main
from profiling import report

MODEL = ["--forward-ms", "5", "--backward-ratio", "1.2", "--weight-share", "0.3",
         "--slow-stage", "3", "--slow-factor", "1.5"]


def _trace(tmp_path, schedule: str, *flags: str) -> str:
    path = str(tmp_path / f"{schedule}.json")
    simulate_main(["--pp", "4", "--microbatches", "8", *MODEL, *flags, "--schedules", schedule,
                   "--trace", path, "--trace-schedule", schedule, "--json"])
    return path


def test_the_fitted_flags_are_the_model_that_made_the_trace(tmp_path, capsys):
    """DPP with the split backward runs each W in parts; the flags fitted at either quantile
    give back the model (every task at its cost: no spread), and the table lists each W
    whole (0.3 of 1.2 forwards: 1.8 ms on the fast stages)."""
    path = _trace(tmp_path, "dpp", "--split-backward")
    capsys.readouterr()
    assert report.main([path, "--costs"]) == 0
    text = capsys.readouterr().out
    expected = ("--forward-ms 5.00 --backward-ratio 1.20 --split-backward --weight-share 0.30 "
                "--slow-stage 3 --slow-factor 1.50")
    assert f"at each stage's 10th percentile: {expected}" in text
    assert f"at each stage's median: {expected}" in text
    assert "1.80/1.80/1.80" in text.splitlines()[3]
    assert report.main([path, "--costs", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["task_ms"]["0"]["weight"] == pytest.approx([1.8] * 8)
    assert result["flags"]["median"] == expected


def test_a_whole_backward_and_even_stages_fit_without_the_split_or_a_slow_stage(tmp_path,
                                                                                capsys):
    path = _trace(tmp_path, "1f1b")
    capsys.readouterr()
    assert report.main([path, "--costs"]) == 0
    text = capsys.readouterr().out
    assert ("median: --forward-ms 5.00 --backward-ratio 1.20 --slow-stage 3 --slow-factor "
            "1.50") in text
    costs = report.task_costs(report.load_spans(report.load_trace(path))[0])
    even = {stage: costs[0] for stage in costs}
    assert report.cost_flags(even, 0.5) == "--forward-ms 5.00 --backward-ratio 1.20"
