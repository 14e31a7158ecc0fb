"""GreedyPolicy and static_order: megatron's orders, cap, invariants under any arrivals."""

import heapq
import random
from dataclasses import replace

import pytest

from megatron.dpp import policy as policy_module
from megatron.dpp.actions import BACKWARD, FORWARD, WEIGHT, Task, in_flight_profile
from megatron.dpp.plan import (
    PlanError,
    StageConfig,
    check_plans,
    plan_order,
    static_order,
    static_peak,
)
from megatron.dpp.policy import (
    ORDER_CANDIDATES,
    GreedyPolicy,
    choose_cost_order,
    cost_order,
    microbatch_order_for,
    plan_extra_warmup,
    simulated_makespan,
)
from megatron.dpp.sim.simulator import CostModel, replay, sample_durations, simulate
from megatron.dpp.topology import PipelineTopology

# (pp_size, num_chunks, num_microbatches): m not a multiple of p only where megatron allows
CONFIGS = [
    (1, 1, 3),
    (2, 1, 1),
    (2, 1, 5),
    (3, 1, 7),
    (4, 1, 2),
    (4, 1, 9),
    (2, 2, 2),
    (2, 2, 6),
    (4, 2, 8),
    (4, 2, 12),
    (3, 3, 6),
    (2, 4, 4),
]


def megatron_table(m, chunks, group):
    """Forward (microbatch, chunk) order, written from megatron's docstring example."""
    rows = []
    for first in range(0, m, group):
        size = min(group, m - first) if first + group < m else m - first
        for c in range(chunks):
            rows.extend((first + k, c) for k in range(size))
    return rows


def test_interleaved_table_matches_megatron_docstring():
    # megatron-core's comment for PP2 N3 M5 VP2: microbatch 0 1 2 0 1 2 3 4 3 4,
    # chunk 0 0 0 1 1 1 0 0 1 1
    stage = StageConfig(0, 2, num_chunks=2, num_microbatches=5, microbatch_group_size=3)
    forwards = [t for t in static_order(stage) if t.kind == FORWARD]
    assert [t.microbatch for t in forwards] == [0, 1, 2, 0, 1, 2, 3, 4, 3, 4]
    assert [t.chunk for t in forwards] == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]


def test_matches_megatron_get_schedule_table():
    schedules = pytest.importorskip(
        "megatron.core.pipeline_parallel.schedules", reason="megatron-core not installed"
    )
    for p, chunks, m in CONFIGS:
        if chunks == 1:
            continue
        stage = StageConfig(0, p, num_chunks=chunks, num_microbatches=m)
        forwards = [(t.microbatch, t.chunk) for t in static_order(stage) if t.kind == FORWARD]
        assert forwards == list(schedules.get_schedule_table(m, chunks, p))


def test_1f1b_order_and_peak():
    stage = StageConfig(1, 4, num_microbatches=5)
    f = [Task(FORWARD, 0, i) for i in range(5)]
    b = [Task(BACKWARD, 0, i) for i in range(5)]
    assert static_order(stage) == [f[0], f[1], f[2], b[0], f[3], b[1], f[4], b[2], b[3], b[4]]
    for p in (2, 4, 8):
        for m in (1, 3, 16):
            for r in range(p):
                policy = GreedyPolicy(StageConfig(r, p, num_microbatches=m))
                assert policy.cap == min(p - r, m)


def test_interleaved_warmup_and_cap():
    # rank 0 of p=4, 2 chunks: warmup 2*(p-1) + (chunks-1)*p = 10 forwards, peak 11
    stage = StageConfig(0, 4, num_chunks=2, num_microbatches=8)
    order = static_order(stage)
    assert [t.kind for t in order[:11]] == [FORWARD] * 11
    assert order[11].kind == BACKWARD and order[11] == Task(BACKWARD, 1, 0)
    assert GreedyPolicy(stage).cap == 11 == max(in_flight_profile(order))
    assert GreedyPolicy(StageConfig(0, 4, 2, 8, slack=3)).cap == 14


def test_megatron_limits_are_named():
    with pytest.raises(ValueError, match="num_microbatches=6"):
        StageConfig(0, 4, num_chunks=2, num_microbatches=6)
    with pytest.raises(ValueError, match="rank 4"):
        StageConfig(4, 4)
    with pytest.raises(ValueError, match="slack"):
        StageConfig(0, 4, slack=-1)


