"""The dynamic rule's choice among a stage's pending W tasks with
`StageConfig.weights_by_backward` (megatron/dpp/policy.py, `_cheapest_weight_first`): the one
whose B was shortest runs first, the longest are kept for the drain; by default, in the plan
in order and without B durations the W tasks keep the microbatch order. The trainer on CPU
orders them so, and its gradients do not depend on that order."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from megatron.dpp.actions import BACKWARD, WEIGHT, read_actions
from megatron.dpp.engine import run_pipeline
from megatron.dpp.plan import StageConfig
from megatron.dpp.policy import GreedyPolicy
from megatron.dpp.sim import simulate as simulate_cli
from megatron.dpp.sim.bounds import in_order_bound
from megatron.dpp.sim.simulator import CostModel, sample_durations
from megatron.dpp.topology import PipelineTopology
from megatron.dpp.variability import StragglerProfile
from tests.distributed import run_ranks
from tests.pipeline_runs import TINY_GPT
from tests.trainer_runs import train_runs, with_flags

M = 8
B_DURATIONS = [1.0, 6.0, 4.0, 2.0, 7.0, 5.0, 3.0, 1.0]


def _drive(policy: GreedyPolicy, report: bool) -> list[tuple[str, int, list[int]]]:
    """Every input there at once: each task run (a W once per part), with the microbatches
    whose W was pending (B ran, W not finished) when it was chosen."""
    ran, pending, parts = [], [], {}
    while not policy.finished:
        task = policy.next_task(lambda task: True)
        ran.append((task[0], task[2], list(pending)))
        if task[0] == BACKWARD:
            pending.append(task[2])
        elif task[0] == WEIGHT:
            parts[task[2]] = parts.get(task[2], 0) + 1
            if parts[task[2]] == policy.stage.weight_slices:
                pending.remove(task[2])
        policy.complete(task, B_DURATIONS[task[2]] if report and task[0] == BACKWARD else None)
    return ran


def _weights(ran) -> list[int]:
    return [microbatch for kind, microbatch, _ in ran if kind == WEIGHT]


def _stage(**options) -> StageConfig:
    return StageConfig(0, 4, 1, M, slack=2, split_backward=True, **options)


def test_the_rule_runs_the_pending_w_whose_b_was_shortest():
    ran = _drive(GreedyPolicy(_stage(weights_by_backward=True)), True)
    choices = [(microbatch, pending) for kind, microbatch, pending in ran
               if kind == WEIGHT and len(pending) > 1]
    assert choices, "no W was chosen among several pending ones"
    for microbatch, pending in choices:
        assert B_DURATIONS[microbatch] == min(B_DURATIONS[k] for k in pending)
    assert _weights(ran) != sorted(_weights(ran))


@pytest.mark.parametrize("by_backward, static, report", [
    (False, False, True), (True, True, True), (True, False, False)])
def test_by_default_in_the_plan_in_order_and_without_durations_ws_keep_the_order(
        by_backward, static, report):
    policy = GreedyPolicy(_stage(weights_by_backward=by_backward), static=static)
    assert _weights(_drive(policy, report)) == list(range(M))


def test_a_w_run_in_parts_finishes_before_another_starts():
    stage = _stage(weight_slices=2, weights_by_backward=True)
    weights = _weights(_drive(GreedyPolicy(stage), True))
    assert weights[0::2] == weights[1::2]
    assert weights[0::2] != list(range(M))


def test_with_the_b_durations_the_rule_keeps_the_long_ws_for_the_drain():
    """Stragglers (a W straggles with its B), the last stage 1.5x as slow, slack 2: with the
    W tasks ordered by their B times the rule ends no later than in microbatch order on any
    of five draws and earlier on some, and within 0.5 % of the in-order bound at its memory
    on each."""
    p, m = 4, 16
    model = CostModel(straggler=StragglerProfile.parse("all:0.1:3"), weight_share=0.15,
                      backward_ratio=0.86, slow_stage=3, slow_factor=1.5)
    topology = PipelineTopology(p)
    gained = 0
    for seed in range(5):
        times = sample_durations(model, p, 1, m, seed, split_backward=True).by_kind(True)

        def policies(by_backward: bool):
            return [GreedyPolicy(StageConfig(r, p, 1, m, slack=2, split_backward=True,
                                             weights_by_backward=by_backward))
                    for r in range(p)]

        informed = run_pipeline(topology, policies(True), times)
        blind = run_pipeline(topology, policies(False), times)
        assert informed.makespan <= blind.makespan + 1e-9, seed
        gained += informed.makespan < blind.makespan - 1e-9
        bound = in_order_bound(times, p, m, informed.peak_in_flight)
        assert informed.makespan <= 1.005 * bound, (seed, informed.makespan, bound)
    assert gained


def _simulated(extra: list[str]) -> dict:
    argv = ["--pp", "4", "--microbatches", "16", "--split-backward", "--forward-ms", "5",
            "--backward-ratio", "0.9", "--weight-share", "0.15", "--slow-stage", "3",
            "--slow-factor", "1.5", "--emulate-straggler", "all:0.1:3", "--seed", "3",
            "--slack", "2", "--schedules", "1f1b", "dpp", "dpp-static", "--json", *extra]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        simulate_cli.main(argv)
    return json.loads(out.getvalue())["schedules"]


def test_the_simulator_flag_moves_the_rule_only():
    """`--weights-by-backward`: the rule ends earlier on this draw, 1F1B and the plan in order
    take what they took without it; without --split-backward the flag is refused."""
    plain, ordered = _simulated([]), _simulated(["--weights-by-backward"])
    assert ordered["dpp"]["makespan"] < plain["dpp"]["makespan"]
    for name in ("1f1b", "dpp-static"):
        assert ordered[name]["makespan"] == plain[name]["makespan"]
    with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()) as err:
        simulate_cli.main(["--pp", "4", "--weights-by-backward"])
    assert "--split-backward" in err.getvalue()


def test_on_cpu_the_trainer_orders_ws_by_b_time_and_the_gradients_keep_their_bits(tmp_path):
    """The trainer at PP=2 on CPU, the dynamic rule at slack 2: calm, with stage 0's and
    with stage 1's tasks straggling (time only), each stage runs its W tasks in the order
    its B times give, which differ between the runs; the losses and gradient norms are the
    same to the bit, since the store sums in B order whatever the W order."""
    flags = with_flags(TINY_GPT, pipeline_model_parallel_size=2, global_batch_size=16,
                       train_iters=2, use_dpp=True, dpp_max_inflight=2, no_dpp_static=True,
                       dpp_transport="torch", trace=True, trace_iters=[2])
    stragglers = [None, "0:0.4:6", "1:0.4:6"]
    runs = [with_flags(flags, trace_dir=tmp_path / str(k), emulate_straggler=straggler)
            for k, straggler in enumerate(stragglers)]
    results = run_ranks(2, train_runs, runs, 2)
    w_orders = []
    for k in range(len(runs)):
        ranks = {}
        for path in (tmp_path / str(k)).glob("*actions*"):
            for tasks in read_actions(str(path)).values():
                for rank, ran in tasks.items():
                    ranks[rank] = [t.microbatch for t in ran if t.kind == WEIGHT]
        assert sorted(ranks) == [0, 1], f"no actions traced in run {k}"
        w_orders.append(ranks)
    assert any(order != sorted(order) for ranks in w_orders for order in ranks.values()), \
        "no stage ran its W tasks out of microbatch order"
    assert len({repr(ranks) for ranks in w_orders}) > 1, "every run ran one W order"
    for rank_results in results:
        calm, *straggling = rank_results
        for run in straggling:
            assert run["losses"] == calm["losses"]
            assert run["grad_norms"] == calm["grad_norms"]
