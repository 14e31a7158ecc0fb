"""Choosing DPP's slack from measurements (megatron/dpp/slack_choice.py) and combining the
ranks' measurements (megatron/dpp/slack_measurement.py): slack 0 on a calm link, more under
latency, capped by the memory budget; message times across hosts with offset clocks; CPU
ranks that share cores."""

from __future__ import annotations

import argparse
import re

import pytest

from megatron.dpp.actions import Task
from megatron.dpp.config import DppOptions, MemoryBudget
from megatron.dpp.slack_choice import (
    SLACK_TOLERANCE,
    Measured,
    busiest_1f1b_bytes,
    choose_slack,
    held_bytes,
)
from megatron.dpp.slack_measurement import measured_from, shared_cores


def measured(p: int, hop_ms: float, forward_ms: float = 10.0,
             activation: tuple[float, ...] | None = None) -> Measured:
    return Measured((forward_ms,) * p, (2 * forward_ms,) * p, (hop_ms,) * p,
                    activation_bytes=activation)


def test_a_calm_link_gets_slack_0_and_latency_more():
    calm = choose_slack(measured(4, 0.2), 4, 16)
    assert calm.slack == 0 and sorted(calm.simulated_ms) == [0, 1, 2]
    slow = choose_slack(measured(4, 30.0), 4, 16)
    assert slow.slack == 2
    speedups = [slow.simulated_ms[0] / slow.simulated_ms[s] for s in (0, 1, 2)]
    assert speedups == pytest.approx([1.0, 1.18, 1.42], abs=0.01)
    assert slow.line().startswith("DPP slack 2: measured hop 30.0 ms = 3.0 forwards")
    assert "at slack 0/1/2: the dynamic rule 1.00/1.18/1.42 (" in slow.line()
    # half a forward already pays for slack
    assert choose_slack(measured(4, 5.0), 4, 16).slack > 0
    # the plan in order is simulated as such: it gains less at the same slack
    static = choose_slack(measured(4, 30.0), 4, 16, static=True)
    assert static.simulated_ms[2] > slow.simulated_ms[2]


def test_the_rule_left_open_is_the_dynamic_one_only_where_it_gains():
    """static=None: on a slow link the dynamic rule, by more than the tolerance over the
    plan in order at any slack; on a calm link with every task at its median, the plan in
    order at slack 0 (the dynamic rule gains nothing there)."""
    slow = choose_slack(measured(4, 30.0), 4, 16, static=None)
    dynamic = choose_slack(measured(4, 30.0), 4, 16)
    in_order = choose_slack(measured(4, 30.0), 4, 16, static=True)
    assert not slow.static and slow.slack == dynamic.slack == 2
    assert slow.plan_ms == in_order.simulated_ms and slow.simulated_ms == dynamic.simulated_ms
    assert slow.rule_gain == pytest.approx(in_order.simulated_ms[2] / dynamic.simulated_ms[2])
    assert min(slow.plan_ms.values()) > (1 + SLACK_TOLERANCE) * slow.simulated_ms[2]
    assert "the dynamic rule runs" in slow.line()
    assert "at slack 0/1/2: the dynamic rule 1.00/" in slow.line()
    assert ", the plan in order 1.00/1.12/1.27 (" in slow.line()
    calm = choose_slack(measured(4, 0.2), 4, 16, static=None)
    assert calm.static and calm.slack == 0
    assert "the plan in order runs" in calm.line()
    assert dynamic.rule_gain is None and "the plan in order runs" not in dynamic.line()


@pytest.mark.parametrize("hop_ms,spread,cores", [
    (0.7, (1.0,) * 90 + (3.0,) * 10, None), (0.7, (1.0,) * 90 + (3.0,) * 10, 2.0),
    (5.0, None, None), (12.0, (0.8, 1.0, 1.0, 1.3), None), (0.2, None, None)])
def test_the_rule_left_open_takes_the_first_candidate_near_the_fastest(hop_ms, spread, cores):
    """Of (slack 0, the plan in order), (slack 0, the dynamic rule), (slack 1, the plan in
    order), ...: the first within the tolerance of the fastest of them all, whatever the
    costs (the straggler model's, a slow link, a spread, a calm pipeline)."""
    forward = (4.8, 4.8, 4.8, 7.3)
    costs = Measured(forward, tuple(0.73 * f for f in forward), (hop_ms,) * 4,
                     weight_ms=tuple(0.13 * f for f in forward), cost_spread=spread,
                     shared_cores=cores)
    choice = choose_slack(costs, 4, 16, split_backward=True, static=None)
    candidates = [(slack, plan, (choice.plan_ms if plan else choice.simulated_ms)[slack])
                  for slack in sorted(choice.simulated_ms) for plan in (True, False)]
    within = (1 + SLACK_TOLERANCE) * min(time for _, _, time in candidates)
    first = next((slack, plan) for slack, plan, time in candidates if time <= within)
    assert (choice.slack, choice.static) == first