def pipeline_run(p, chunks, m, slack, rng, split_backward=False, weight_slices=1,
                 defer_weights=True):
    """Drive all ranks' policies with a random interleaving of who runs next; each run
    task's output arrives at the neighbour after a random number of steps. A W run in
    parts enters the order at its last part."""
    stages = [StageConfig(r, p, chunks, m, slack=slack, split_backward=split_backward,
                          defer_weights=defer_weights, weight_slices=weight_slices)
              for r in range(p)]
    parts = {}
    policies = [GreedyPolicy(s) for s in stages]
    topology = PipelineTopology(p, chunks)
    arrived = [set() for _ in range(p)]
    pending = []  # heap of (deliver_at_step, rank, task)
    orders = [[] for _ in range(p)]
    for step in range(20 * 3 * m * chunks * p + 100):
        while pending and pending[0][0] <= step:
            _, rank, arrival = heapq.heappop(pending)
            arrived[rank].add(arrival)
        r = rng.randrange(p)
        policy = policies[r]
        task = policy.next_task(arrived[r].__contains__)
        if task is not None:
            assert policy.in_flight < policy.cap or task.kind != FORWARD
            policy.complete(task)
            assert policy.in_flight <= policy.cap
            if task.kind == WEIGHT:
                parts[r, task] = parts.get((r, task), 0) + 1
                if parts[r, task] < weight_slices:
                    continue
            orders[r].append(task)
            target = topology.destination(r, task)
            if target:
                heapq.heappush(pending, (step + rng.randrange(4 * p), *target))
        if all(pol.finished for pol in policies):
            return stages, policies, orders
    raise AssertionError(f"no progress: p={p} chunks={chunks} m={m} slack={slack}")


@pytest.mark.parametrize("p,chunks,m", CONFIGS)
@pytest.mark.parametrize("slack", [0, 2, 5])
def test_random_arrivals_keep_invariants(p, chunks, m, slack):
    rng = random.Random(p * 1000 + chunks * 100 + m + slack)
    for _ in range(3):
        stages, policies, orders = pipeline_run(p, chunks, m, slack, rng)
        for stage, policy, order in zip(stages, policies, orders, strict=True):
            assert sorted(order) == sorted(static_order(stage))  # every task exactly once
            assert max(in_flight_profile(order)) <= policy.cap
            done_forward = set()
            for c in range(chunks):
                for kind in (FORWARD, BACKWARD):
                    mbs = [t.microbatch for t in order if t.kind == kind and t.chunk == c]
                    assert mbs == list(range(m))
            for task in order:
                if task.kind == FORWARD:
                    done_forward.add((task.chunk, task.microbatch))
                else:
                    assert (task.chunk, task.microbatch) in done_forward


@pytest.mark.parametrize("p,chunks,m", CONFIGS)
@pytest.mark.parametrize("slack", [0, 2])
@pytest.mark.parametrize("weight_slices", [1, 3])
@pytest.mark.parametrize("defer", [True, False], ids=["deferred", "after-b"])
def test_split_backward_keeps_both_caps_under_random_arrivals(p, chunks, m, slack,
                                                              weight_slices, defer):
    """B and W tasks: each W after its B, each kind in the plan's order per chunk, every
    task once (a W in parts: `weight_slices` times, counted once); from F to B at most
    this rank's 1F1B count (+ slack), from F to W at most rank 0's (+ slack) with the W
    deferred, this rank's own (+ slack) without."""
    rng = random.Random(p * 1000 + chunks * 100 + m + slack)
    for _ in range(3):
        stages, policies, orders = pipeline_run(p, chunks, m, slack, rng, split_backward=True,
                                                weight_slices=weight_slices,
                                                defer_weights=defer)
        for stage, policy, order in zip(stages, policies, orders, strict=True):
            weights = sum(task.kind == WEIGHT for task in order)
            assert policy.num_decisions == len(order) + (weight_slices - 1) * weights
            assert sorted(order) == sorted(static_order(stage))
            assert policy.activation_cap == min(static_peak(stage) + slack, m * chunks)
            holder = replace(stage, rank=0) if defer else stage
            assert policy.cap == min(static_peak(holder) + slack, m * chunks)
            assert max(in_flight_profile(order, BACKWARD)) <= policy.activation_cap
            assert max(in_flight_profile(order)) <= policy.cap
            for c in range(chunks):
                for kind in (FORWARD, BACKWARD, WEIGHT):
                    mbs = [t.microbatch for t in order if t.kind == kind and t.chunk == c]
                    assert mbs == policy.microbatch_order
            for kind, before in ((BACKWARD, FORWARD), (WEIGHT, BACKWARD)):
                for task in order:
                    if task.kind == kind:
                        assert order.index(Task(before, *task[1:])) < order.index(task)


