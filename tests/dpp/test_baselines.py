"""`python -m megatron.dpp.sim.baselines`: DPP against 1F1B and ZB-H1 fed the same order, with
each rank's memory, for both placements of the W tasks."""

from __future__ import annotations

import pytest

from megatron.dpp.plan import StageConfig, static_order
from megatron.dpp.policy import microbatch_order_for
from megatron.dpp.sim.baselines import compare_one, main
from megatron.dpp.sim.simulator import CostModel, replay, sample_durations


def _row(text: str, p: int) -> list[str]:
    (line,) = [line for line in text.splitlines() if line.startswith(f"| {p} | {4 * p} |")]
    return [cell.strip() for cell in line.strip("|").split("|")]


@pytest.mark.parametrize(("flags", "placement", "dpp_held"), [
    ([], "W each after its B", "4 3 2 1"),
    (["--defer-weights"], "W deferred as ZB-H1 defers them", "4 4 4 4"),
])
def test_each_ranks_microbatches_follow_the_w_placement(capsys, flags, placement, dpp_held):
    main(["--pp", "4", "--cv", "0.5", "--seeds", "2", *flags])
    out = capsys.readouterr().out
    assert placement in out.splitlines()[0]
    held = _row(out, 4)[5].split(" / ")
    assert held == ["4 3 2 1", "4 3 2 1", "4 4 4 4", dpp_held]


def test_without_deferral_dpp_at_slack_0_is_its_plans_replay():
    """Each W after its B, slack 0: the caps leave the rule no choice, so DPP runs its plan
    as the static replay does, holding 1F1B's microbatches and tokens per rank."""
    p, m = 4, 16
    for seed in range(3):
        cells = compare_one(p, 0.5, 0, seed, defer_weights=False)
        assert cells["dpp"]["held"] == cells["1f1b ordered"]["held"] == [4, 3, 2, 1]
        assert cells["dpp"]["held_cost"] == pytest.approx(cells["1f1b ordered"]["held_cost"])
        assert cells["dpp"]["makespan"] < cells["1f1b ordered"]["makespan"]
        durations = sample_durations(CostModel(cv=0.5), p, 1, m, seed, split_backward=True)
        order = microbatch_order_for(StageConfig(0, p, 1, m, split_backward=True),
                                     list(durations.microbatch_factor))
        plans = [static_order(StageConfig(r, p, 1, m, split_backward=True,
                                          defer_weights=False), order) for r in range(p)]
        assert cells["dpp"]["makespan"] == pytest.approx(replay(plans, durations).makespan)