def test_straggling_tasks_measured_buy_slack_on_a_calm_link():
    """One task in ten three times its median (--emulate-straggler all:0.1:3 as the first
    iterations measure it): on a calm link the spread alone makes slack pay; every task at
    its median leaves slack 0."""
    spread = (1.0,) * 90 + (3.0,) * 10
    straggling = Measured((10.0,) * 4, (20.0,) * 4, (0.2,) * 4, cost_spread=spread)
    choice = choose_slack(straggling, 4, 16)
    assert choice.slack > 0
    assert choice.simulated_ms[0] / choice.simulated_ms[choice.slack] > 1.03
    assert "task costs up to 3.00x their median (p95)" in choice.line()
    assert choose_slack(straggling, 4, 16) == choice  # seeded: the same decision again
    uniform = Measured((10.0,) * 4, (20.0,) * 4, (0.2,) * 4, cost_spread=(1.0,) * 100)
    assert choose_slack(uniform, 4, 16).slack == 0


def test_forced_maximum_and_split_backward():
    assert sorted(choose_slack(measured(4, 30.0), 4, 16, max_slack=1).simulated_ms) == [0, 1]
    split = Measured((10.0,) * 4, (13.0,) * 4, (30.0,) * 4, weight_ms=(7.0,) * 4)
    assert choose_slack(split, 4, 16, split_backward=True, weight_slices=4).slack == 2
    with pytest.raises(ValueError, match="needs measured W times"):
        choose_slack(measured(4, 30.0), 4, 16, split_backward=True)
    with pytest.raises(ValueError, match="edge times for 4 ranks"):
        choose_slack(Measured((10.0,) * 4, (20.0,) * 4, (1.0,) * 3), 4, 16)


def test_the_memory_budget_caps_the_slack():
    equal = (1e6,) * 4
    # 1F1B's busiest stage (rank 0) holds 4 microbatches; at slack 1 it holds 5 > 4.6
    capped = choose_slack(measured(4, 30.0, activation=equal), 4, 16,
                          budget=MemoryBudget.parse("1.15x"))
    assert capped.slack == 0 and sorted(capped.simulated_ms) == [0]
    assert "caps the slack at 0" in capped.line()
    assert "activations held per stage 4.0/3.0/2.0/1.0 MB" in capped.line()
    # at p = 8: 8 * 1.15 = 9.2 leaves room for one more
    assert choose_slack(measured(8, 30.0), 8, 32, budget=MemoryBudget.parse("1.15x")).slack == 1
    # a size per stage: 5.5 MB lets rank 0 hold 5 microbatches of 1 MB, not 6
    sized = choose_slack(measured(4, 30.0, activation=equal), 4, 16,
                         budget=MemoryBudget.parse("5.5MB"))
    assert sized.slack == 1 and max(sized.held_bytes) == 5e6
    # a last stage with large activations (the logits) is what the budget meets first
    heavy_last = (1e6, 1e6, 1e6, 4e6)
    assert busiest_1f1b_bytes(measured(4, 0, activation=heavy_last), 4, 16) == 4e6
    assert held_bytes(measured(4, 0, activation=heavy_last), 4, 16, 2) == [6e6, 5e6, 4e6, 12e6]
    with pytest.raises(ValueError, match="needs measured activation bytes"):
        choose_slack(measured(4, 30.0), 4, 16, budget=MemoryBudget.parse("1GB"))


@pytest.mark.parametrize("text, expected", [
    ("1.15x", MemoryBudget(factor=1.15)), ("12GB", MemoryBudget(limit_bytes=12e9)),
    ("800 MB", MemoryBudget(limit_bytes=8e8)), ("2GiB", MemoryBudget(limit_bytes=2 ** 31))])
def test_memory_budgets_parse(text, expected):
    assert MemoryBudget.parse(text) == expected


@pytest.mark.parametrize("text", ["lots", "1.15", "-2GB", "0x"])
def test_a_bad_memory_budget_is_named(text):
    with pytest.raises(ValueError, match="memory budget"):
        MemoryBudget.parse(text)


