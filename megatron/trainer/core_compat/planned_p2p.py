"""megatron-core's 1F1B with every microbatch's shape known from the plan.

With variable lengths (`config.variable_seq_lengths`) megatron-core's p2p sends each
message's shape ahead of it and then calls torch.cuda.synchronize() (P2PCommunicator.
_communicate_shapes): a device sync per exchange, which drains the GPU's queue and leaves it
idle while the host launches again. Every stage of this trainer plans the global batch
itself (data/microbatches.py), so each microbatch's shape is known on every stage before the
step: PlannedShapesP2P takes the receive shapes from that plan, in the order the schedule
runs the microbatches, and checks each tensor it sends against it, so that a plan that
disagrees with the data stops the run with one error instead of a mismatched receive.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.process_groups_config import ProcessGroupCollection

# what megatron-core's non-interleaved schedule builds for itself when given no
# communicator (those of the names the installed version declares)
_DEFAULT_GROUPS = ("tp", "cp", "pp", "embd", "pos_embd", "dp", "dp_cp", "tp_dp_cp")
_DIRECTIONS = ("send_next", "send_prev", "recv_prev", "recv_next")


class PlannedShapeError(RuntimeError):
    """A pipeline message disagrees with the microbatch shapes the plan gave."""


class PlannedShapesP2P(P2PCommunicator):
    """P2P of megatron-core's 1F1B for one step whose microbatch shapes are `shapes`
    ([s, b, h] of each stage boundary's tensor, in the order the schedule runs them). In
    1F1B every direction (activations sent and received, gradients sent and received) passes
    the microbatches in that one order, so each keeps its own count of those done."""

    def __init__(self, pp_group, config, shapes: Sequence[Sequence[int]]):
        super().__init__(pp_group=pp_group, config=config)
        self.shapes = [tuple(int(d) for d in shape) for shape in shapes]
        self._done = dict.fromkeys(_DIRECTIONS, 0)

    def _next(self, direction: str) -> tuple[int, tuple[int, ...]]:
        index = self._done[direction]
        if index == len(self.shapes):
            raise PlannedShapeError(
                f"pipeline p2p ({direction}): a message beyond the plan's {len(self.shapes)} "
                "microbatches of this step")
        self._done[direction] = index + 1
        return index, self.shapes[index]

    def _communicate_shapes(self, tensor_send_next, tensor_send_prev, recv_prev, recv_next):
        for direction, tensor in (("send_next", tensor_send_next),
                                  ("send_prev", tensor_send_prev)):
            if tensor is not None:
                index, planned = self._next(direction)
                if tuple(tensor.shape) != planned:
                    raise PlannedShapeError(
                        f"pipeline p2p ({direction}): microbatch {index} of this step (in the "
                        f"schedule's order) has shape {tuple(tensor.shape)}, the plan "
                        f"{planned}")
        return ([*self._next("recv_prev")[1]] if recv_prev else [0, 0, 0],
                [*self._next("recv_next")[1]] if recv_next else [0, 0, 0])


def planned_schedule_arguments(pp_group, config, shapes: Sequence[Sequence[int]]) -> dict:
    """Keyword arguments of megatron-core's non-interleaved schedule for one step with the
    planned shapes: the communicator, and megatron-core's own default process groups (the
    schedule takes a communicator only together with them)."""
    declared = {field.name for field in dataclasses.fields(ProcessGroupCollection)}
    groups = ProcessGroupCollection.use_mpu_process_groups(
        required_pgs=[name for name in _DEFAULT_GROUPS if name in declared])
    return {"p2p_communicator": PlannedShapesP2P(pp_group, config, shapes),
            "pg_collection": groups}
