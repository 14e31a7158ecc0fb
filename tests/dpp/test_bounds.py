"""megatron/dpp/sim/bounds.py: lower bounds on the makespan. The memory-free bound lies below
every schedule the simulator runs, the rank-0 bound below every one that keeps rank 0 in
the microbatch order at 1F1B's memory, the in-order bound below every in-order schedule at
the memory it held (the release-tail bound below every in-order schedule at any memory),
and on uniform tasks ZB-H1 reaches the first."""

from __future__ import annotations

import pytest

from megatron.dpp.plan import StageConfig
from megatron.dpp.policy import microbatch_order_for
from megatron.dpp.sim import bounds
from megatron.dpp.sim.bounds import (
    in_order_bound,
    memory_free_bound,
    rank0_bound,
    release_tail_bound,
    sums_in_order,
)
from megatron.dpp.sim.simulator import CostModel, Durations, sample_durations, simulate
from megatron.dpp.topology import PipelineTopology
from megatron.dpp.variability import StragglerProfile


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("m", [4, 8, 16])
def test_zb_h1_reaches_the_memory_free_bound_on_uniform_tasks(p, m):
    """F = B = W: ZB-H1's makespan is 3m + p - 1, the last rank's work after one forward on
    each rank before it."""
    durations = sample_durations(CostModel(weight_share=0.5), p, 1, m, seed=0,
                                 split_backward=True)
    times = durations.by_kind(split_backward=True)
    makespan = simulate("zb-h1", p, m, durations).makespan
    assert makespan == pytest.approx(3 * m + p - 1)
    assert memory_free_bound(times, p, m) == pytest.approx(makespan)
    assert rank0_bound(times, p, m, list(range(m))) <= makespan + 1e-9


def test_one_stage_is_its_own_work():
    durations = sample_durations(CostModel(cv=0.5), 1, 1, 6, seed=3, split_backward=True)
    times = durations.by_kind(split_backward=True)
    work = sum(sum(times[kind][0]) for kind in times)
    assert memory_free_bound(times, 1, 6) == pytest.approx(work)
    assert rank0_bound(times, 1, 6, list(range(6))) == pytest.approx(work)
    assert simulate("zb-h1", 1, 6, durations).makespan == pytest.approx(work)


@pytest.mark.parametrize("model", [CostModel(cv=0.5), CostModel(jitter=0.3),
                                   CostModel(slow_stage=1, slow_factor=1.3)])
@pytest.mark.parametrize("p", [2, 4])
def test_no_schedule_beats_the_bounds(model, p):
    """1F1B, ZB-H1 and DPP at slack 0 (each W after its B, and deferred) in DPP's cost
    order, over seeds and microbatch counts: none finishes before either bound, and some
    come within 10 % of the larger (the bounds are not vacuous)."""
    closest = float("inf")
    for seed in range(4):
        for m in (p, 2 * p, 4 * p):
            durations = sample_durations(model, p, 1, m, seed, split_backward=True)
            times = durations.by_kind(split_backward=True)
            order = microbatch_order_for(StageConfig(0, p, 1, m, split_backward=True),
                                         durations.microbatch_factor)
            free, in_order = memory_free_bound(times, p, m), rank0_bound(times, p, m, order)
            runs = [simulate("1f1b", p, m, durations, microbatch_order=order),
                    simulate("zb-h1", p, m, durations, microbatch_order=order)]
            runs += [simulate("dpp", p, m, durations, slack=0, split_backward=True,
                              microbatch_costs=durations.microbatch_factor,
                              microbatch_order=order, defer_weights=defer)
                     for defer in (False, True)]
            for run in runs:
                assert run.makespan >= max(free, in_order) - 1e-9, (seed, m, run.makespan)
                closest = min(closest, run.makespan / max(free, in_order))
    assert closest < 1.1


def test_two_chunks_a_rank_and_a_backward_run_whole():
    """With two chunks a rank the bound counts each rank's two virtual stages and lies below
    the interleaved schedule and DPP on them; without W it is the bound of B + W."""
    p, m = 4, 8
    topology = PipelineTopology(p, 2)
    for seed in range(3):
        durations = sample_durations(CostModel(cv=0.5), p, 2, m, seed, split_backward=True)
        whole = durations.by_kind(split_backward=False)
        bound = memory_free_bound(durations.by_kind(split_backward=True), p, m, topology)
        assert memory_free_bound(whole, p, m, topology) == pytest.approx(bound)
        for schedule in ("interleaved", "dpp"):
            run = simulate(schedule, p, m, durations, num_chunks=2)
            assert run.makespan >= bound - 1e-9, (seed, schedule)
        # one rank's work alone is below the bound; all ranks' work over p is too
        work = sum(sum(sum(row) for row in table) for table in whole.values())
        assert work / p <= bound


STRAGGLERS = StragglerProfile.parse("all:0.1:3")