def test_w_fills_a_wait_and_yields_to_a_ready_backward():
    f, b, w = ([Task(kind, 0, i) for i in range(3)] for kind in (FORWARD, BACKWARD, WEIGHT))
    stage = StageConfig(1, 3, num_microbatches=3, split_backward=True)
    policy = GreedyPolicy(stage)
    # rank 1 of 3: 1F1B's order, each W one backward after its B (ZB-H1)
    assert policy.plan == [f[0], f[1], b[0], f[2], b[1], w[0], b[2], w[1], w[2]]
    run_plan_prefix(policy, [f[0], f[1], b[0], f[2]])
    assert policy.next_task(lambda t: False) == w[0]  # B1's input is late: W0 fills
    policy.complete(w[0])
    assert policy.next_task(lambda t: False) is None  # nothing else may run
    run_plan_prefix(policy, [b[1], b[2], w[1], w[2]])
    assert policy.finished
    policy = GreedyPolicy(stage)
    run_plan_prefix(policy, [f[0], f[1], b[0], f[2], b[1]])
    assert policy.next_task(b[2].__eq__) == b[2]  # the planned W0 waits for a ready B2
    policy.complete(b[2])
    run_plan_prefix(policy, [w[0], w[1], w[2]])
    # the planned W runs when the next F or B is not ready
    policy = GreedyPolicy(stage)
    run_plan_prefix(policy, [f[0], f[1], b[0], f[2], b[1]])
    assert policy.next_task(lambda t: False) == w[0]


def test_w_in_parts_yields_between_parts_and_is_held_to_its_last():
    f, b, w = ([Task(kind, 0, i) for i in range(3)] for kind in (FORWARD, BACKWARD, WEIGHT))
    policy = GreedyPolicy(StageConfig(1, 3, num_microbatches=3, split_backward=True,
                                      weight_slices=2))
    assert policy.num_decisions == 9 + 3
    run_plan_prefix(policy, [f[0], f[1], b[0], f[2]])
    assert policy.next_task(lambda t: False) == w[0]  # B1's input is late: W0 fills
    policy.complete(w[0])  # its first half
    assert policy.in_flight == 3  # W0 still holds its microbatch
    assert policy.next_task(b[1].__eq__) == b[1]  # B1 arrived: it goes before W0's rest
    policy.complete(b[1])
    assert policy.next_task(lambda t: False) == w[0]
    policy.complete(w[0])
    assert policy.in_flight == 2
    run_plan_prefix(policy, [b[2], w[1], w[1], w[2], w[2]])
    assert policy.finished


def test_split_forward_waits_for_the_f_to_w_cap():
    """The last of 2 ranks holds 2 microbatches from F to W (rank 0's count) but 1 from F to
    B: after B1 it runs the pending W0 before F2 even when F2's input is here."""
    f, b, w = ([Task(kind, 0, i) for i in range(4)] for kind in (FORWARD, BACKWARD, WEIGHT))
    policy = GreedyPolicy(StageConfig(1, 2, num_microbatches=4, split_backward=True))
    assert (policy.activation_cap, policy.cap) == (1, 2)
    run_plan_prefix(policy, [f[0], b[0], f[1], b[1]])
    assert policy.in_flight == 2
    assert policy.next_task(lambda t: True) == w[0]


def test_waits_for_missing_input_and_never_runs_twice():
    policy = GreedyPolicy(StageConfig(1, 2, num_microbatches=2))
    assert policy.next_task(lambda task: False) is None
    task = policy.next_task(lambda task: True)
    assert task == Task(FORWARD, 0, 0)
    with pytest.raises(RuntimeError, match="still running"):
        policy.next_task(lambda task: True)
    with pytest.raises(RuntimeError, match="running task"):
        policy.complete(Task(FORWARD, 0, 1))