def test_the_trainers_flags_choose_or_force_the_slack():
    def options(**flags):
        return DppOptions.from_args(argparse.Namespace(**flags))

    assert (options().adaptive, options().slack, options().static) == (True, 2, None)
    forced = options(dpp_max_inflight=1)
    assert (forced.adaptive, forced.slack, forced.static) == (False, 1, False)
    assert options(dpp_static=True).static and options(dpp_static=False).static is False
    with pytest.raises(ValueError, match="chooses its rule"):
        DppOptions(static=None)
    assert options(dpp_memory_budget="1.15x").budget == MemoryBudget(factor=1.15)
    with pytest.raises(ValueError, match="a forced slack"):
        options(dpp_max_inflight=1, dpp_memory_budget="1.15x")


def _summary(stage: int, sent: dict, seen: dict, saved: float | None = None) -> dict:
    return {"ranks": (10, 11), "stage": stage, "chunks": 1,
            "task_ms": {("F", 0): 10.0 + stage, ("B", 0): 20.0 + stage},
            "saved_bytes": saved, "spread": [], "sent": [sent], "seen": [seen]}


def test_message_times_across_hosts_cancel_the_clock_offset():
    """Stage 1's clock runs 100 s ahead; every message takes 30 ms. Each direction alone
    is off by the offset, their mean is not; seen without waiting (an upper bound) only
    counts where no waited message was seen."""
    offset, hop = 100.0, 0.030
    forward, backward = Task("F", 0, 0), Task("B", 0, 0)
    late = Task("F", 0, 1)
    stage0 = _summary(0, {(1, forward): 5.0, (1, late): 6.0},
                      {(1, backward): (7.0 + hop, True)}, saved=2e6)
    stage1 = _summary(1, {(0, backward): 7.0 + offset},
                      {(0, forward): (5.0 + hop + offset, True),
                       (0, late): (6.0 + 0.5 + offset, False)}, saved=3e6)
    result = measured_from([stage0, stage1])
    assert result.hop_ms[0] == pytest.approx(30.0)
    assert result.forward_ms == (10.0, 11.0) and result.backward_ms == (20.0, 21.0)
    assert result.activation_bytes == (2e6, 3e6)
    # one direction only (a single host): its own time
    stage0["seen"] = [{}]
    assert measured_from([stage0, stage1]).hop_ms[0] == pytest.approx(1e3 * (hop + offset))


def test_megatron_lms_trainer_refuses_a_budget_beside_a_forced_slack():
    from megatron.dpp.megatron_lm.arguments import problems

    def found(**flags):
        return problems(argparse.Namespace(use_dpp=True, pipeline_model_parallel_size=2,
                                           **flags))

    assert found(dpp_memory_budget="1.15x") == []
    assert found(dpp_max_inflight=1, dpp_memory_budget="1.15x") == [
        "--dpp-memory-budget 1.15x caps the slack DPP chooses; --dpp-max-inflight 1 forces "
        "one: give one of them"]
    (bad,) = found(dpp_memory_budget="plenty")
    assert bad.startswith("--dpp-memory-budget: memory budget 'plenty': expected a factor")


@pytest.mark.parametrize("flags, problem", [
    (["--use-dpp", "--dpp-max-inflight", "1", "--dpp-memory-budget", "1.15x"],
     "--dpp-max-inflight 1 forces one: give one of them"),
    (["--dpp-memory-budget", "2GB"], "--dpp-memory-budget needs --use-dpp"),
    (["--use-dpp", "--dpp-memory-budget", "most"], "--dpp-memory-budget: memory budget 'most'"),
])
def test_the_trainer_names_a_bad_memory_budget(flags, problem):
    from megatron.trainer.config.args_common import ArgumentError
    from megatron.trainer.config.arguments import parse_args
    from tests.trainer_runs import TINY, with_flags

    with pytest.raises(ArgumentError, match=re.escape(problem)):
        parse_args([*with_flags(TINY, pipeline_model_parallel_size=2, train_iters=1), *flags], world_size=2)
    args = parse_args([*with_flags(TINY, pipeline_model_parallel_size=2, train_iters=1), "--use-dpp",
                       "--dpp-memory-budget", "800MB"], world_size=2)
    assert DppOptions.from_args(args).budget == MemoryBudget(limit_bytes=8e8)