@pytest.mark.parametrize("model", [
    CostModel(cv=0.5, weight_share=0.3),
    CostModel(straggler=STRAGGLERS, weight_share=0.15, backward_ratio=0.9),
    CostModel(straggler=STRAGGLERS, slow_stage=3, slow_factor=1.5, weight_share=0.15),
])
def test_no_in_order_schedule_beats_the_in_order_bound_at_its_memory(model):
    """1F1B, ZB-H1, and DPP's rule and plan in order at slack 0-2 (each W after its B, and
    deferred; the rule also with its W tasks shortest B first), each against the bound at
    the microbatches it held from F to W on each rank: none finishes before it; those that
    ran their W tasks in the microbatch order (all but the rule by B) none before the bound
    for such schedules either, which is no lower. DPP comes within 1 % of the first where the
    last stage is the slowest and the bound then lies above the memory-free one, and its rule
    within 0.5 % of the second."""
    p, m = 4, 16
    closest, closest_in_order, tighter, reordered = float("inf"), float("inf"), 0, 0
    for seed in range(3):
        durations = sample_durations(model, p, 1, m, seed, split_backward=True)
        times = durations.by_kind(split_backward=True)
        order = microbatch_order_for(StageConfig(0, p, 1, m, split_backward=True),
                                     durations.microbatch_factor)
        runs = [simulate(name, p, m, durations, microbatch_order=order, record=True)
                for name in ("1f1b", "zb-h1")]
        runs += [simulate(name, p, m, durations, slack=slack, split_backward=True,
                          microbatch_costs=durations.microbatch_factor,
                          microbatch_order=order, defer_weights=defer, record=True,
                          weights_by_backward=by_backward)
                 for name in ("dpp", "dpp-static") for slack in (0, 1, 2)
                 for defer in (False, True) for by_backward in (False, True)
                 if not (by_backward and (defer or name == "dpp-static"))]
        for run in runs:
            bound = in_order_bound(times, p, m, run.peak_in_flight, order)
            assert run.makespan >= bound - 1e-9, (seed, run.schedule, run.makespan, bound)
            weights_bound = in_order_bound(times, p, m, run.peak_in_flight, order,
                                           weights_in_order=True)
            assert weights_bound >= bound - 1e-9
            if sums_in_order(run.orders, order):
                assert run.makespan >= weights_bound - 1e-9, (seed, run.schedule)
                if run.schedule == "dpp":
                    closest_in_order = min(closest_in_order, run.makespan / weights_bound)
            else:
                reordered += 1
            if run.schedule == "dpp":
                closest = min(closest, run.makespan / bound)
                tighter += bound > memory_free_bound(times, p, m) + 1e-9
    assert reordered <= 9  # only the rule by B may take the W tasks out of order
    if model.slow_stage is not None:
        assert closest < 1.01 and tighter and closest_in_order < 1.005


def test_with_the_w_tasks_in_order_the_ones_left_for_the_tail_are_the_last():
    """Two ranks, rank 1 holding two microbatches from F to W; its W(0) takes 6, each of its
    other W tasks takes 2, and rank 0's last B and W take 5 + 1. In any W order rank 1 can keep W(0) and
    W(3) (8) for the tail: its work (4 x 2 + 4 x 4 + 12 = 36) after F(0) on rank 0 (1),
    37. Summing its weight gradients in the microbatch order it can keep only W(2) and W(3)
    (4), which leave 2 of the tail: 39, which DPP's rule takes."""
    durations = Durations(forward=[[1.0] * 4, [2.0] * 4], backward=[[5.0] * 4, [4.0] * 4],
                          microbatch_factor=[1.0] * 4,
                          weight=[[1.0] * 4, [6.0, 2.0, 2.0, 2.0]])
    times = durations.by_kind(split_backward=True)
    assert in_order_bound(times, 2, 4, [3, 2]) == pytest.approx(1 + 36)
    assert in_order_bound(times, 2, 4, [3, 2], weights_in_order=True) == pytest.approx(1 + 36 + 2)
    run = simulate("dpp", 2, 4, durations, slack=1, split_backward=True, record=True)
    assert run.peak_in_flight == [3, 2] and sums_in_order(run.orders, [0, 1, 2, 3])
    assert run.makespan == pytest.approx(39)


def test_the_in_order_tail_is_what_the_last_ranks_held_weights_leave_uncovered():
    """Two ranks, F = 1, B = 2, W = 1 on rank 0, rank 1 twice as slow: rank 1's work (8 x
    8) after F(0) on rank 0, plus B(last) and W(last) on rank 0 less what rank 1's held W
    tasks (2 each) cover."""
    forward = [[1.0] * 8, [2.0] * 8]
    times = {"F": forward, "B": [[2.0] * 8, [4.0] * 8], "W": [[1.0] * 8, [2.0] * 8]}
    assert in_order_bound(times, 2, 8, [2, 0]) == pytest.approx(1 + 64 + 3)
    assert in_order_bound(times, 2, 8, [2, 1]) == pytest.approx(1 + 64 + 1)
    assert in_order_bound(times, 2, 8, [2, 2]) == pytest.approx(1 + 64)
    whole = {"F": forward, "B": [[3.0] * 8, [6.0] * 8]}
    assert in_order_bound(whole, 2, 8, [2, 2]) == pytest.approx(1 + 64 + 3)