def test_local_inputs_are_not_asked_for():
    asked = []

    def arrived(task):
        asked.append(task)
        return False

    last = GreedyPolicy(StageConfig(1, 2, num_microbatches=1))
    assert last.input_is_local(Task(BACKWARD, 0, 0))
    assert not last.input_is_local(Task(FORWARD, 0, 0))
    first = GreedyPolicy(StageConfig(0, 2, num_microbatches=1))
    assert first.next_task(arrived) == Task(FORWARD, 0, 0)
    first.complete(Task(FORWARD, 0, 0))
    assert first.next_task(arrived) is None
    assert asked == [Task(BACKWARD, 0, 0)]


def test_forward_only_runs_forwards_in_table_order_without_cap():
    stage = StageConfig(0, 2, num_chunks=2, num_microbatches=4, forward_only=True)
    policy = GreedyPolicy(stage)
    order = []
    while not policy.finished:
        task = policy.next_task(lambda task: True)
        policy.complete(task)
        order.append(task)
    assert order == static_order(stage)
    assert all(t.kind == FORWARD for t in order) and len(order) == 8
    assert policy.in_flight == 8 <= policy.cap


@pytest.mark.parametrize("rank", [0, 1])
def test_forward_only_with_slack_never_offers_a_backward(rank):
    """Evaluation with the default slack: out-of-plan choices must stay forwards (a
    backward offered here once crashed the runtime's forward-only calls)."""
    stage = StageConfig(rank, 2, num_chunks=2, num_microbatches=4, slack=2, forward_only=True)
    policy = GreedyPolicy(stage)
    rng = random.Random(rank)
    order = []
    while not policy.finished:
        task = policy.next_task(lambda task: rng.random() < 0.5)
        if task is None:
            continue
        assert task.kind == FORWARD
        policy.complete(task)
        order.append(task)
    assert sorted(order) == sorted(static_order(stage))


def run_plan_prefix(policy, tasks):
    for task in tasks:
        assert policy.next_task(lambda t: True) == task
        policy.complete(task)


def test_backward_runs_ahead_only_with_slack():
    f = [Task(FORWARD, 0, i) for i in range(4)]
    b = [Task(BACKWARD, 0, i) for i in range(4)]
    only_b1 = b[1].__eq__
    # rank 1 of p=3, m=4, slack 0: plan F0 F1 B0 F2 B1 F3 B2 B3. F2 is missing, B1 is
    # here: wait, the downstream has no spare forward to cover a delayed F2.
    policy = GreedyPolicy(StageConfig(1, 3, num_microbatches=4))
    run_plan_prefix(policy, [f[0], f[1], b[0]])
    assert policy.next_task(only_b1) is None
    # slack 1: plan F0 F1 F2 B0 F3 B1 B2 B3. F3 is missing, B1 is here: run it.
    policy = GreedyPolicy(StageConfig(1, 3, num_microbatches=4, slack=1))
    run_plan_prefix(policy, [f[0], f[1], f[2], b[0]])
    assert policy.next_task(only_b1) == b[1]


def test_forward_runs_ahead_within_slack_only():
    f = [Task(FORWARD, 0, i) for i in range(6)]
    b0_missing = Task(BACKWARD, 0, 0).__ne__
    # rank 0 of p=2, m=6, slack 2 with the plain 1F1B plan (extra_warmup=0): cap 4, so up
    # to two forwards may run ahead of the missing B0, and no more.
    policy = GreedyPolicy(StageConfig(0, 2, num_microbatches=6, slack=2), extra_warmup=0)
    assert policy.cap == 4
    run_plan_prefix(policy, [f[0], f[1]])
    for task in (f[2], f[3]):
        assert policy.next_task(b0_missing) == task
        policy.complete(task)
    assert policy.next_task(b0_missing) is None
    assert policy.in_flight == 4


