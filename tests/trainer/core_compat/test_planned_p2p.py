"""megatron-core's 1F1B with variable lengths takes each microbatch's shape from the plan
(core_compat/planned_p2p.py) instead of exchanging it, with a device sync, before every
message: the shapes handed out in order, a sent tensor off the plan named, and training at
PP=2 that never calls megatron-core's exchange and still gives PP=1's losses."""

from __future__ import annotations

import re

import pytest

from megatron.trainer.core_compat.planned_p2p import boundary_messages
from tests.distributed import run_ranks
from tests.trainer.data.test_microbatch_tokens import DRAWN, SYNTHETIC
from tests.trainer_runs import train_runs, with_flags

PLANNED_LINE = "each microbatch's shape comes from the plan"


def _exchanges_by_plan(rank):
    import torch
    import torch.distributed as dist
    from megatron.core.model_parallel_config import ModelParallelConfig

    from megatron.trainer.core_compat.planned_p2p import (
        PlannedShapeError,
        PlannedShapesP2P,
        boundary_messages,
    )

    dist.init_process_group("gloo", rank=rank, world_size=1)
    try:
        shapes = [(128, 2, 8), (256, 1, 8), (64, 4, 8)]
        p2p = PlannedShapesP2P(dist.group.WORLD, ModelParallelConfig(),
                               boundary_messages(shapes, 1, 3, 1, 3))
        seen = {
            # microbatch 0's activation out, microbatch 0's in
            "send_recv": p2p._communicate_shapes(torch.empty(128, 2, 8), None, True, False),
            # microbatch 1's activation in, microbatch 0's gradient in
            "recv_both": p2p._communicate_shapes(None, None, True, True),
            "send_only": p2p._communicate_shapes(None, torch.empty(128, 2, 8), False, False),
        }
        errors = []
        try:  # microbatch 1 is (256, 1, 8)
            p2p._communicate_shapes(torch.empty(128, 2, 8), None, False, False)
        except PlannedShapeError as error:
            errors.append(str(error))
        # the third activation received is microbatch 2's; a fourth is past the plan
        seen["third"] = p2p._communicate_shapes(None, None, True, False)
        try:
            p2p._communicate_shapes(None, None, True, False)
        except PlannedShapeError as error:
            errors.append(str(error))
        return seen, errors
    finally:
        dist.destroy_process_group()


def test_shapes_come_from_the_plan_in_order_and_sends_are_checked():
    seen, errors = run_ranks(1, _exchanges_by_plan)[0]
    assert seen["send_recv"] == ([128, 2, 8], [0, 0, 0])
    assert seen["recv_both"] == ([256, 1, 8], [128, 2, 8])
    assert seen["send_only"] == ([0, 0, 0], [0, 0, 0])
    assert seen["third"] == ([64, 4, 8], [0, 0, 0])
    assert len(errors) == 2, errors
    assert "send_next" in errors[0] and "message 1" in errors[0]
    assert "(128, 2, 8)" in errors[0] and "(256, 1, 8)" in errors[0]
    assert "recv_prev" in errors[1] and "beyond the plan's 3" in errors[1]


@pytest.mark.parametrize("pp_size,num_chunks,microbatches,group",
                         [(2, 1, 5, 2), (2, 2, 4, 2), (4, 2, 8, 4), (3, 3, 7, 3), (4, 2, 10, 5)])
def test_each_message_a_stage_sends_is_the_one_its_peer_expects(pp_size, num_chunks,
                                                                 microbatches, group):
    """Messages between two stages arrive in the order sent: every stage's activations out
    are its next stage's activations in (the last stage's go to the first, whose later
    chunks take them), its gradients out its previous stage's gradients in, and each
    direction passes (chunks - 1) x microbatches messages on the outer stages' wrapping
    edges and chunks x microbatches elsewhere."""
    shapes = [(16 * (i + 1), 1 + i % 3, 8) for i in range(microbatches)]
    stages = [boundary_messages(shapes, stage, pp_size, num_chunks, group)
              for stage in range(pp_size)]
    for stage in range(pp_size):
        following = (stage + 1) % pp_size
        if num_chunks == 1 and stage == pp_size - 1:
            continue  # no edge from the last stage back to the first
        assert stages[stage]["send_next"] == stages[following]["recv_prev"], stage
        assert stages[following]["send_prev"] == stages[stage]["recv_next"], stage
    if num_chunks > 1:
        assert len(stages[0]["recv_prev"]) == (num_chunks - 1) * microbatches
        assert len(stages[-1]["send_next"]) == (num_chunks - 1) * microbatches
        assert len(stages[0]["send_next"]) == num_chunks * microbatches
    # every microbatch's shape, each as often as it crosses the edge
    assert sorted(stages[0]["send_next"]) == sorted(shapes * num_chunks)