def test_the_last_microbatchs_w_is_among_the_held_ones_that_cover_the_tail():
    """Two ranks, rank 1 holding one microbatch from F to W; its W(0) takes 6, each of its
    other W tasks takes 2. When rank 1's last B ends, the W pending there is the last
    microbatch's (2), not its longest (6): rank 0's B(last) and W(last) (3) leave 1
    uncovered after rank 1's work (4 x 6 + 6 + 3 x 2) from F(0)'s end on rank 0 (1): 38,
    which DPP at slack 0 takes."""
    durations = Durations(forward=[[1.0] * 4, [2.0] * 4], backward=[[2.0] * 4, [4.0] * 4],
                          microbatch_factor=[1.0] * 4,
                          weight=[[1.0] * 4, [6.0, 2.0, 2.0, 2.0]])
    times = durations.by_kind(split_backward=True)
    assert in_order_bound(times, 2, 4, [2, 1]) == pytest.approx(1 + 36 + 1)
    run = simulate("dpp", 2, 4, durations, slack=0, split_backward=True)
    assert run.peak_in_flight == [2, 1]
    assert run.makespan == pytest.approx(38)
    # holding two, rank 1 may keep W(0) for the end: the tail is covered
    assert in_order_bound(times, 2, 4, [2, 2]) == pytest.approx(1 + 36)


def test_a_late_forward_upstream_delays_what_follows_it_and_1f1b_meets_the_bound():
    """Two ranks, the backward run whole: F(1) on rank 0 takes 10 instead of 1. Rank 1 can
    start F(1) no earlier than 11 and then has three microbatches' work (3 x 6) and rank 0's
    last backward (2) to go: 31, above the first microbatch's 1 + 24 + 2. 1F1B takes exactly
    that."""
    durations = Durations(forward=[[1.0, 10.0, 1.0, 1.0], [2.0] * 4],
                          backward=[[2.0] * 4, [4.0] * 4], microbatch_factor=[1.0] * 4)
    times = durations.by_kind()
    assert in_order_bound(times, 2, 4, [2, 1]) == pytest.approx(11 + 18 + 2)
    assert simulate("1f1b", 2, 4, durations).makespan == pytest.approx(31)
    # in the order 1, 0, 2, 3 the late forward comes first: rank 1 starts at 10
    assert in_order_bound(times, 2, 4, [2, 1], order=[1, 0, 2, 3]) == pytest.approx(10 + 24 + 2)


def test_a_rank_that_waits_for_a_late_forward_with_nothing_else_released_idles():
    """Three ranks, the backward run whole, F(1) and F(2) on rank 0 three times as long (30)
    and rank 1's backwards 50. Rank 1 runs F(0) at 10-20, then has nothing it may run until
    40: F(1) arrives then and B(0)'s gradient (through rank 2: 20 + 10 + 10) too. After that
    it has all its other work (10 + 10 + 150) and rank 0's last backward (1) to go: 211,
    which 1F1B takes. The arrival bound alone misses the idle 20-40: it counts F(0)'s work
    from 10 without it (10 + 180 + 1), and from F(1)'s arrival leaves out B(0)."""
    durations = Durations(forward=[[10.0, 30.0, 30.0], [10.0] * 3, [10.0] * 3],
                          backward=[[1.0] * 3, [50.0] * 3, [10.0] * 3],
                          microbatch_factor=[1.0] * 3)
    times = durations.by_kind()
    assert bounds._arrival_bound(times, 3, 3, [3, 2, 1], [0, 1, 2]) == pytest.approx(191)
    assert release_tail_bound(times, 3, 3) == pytest.approx(211)
    assert in_order_bound(times, 3, 3, [3, 2, 1]) == pytest.approx(211)
    assert simulate("1f1b", 3, 3, durations).makespan == pytest.approx(211)


@pytest.mark.parametrize("model", [
    CostModel(cv=0.5),
    CostModel(straggler=STRAGGLERS, backward_ratio=0.9, slow_stage=1, slow_factor=1.5),
])
def test_no_in_order_schedule_beats_the_release_tail_bound_at_any_memory(model):
    """The backward run whole: 1F1B, GPipe (every microbatch in flight) and DPP's rule at
    slack 0-3 on p = 3 and 4 ranks, three draws each: none finishes before the bound."""
    m = 8
    for p in (3, 4):
        for seed in range(3):
            durations = sample_durations(model, p, 1, m, seed)
            bound = release_tail_bound(durations.by_kind(), p, m)
            runs = [simulate("1f1b", p, m, durations), simulate("gpipe", p, m, durations)]
            runs += [simulate("dpp", p, m, durations, slack=slack) for slack in range(4)]
            for run in runs:
                assert run.makespan >= bound - 1e-9, (p, seed, run.schedule, run.makespan)