def test_plan_extra_warmup_is_capped_by_stages_after():
    # extra warmup forwards in the plan: min(slack, stages after this one)
    assert [plan_extra_warmup(StageConfig(r, 4, slack=2)) for r in range(4)] == [2, 2, 1, 0]
    assert [plan_extra_warmup(StageConfig(r, 4, slack=0)) for r in range(4)] == [0] * 4
    assert plan_extra_warmup(StageConfig(0, 4, slack=2, forward_only=True)) == 0
    for r in range(4):
        stage = StageConfig(r, 4, num_microbatches=16, slack=2)
        policy = GreedyPolicy(stage)
        assert policy.plan == plan_order(stage, plan_extra_warmup(stage))
        assert policy.cap == min(4 - r, 16) + 2  # the cap keeps the whole slack
    last = StageConfig(3, 4, num_microbatches=16, slack=2)
    assert GreedyPolicy(last).plan == static_order(last)


def test_interleaved_extra_warmup_stays_deadlock_free():
    """With virtual chunks, 3 extra warmup forwards on rank 0 (p = 4, m = 8) make the plans
    deadlock (the checker names where); the plan takes the most the checker accepts."""
    stages = [StageConfig(r, 4, 2, 8, slack=5) for r in range(4)]
    assert [plan_extra_warmup(s) for s in stages] == [2, 2, 1, 0]
    greedy = [plan_order(s, min(5, 3 - s.rank)) for s in stages]
    with pytest.raises(PlanError, match=r"rank 0, action 13: F\(chunk 1, microbatch 5\) can "
                                        "never run"):
        check_plans(greedy, PipelineTopology(4, 2), 8)
    check_plans([plan_order(s, plan_extra_warmup(s)) for s in stages], PipelineTopology(4, 2), 8)
    # one group of microbatches (m = p): the full extra is safe
    assert [plan_extra_warmup(StageConfig(r, 4, 2, 4, slack=5)) for r in range(4)] == [3, 2, 1, 0]


@pytest.mark.parametrize("p,m", [(2, 5), (4, 9), (8, 16)])
def test_last_stage_keeps_megatron_order_with_slack(p, m):
    """With slack the last stage still alternates F, B like megatron under any arrival
    order (its backward input is its own loss); running forwards ahead there delayed the
    backward chain (docs/benchmarks/simulator.md). Fails if the last stage's plan gets
    the slack's extra warmup forwards again."""
    rng = random.Random(p + m)
    for _ in range(3):
        stages, _, orders = pipeline_run(p, 1, m, 2, rng)
        assert orders[p - 1] == static_order(stages[p - 1])
        assert max(in_flight_profile(orders[p - 1])) == 1


def test_cost_order_puts_cheap_microbatches_at_both_ends():
    costs = [5.0, 1.0, 9.0, 3.0, 7.0, 2.0]
    order = cost_order(costs)
    assert sorted(order) == list(range(6))
    assert {order[0], order[-1]} == {1, 5}  # the two cheapest
    assert costs[order[2]] == 9.0 or costs[order[3]] == 9.0  # the dearest in the middle
    assert cost_order([4.0] * 5) == list(range(5))  # equal costs: megatron's order
    assert cost_order([]) == [] and cost_order([3.0]) == [0]


@pytest.mark.parametrize("peak,descent", [(0.3, 1.0), (0.3, 0.5), (0.5, 1.0), (0.7, 2.0)])
def test_cost_order_rises_to_the_peak_then_falls(peak, descent):
    rng = random.Random(7)
    for m in (2, 5, 16, 32, 33):
        costs = [rng.lognormvariate(0.0, 0.5) for _ in range(m)]
        order = cost_order(costs, peak, descent)
        assert sorted(order) == list(range(m))
        seq = [costs[i] for i in order]
        top = seq.index(max(seq))
        assert seq[: top + 1] == sorted(seq[: top + 1])  # non-decreasing up to the dearest
        assert seq[top:] == sorted(seq[top:], reverse=True)  # then non-increasing
        assert abs(top - peak * (m - 1)) <= 1.0  # the dearest at the peak
        assert seq[0] == min(seq)  # the cheapest first


