"""profiling/bench_scenarios.py: the scenarios file resolves (every layout and baseline it
names exists), a broken one is refused naming the scenario, and the table divides by the
baselines that ran."""

from __future__ import annotations

import pytest

from profiling import bench_scenarios


def test_every_scenario_resolves():
    scenarios = bench_scenarios.load()
    assert scenarios["pp4-dpp"]["flags"][-1] == "--use-dpp"
    assert scenarios["pp4-dpp"]["flags"][:4] == ["--num-layers", "22",
                                                 "--decoder-last-pipeline-num-layers", "4"]
    for scenario in scenarios.values():
        assert scenario["gpus"] % scenario["pp"] == 0


def test_a_missing_layout_or_baseline_is_named(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('[scenario.a]\nlayout = "nowhere"\n')
    with pytest.raises(ValueError, match="scenario a names layout 'nowhere'"):
        bench_scenarios.load(path)
    path.write_text('[layout.l]\ngpus = 2\npp = 2\nmicrobatches = 4\n'
                    '[scenario.a]\nlayout = "l"\nbaselines = ["b"]\n')
    with pytest.raises(ValueError, match="scenario a divides by unknown scenarios"):
        bench_scenarios.load(path)


def test_table_divides_by_the_baselines_that_ran():
    scenarios = {"base": {"baselines": []}, "new": {"baselines": ["base", "absent"]}}
    results = [{"name": "base", "ms_per_iter": 100.0, "tokens_per_s": 1000.0,
                "mfu_percent": 50.0, "peak_mb": 10.0},
               {"name": "new", "ms_per_iter": 80.0, "tokens_per_s": 1250.0,
                "mfu_percent": 60.0, "peak_mb": 10.0, "transports": ["shm"]}]
    table = bench_scenarios.format_table(results, scenarios)
    assert "1.250x base" in table and "absent" not in table and "shm" in table
    assert bench_scenarios.transports("x\nDPP transport shm for edges 0->1:A\n") == ["shm"]