def _training_counting_exchanges(rank, runs, world_size):
    """train_runs, with the calls of megatron-core's own shape exchange and of the planned
    one counted: (results, {class name: calls})."""
    from megatron.core.pipeline_parallel import p2p_communication

    from megatron.trainer.core_compat import planned_p2p

    calls = {"P2PCommunicator": 0, "PlannedShapesP2P": 0}
    originals = {}
    for owner in (p2p_communication.P2PCommunicator, planned_p2p.PlannedShapesP2P):
        exchange = originals[owner] = owner.__dict__["_communicate_shapes"]

        # megatron-core's signature: the trainer checks it at start-up
        def counted(self, tensor_send_next, tensor_send_prev, recv_prev, recv_next,
                    exchange=exchange, name=owner.__name__):
            calls[name] += 1
            return exchange(self, tensor_send_next, tensor_send_prev, recv_prev, recv_next)

        owner._communicate_shapes = counted
    try:
        return train_runs(rank, runs, world_size), calls
    finally:
        for owner, exchange in originals.items():
            owner._communicate_shapes = exchange


def _trains_as_pp1_by_the_plan(flags: list[str], runs: list[list[str]], world: int):
    """PP=1 on `flags`, then `runs` on `world` ranks: on every rank megatron-core's exchange
    is never called and the planned one is, and the last rank's losses are PP=1's. Returns
    the PP=1 run and the last rank's runs."""
    (single,) = run_ranks(1, train_runs, [flags], 1)[0]
    reference = [entry["lm loss"] for entry in single["losses"]]
    assert len(reference) >= 2 and all(0 < x < 20 for x in reference)
    per_rank = run_ranks(world, _training_counting_exchanges, runs, world)
    for rank, (_, calls) in enumerate(per_rank):
        assert calls["P2PCommunicator"] == 0 and calls["PlannedShapesP2P"] > 0, (rank, calls)
    for index, run in enumerate(per_rank[-1][0]):
        assert [entry["lm loss"] for entry in run["losses"]] == pytest.approx(
            reference, rel=2e-5), index
    return single, per_rank[-1][0]


@pytest.mark.slow
def test_one_f_one_b_trains_on_planned_shapes_without_the_exchange():
    """--seq-length-cv under a token budget: 4-5 microbatches of varying shapes per
    iteration. At PP=2 megatron-core's 1F1B, natural and cost order, passes every message
    through the planned shapes, never calls its own exchange on either stage, logs so, and
    gives PP=1's losses."""
    pp2 = with_flags(DRAWN, pipeline_model_parallel_size=2)
    _, runs = _trains_as_pp1_by_the_plan(DRAWN, [pp2, with_flags(pp2, microbatch_order="cost")],
                                         2)
    assert all(any(PLANNED_LINE in message for _, message in run["logs"]) for run in runs)


@pytest.mark.slow
def test_a_length_per_microbatch_takes_the_planned_shapes_too():
    """--seq-length-cv without a budget (a length drawn per microbatch of 2, buckets of 32):
    at PP=2 megatron-core's 1F1B receives by the plan on both stages and gives PP=1's
    losses."""
    flags = with_flags(SYNTHETIC, pad_to_multiple=32)
    _trains_as_pp1_by_the_plan(flags, [with_flags(flags, pipeline_model_parallel_size=2)], 2)


@pytest.mark.slow
def test_the_interleaved_schedule_takes_the_planned_shapes_too():
    """megatron-core's interleaved schedule (PP=4, two chunks a stage, 4 microbatches of a
    length drawn for each), natural and cost order: no shape exchange on any stage, PP=1's
    losses."""
    flags = with_flags(SYNTHETIC, pad_to_multiple=32, num_layers=8)
    interleaved = with_flags(flags, pipeline_model_parallel_size=4,
                             num_layers_per_virtual_pipeline_stage=1)
    _trains_as_pp1_by_the_plan(
        flags, [interleaved, with_flags(interleaved, microbatch_order="cost")], 4)


@pytest.mark.slow
def test_evaluation_and_the_interleaved_schedule_at_pp2_take_the_planned_shapes():
    """PP=2 with two chunks a stage, a length drawn per microbatch, a validation step after
    each iteration: megatron-core's interleaved schedule (once refused here: its batched
    shape exchange with the one neighbour swapped the activation's and the gradient's) and
    1F1B never call the exchange, in training or evaluation, and give PP=1's training and
    validation losses."""
    flags = with_flags(SYNTHETIC, pad_to_multiple=32, eval_iters=1, eval_interval=1)
    pp2 = with_flags(flags, pipeline_model_parallel_size=2)
    single, runs = _trains_as_pp1_by_the_plan(
        flags, [pp2, with_flags(pp2, num_layers_per_virtual_pipeline_stage=1)], 2)
    validation = _losses(single["logs"])
    assert len(validation) == 2, single["logs"]
    for run in runs:
        assert _losses(run["logs"]) == pytest.approx(validation, rel=2e-5)


def _losses(logs) -> list[float]:
    """The loss values of a run's validation lines."""
    return [float(value) for _, line in logs if "validation at" in line
            for value in re.findall(r"value: (\S+)", line)]