def test_slower_descent_keeps_the_costs_high_after_the_peak():
    costs = [float(k) for k in range(1, 33)]
    linear, slow = cost_order(costs, 0.3, 1.0), cost_order(costs, 0.3, 0.5)
    assert linear != slow
    tail = slice(16, 32)
    assert sum(costs[i] for i in slow[tail]) > sum(costs[i] for i in linear[tail])
    with pytest.raises(ValueError, match="peak"):
        cost_order(costs, 1.0)
    with pytest.raises(ValueError, match="descent"):
        cost_order(costs, 0.3, 0.0)


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("slack", [0, 1, 2, 5])
def test_simulated_makespan_is_the_simulated_dpp_makespan(p, slack):
    """The order choice's makespan is the simulator's DPP run (every rank's GreedyPolicy)
    on the cost model's durations with the same factors, for any order."""
    rng = random.Random(p * 10 + slack)
    for m in sorted({1, 2, p, 2 * p + 1, 4 * p}):
        durations = sample_durations(CostModel(cv=0.5), p, 1, m, seed=rng.randrange(1000))
        costs = durations.microbatch_factor
        shuffled = list(range(m))
        rng.shuffle(shuffled)
        for order in (list(range(m)), cost_order(costs), cost_order(costs, 0.3, 0.5), shuffled):
            expected = simulate("dpp", p, m, durations, slack=slack, microbatch_order=order)
            assert simulated_makespan(costs, p, slack, order) == expected.makespan
    with pytest.raises(ValueError, match="permutation"):
        simulated_makespan([1.0, 2.0], 2, 0, [0, 0])


def test_choose_cost_order_takes_the_shortest_simulated_candidate():
    rng = random.Random(3)
    chosen_kinds = set()
    for _ in range(20):
        p, slack = rng.choice([2, 4, 8]), rng.choice([0, 2])
        durations = sample_durations(CostModel(cv=0.5), p, 1, 4 * p, seed=rng.randrange(1000))
        costs = durations.microbatch_factor
        candidates = [cost_order(costs, peak, descent) for peak, descent in ORDER_CANDIDATES]
        times = [simulate("dpp", p, 4 * p, durations, slack=slack, microbatch_order=order)
                 .makespan for order in candidates]
        chosen = choose_cost_order(costs, p, slack)
        assert chosen == candidates[times.index(min(times))]
        assert chosen == choose_cost_order(list(costs), p, slack)  # same on every rank
        chosen_kinds.add(candidates.index(chosen))
    assert chosen_kinds == set(range(len(ORDER_CANDIDATES)))  # each candidate wins somewhere
    assert choose_cost_order([2.0] * 8, 2, 2) == list(range(8))


def test_choose_cost_order_skips_the_simulation_above_the_task_limit(monkeypatch):
    costs = [float((7 * k) % 11 + 1) for k in range(64)]

    def fail(*args, **kwargs):
        raise AssertionError("simulated_makespan called above the limit")

    monkeypatch.setattr(policy_module, "simulated_makespan", fail)
    monkeypatch.setattr(policy_module, "ORDER_CHOICE_MAX_TASKS", 2 * 16 * 64 - 1)
    peak, descent = ORDER_CANDIDATES[0]
    assert choose_cost_order(costs, 16, 2) == cost_order(costs, peak, descent)


def test_microbatch_order_for_uses_the_costs_only_for_one_chunk_in_training():
    costs = [3.0, 1.0, 4.0, 1.5, 5.0, 9.0, 2.0, 6.0]
    train = StageConfig(0, 2, 1, 8, slack=2)
    assert microbatch_order_for(train, costs) == choose_cost_order(costs, 2, 2) != list(range(8))
    assert microbatch_order_for(train, None) is None
    assert microbatch_order_for(StageConfig(0, 2, 2, 8, slack=2), costs) is None
    assert microbatch_order_for(StageConfig(0, 2, 1, 8, forward_only=True), costs) is None
    with pytest.raises(ValueError, match="7 microbatch costs for 8"):
        microbatch_order_for(train, costs[:7])