def test_a_size_budget_without_measured_activations_is_named():
    """Where no forward counted any activations a budget in bytes cannot be met and says
    so; a factor still can (equal bytes per stage)."""
    from megatron.dpp.slack_measurement import PipelineShape, SlackAdapter

    summaries = [_summary(0, {}, {}), _summary(1, {}, {})]
    shape = PipelineShape((10, 11), 0, 1, 8, False, False, 1)
    with pytest.raises(ValueError, match="the activations were not measured"):
        SlackAdapter(2, False, MemoryBudget.parse("1GB"))._decide(summaries, shape)
    choice = SlackAdapter(2, False, MemoryBudget.parse("1x"))._decide(summaries, shape)
    assert choice.slack == 0 and choice.held_bytes is None


def test_ranks_that_share_cores_are_simulated_so():
    """Straggler costs (the last stage 1.53x the others, W 15 % of a backward, one task in
    ten 3x its median): with a processor a rank slack pays; on one core shared
    by the four ranks every task runs back to back whatever the order, and slack buys
    nothing."""
    forward = (4.8, 4.8, 4.8, 7.3)
    spread = (1.0,) * 90 + (3.0,) * 10

    def choice(cores):
        costs = Measured(forward, tuple(0.73 * f for f in forward), (0.7,) * 4,
                         weight_ms=tuple(0.13 * f for f in forward), cost_spread=spread,
                         shared_cores=cores)
        return choose_slack(costs, 4, 16, split_backward=True, static=None)

    alone, two, one = choice(None), choice(2.0), choice(1.0)
    assert alone.slack > 0 and one.slack == 0
    assert alone.simulated_ms[0] < two.simulated_ms[0] < one.simulated_ms[0]
    assert "on 2 cores shared by the ranks, simulated speedup at slack" in two.line()
    assert "shared" not in alone.line()


def test_with_the_split_a_w_straggles_with_its_b_and_the_rule_orders_ws_as_the_runtime():
    """The choice simulates the straggler model the emulation applies: each W takes its B's
    draw (one stage, every task 3x: the iteration 3x the calm one, W included), and the
    dynamic rule runs its pending W tasks shortest B first where the runtime does, which
    the plan in order never does."""
    calm = Measured((10.0,), (7.0,), (0.0,), weight_ms=(3.0,))
    slow = Measured((10.0,), (7.0,), (0.0,), weight_ms=(3.0,), cost_spread=(3.0,) * 10)
    calm_ms = choose_slack(calm, 1, 8, split_backward=True, max_slack=0).simulated_ms[0]
    slow_ms = choose_slack(slow, 1, 8, split_backward=True, max_slack=0).simulated_ms[0]
    assert calm_ms == pytest.approx(8 * 20.0) and slow_ms == pytest.approx(3 * calm_ms)

    forward = (4.8, 4.8, 4.8, 7.3)
    costs = Measured(forward, tuple(0.73 * f for f in forward), (0.7,) * 4,
                     weight_ms=tuple(0.13 * f for f in forward),
                     cost_spread=(1.0,) * 90 + (3.0,) * 10)
    in_order, by_backward = (choose_slack(costs, 4, 16, split_backward=True, static=None,
                                          weights_by_backward=by_b) for by_b in (False, True))
    assert by_backward.plan_ms == in_order.plan_ms
    assert by_backward.simulated_ms[2] < in_order.simulated_ms[2]
    assert "the dynamic rule (W tasks shortest B first) 1.00/" in by_backward.line()
    assert "shortest B first" not in in_order.line()


def _cpu_summary(host: str, cpus: list[int] | None, threads: int = 1) -> dict:
    return {"host": host, "cpus": cpus, "threads": threads}


def test_the_cores_a_pipeline_shares_are_the_least_share_of_any_host():
    # four one-thread ranks on a host of two cores: a pipeline of four shares two
    two_cores = [_cpu_summary("a", [0, 1]) for _ in range(4)]
    assert shared_cores(two_cores, 4) == pytest.approx(2.0)
    # two pods, each of two ranks pinned to one core of its own host: half a core a rank
    pods = [_cpu_summary("a", [0]), _cpu_summary("a", [0]), _cpu_summary("b", [3]),
            _cpu_summary("b", [3])]
    assert shared_cores(pods, 4) == pytest.approx(2.0)
    # a core for every thread, or GPUs: a processor each
    assert shared_cores([_cpu_summary("a", [0, 1, 2, 3], threads=2)] * 2, 2) is None
    assert shared_cores([_cpu_summary("a", None)] * 4, 4) is None
    # two threads a rank on a host of four cores and four ranks: half a core a thread
    assert shared_cores([_cpu_summary("a", [0, 1, 2, 3], threads=2)] * 4, 4) == \
        pytest.approx(2.0)