@pytest.mark.parametrize("slack", [0, 2])
def test_known_costs_keep_every_invariant_under_random_arrivals(slack):
    """The plan follows the cost order; each rank runs every task once, forwards and
    backwards of a chunk in that order, never above the cap."""
    p, m = 3, 7
    costs = [3.0, 1.0, 4.0, 1.5, 5.0, 9.0, 2.0]
    order = choose_cost_order(costs, p, slack)
    assert order != list(range(m))
    stages = [StageConfig(r, p, 1, m, slack=slack) for r in range(p)]
    policies = [GreedyPolicy(s, microbatch_order=microbatch_order_for(s, costs))
                for s in stages]
    arrived = [set() for _ in range(p)]
    done = [[] for _ in range(p)]
    rng = random.Random(slack)
    while not all(policy.finished for policy in policies):
        r = rng.randrange(p)
        task = policies[r].next_task(arrived[r].__contains__)
        if task is None:
            continue
        policies[r].complete(task)
        assert policies[r].in_flight <= policies[r].cap
        done[r].append(task)
        if task.kind == FORWARD and r < p - 1:
            arrived[r + 1].add(Task(FORWARD, 0, task.microbatch))
        if task.kind == BACKWARD and r > 0:
            arrived[r - 1].add(Task(BACKWARD, 0, task.microbatch))
    for r in range(p):
        assert policies[r].microbatch_order == order
        for kind in (FORWARD, BACKWARD):
            assert [t.microbatch for t in done[r] if t.kind == kind] == order


@pytest.mark.parametrize(("split", "defer"), [(False, False), (True, True), (True, False)],
                         ids=["whole", "deferred", "after-b"])
def test_token_cap_holds_under_variance(split, defer):
    """Given token counts, no rank ever holds more than its cost cap; at slack 0 no more
    than the static schedule fed the same order (1F1B; with the split ZB-H1, or 1F1B's
    order with each W after its B) on that rank; and the runs still finish in the order's
    plan."""
    from megatron.dpp.sim.baselines import held_cost_peaks

    for p, slack, seed in [(2, 0, 1), (4, 0, 2), (4, 2, 3), (4, 1, 4), (8, 2, 5)]:
        m = 4 * p
        durations = sample_durations(CostModel(cv=1.0, jitter=0.5), p, 1, m, seed,
                                     split_backward=split)
        costs = list(durations.microbatch_factor)
        order = microbatch_order_for(StageConfig(0, p, 1, m, slack=slack,
                                                 split_backward=split), costs)
        dpp = simulate("dpp", p, m, durations, slack=slack, microbatch_costs=costs,
                       microbatch_order=order, split_backward=split, record=True,
                       defer_weights=defer)
        held = held_cost_peaks(dpp, costs, split)
        stages = [StageConfig(r, p, 1, m, slack=slack, split_backward=split,
                              defer_weights=defer) for r in range(p)]
        caps = [GreedyPolicy(stage, microbatch_order=order, costs=costs).cost_cap
                for stage in stages]
        assert all(h <= c * (1 + 1e-12) for h, c in zip(held, caps, strict=True)), (p, slack)
        fixed = replay([static_order(replace(stage, slack=0), order) for stage in stages],
                       durations, record=True)
        dearest = sum(sorted(costs, reverse=True)[:slack])
        assert caps == pytest.approx([f + dearest for f in
                                      held_cost_peaks(fixed, costs, split)]), p
        if split and not defer:
            # each rank's cap at its own 1F1B's, below what ZB-H1 lets the later ranks hold
            one_f_one_b = simulate("1f1b", p, m, durations, microbatch_order=order,
                                   record=True)
            assert caps == pytest.approx([f + dearest for f in
                                          held_cost_peaks(one_f_one_b, costs, False)]), p


def test_without_deviation_only_the_plan_runs_while_the_gpu_is_busy():
    """deviate=False (the runtime's GPU still busy): a missing planned input means wait,
    even with a W pending; with deviate=True (the GPU ran dry) the W fills."""
    f, b, w = ([Task(kind, 0, i) for i in range(3)] for kind in (FORWARD, BACKWARD, WEIGHT))
    policy = GreedyPolicy(StageConfig(1, 3, num_microbatches=3, split_backward=True))
    run_plan_prefix(policy, [f[0], f[1], b[0], f[2]])
    assert policy.next_task(lambda t: False, deviate=False) is None  # B1 planned, not here
    assert policy.next_task(lambda t: False) == w[0]
    policy.complete(w[0])
    assert policy.next_task(b[1].__eq__, deviate=False) == b[1]
    policy.complete(b[1])
    # a planned W still yields to the next planned F or B when that one is here
    assert policy.next_task(b[2].__eq__, deviate=False) == b[2]


def test_an_arriving_planned_input_is_deviated_from_only_by_a_w_part():
    """`arriving`: the planned input is announced, its data on the way. Deviating then
    runs a pending W (one part), never a forward of the plan's future; with no W pending
    the policy returns None (the runtime queues the planned task behind its data)."""
    f, b, w = ([Task(kind, 0, i) for i in range(6)] for kind in (FORWARD, BACKWARD, WEIGHT))
    stage = StageConfig(1, 3, num_microbatches=6, slack=2)
    policy = GreedyPolicy(stage)
    assert policy.plan[:4] == [f[0], f[1], f[2], b[0]]
    run_plan_prefix(policy, [f[0], f[1], f[2]])
    forward_here = f[3].__eq__
    assert policy.next_task(forward_here, arriving=b[0].__eq__) is None
    assert policy.next_task(forward_here) == f[3]  # B0 not announced: F3 runs ahead
    split = GreedyPolicy(replace(stage, split_backward=True))
    run_plan_prefix(split, [f[0], f[1], f[2], b[0], f[3]])
    assert split.next_task(forward_here, arriving=b[1].__eq__) == w[0]


@pytest.mark.parametrize("p,chunks,m", [(4, 1, 8), (4, 2, 8), (3, 1, 7)])
@pytest.mark.parametrize("split", [False, True])
def test_static_policy_runs_its_plan_in_order_under_any_arrivals(p, chunks, m, split):
    """static=True: each rank runs exactly its plan, in order, whatever the durations; the
    same timeline as the engine's StaticReplay of that plan."""
    from megatron.dpp.engine import StaticReplay, run_pipeline

    rng = random.Random(p * 100 + chunks * 10 + m)
    topology = PipelineTopology(p, chunks)
    stages = [StageConfig(r, p, chunks, m, slack=2, split_backward=split) for r in range(p)]
    kinds = (FORWARD, BACKWARD, WEIGHT) if split else (FORWARD, BACKWARD)
    durations = {kind: [[rng.uniform(0.5, 2.0) for _ in range(m)] for _ in range(p * chunks)]
                 for kind in kinds}
    static = [GreedyPolicy(s, static=True) for s in stages]
    plans = [policy.plan for policy in static]
    ran = run_pipeline(topology, static, durations, record=True)
    replayed = run_pipeline(topology, [StaticReplay(r, topology, plans[r]) for r in range(p)],
                            durations, record=True)
    assert ran.timeline == replayed.timeline
    for r in range(p):
        assert [task for rank, task, _, _ in ran.timeline if rank == r] == plans[r]
    dynamic = run_pipeline(topology, [GreedyPolicy(s) for s in stages], durations, record=True)
    assert any([t for rank, t, _, _ in dynamic.timeline if rank == r] != plans[r]
               for r in range(p)), "the durations never made the dynamic rule deviate"


def test_baselines_steadiness_is_the_spread_of_time_per_unit_of_work():
    """A seed is one iteration's batch: with nearly uniform costs every schedule's time per
    unit of work is the same each iteration; with cost CV 0.5 the fill and drain make it
    vary, and the column reports the largest deviation from the median."""
    from megatron.dpp.sim.baselines import SCHEDULES, largest_deviation, table

    assert largest_deviation([1.0, 1.1, 0.9]) == pytest.approx(0.1)
    (steady,) = table([4], cv=1e-4, slack=0, seeds=4)
    (varied,) = table([4], cv=0.5, slack=0, seeds=8)
    for name in SCHEDULES:
        assert steady[f"{name} deviation"] < 0.01, name
        assert varied[f"{name} deviation"] > 5 * steady[f"{name} deviation"], name


def test_baselines_take_the_hop_latency_and_task_jitter():
    """--latency delays every message, so no schedule finishes sooner than without it and
    1F1B, whose first microbatch's forward and backward cross every hop, finishes later;
    --jitter changes the durations sampled."""
    from megatron.dpp.sim.baselines import SCHEDULES, compare_one

    plain = compare_one(4, 0.5, 0, seed=3)
    late = compare_one(4, 0.5, 0, seed=3, latency=0.2)
    for name in SCHEDULES:
        assert late[name]["makespan"] >= plain[name]["makespan"] - 1e-9, name
    assert late["1f1b plain"]["makespan"] > plain["1f1b plain"]["makespan"] + 0.2
    jittered = compare_one(4, 0.5, 0, seed=3, jitter=0.3)
    assert jittered["1f1b plain"]["makespan"] != plain["1f1b plain"]["makespan"]
