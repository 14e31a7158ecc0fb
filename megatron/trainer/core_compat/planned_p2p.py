"""megatron-core's pipeline schedules with every microbatch's shape known from the plan.

With variable lengths (`config.variable_seq_lengths`) megatron-core's p2p sends each
message's shape ahead of it and then calls torch.cuda.synchronize() (P2PCommunicator.
_communicate_shapes): a device sync per exchange, which drains the GPU's queue and leaves it
idle while the host launches again. Every stage of this trainer plans the global batch
itself (data/microbatches.py), so each microbatch's shape is known on every stage before the
step: PlannedShapesP2P takes the receive shapes from that plan, in the order the schedule
passes the microbatches (boundary_messages: megatron-core's 1F1B and its interleaved
schedule), and checks each tensor it sends against it, so that a plan that disagrees with
the data stops the run with one error instead of a mismatched receive.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch.distributed as dist
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.pipeline_parallel.schedules import get_schedule_table
from megatron.core.process_groups_config import ProcessGroupCollection

from megatron.dpp.transport.channel import MessageKey, MessageKind
from megatron.trainer.core_compat.emulated_p2p import P2PLinks

# what megatron-core's schedules build for themselves when given no communicator (those of
# the names the installed version declares)
_DEFAULT_GROUPS = ("tp", "cp", "pp", "embd", "pos_embd", "dp", "dp_cp", "tp_dp_cp")
_DIRECTIONS = ("send_next", "send_prev", "recv_prev", "recv_next")


class PlannedShapeError(RuntimeError):
    """A pipeline message disagrees with the microbatch shapes the plan gave."""


class PlannedShapesP2P(P2PCommunicator):
    """P2P of megatron-core's schedule for one step whose messages' shapes are known:
    `messages` gives, for each direction (activations sent and received, gradients sent and
    received), the [s, b, h] of every message it passes on this stage, in order (None: the
    shapes are uniform, megatron-core's own). `links`: the emulated links its messages
    take (emulated_p2p.py), `link_keys` the key of each message by direction (the task it
    feeds at its receiver), which its delay is drawn by."""

    def __init__(self, pp_group, config, messages: dict[str, Sequence[Sequence[int]]] | None,
                 links: P2PLinks | None = None,
                 link_keys: dict[str, list[MessageKey]] | None = None):
        super().__init__(pp_group=pp_group, config=config)
        self.messages = None if messages is None else {
            direction: [tuple(int(d) for d in shape) for shape in messages[direction]]
            for direction in _DIRECTIONS}
        self._done = dict.fromkeys(_DIRECTIONS, 0)
        self.links = links
        self.link_keys = link_keys
        self._linked = dict.fromkeys(_DIRECTIONS, 0)

    def _communicate(self, *, tensor_send_next, tensor_send_prev, recv_prev, recv_next,
                     tensor_shape, wait_on_reqs=True):
        if self.links is None:
            return super()._communicate(
                tensor_send_next=tensor_send_next, tensor_send_prev=tensor_send_prev,
                recv_prev=recv_prev, recv_next=recv_next, tensor_shape=tensor_shape,
                wait_on_reqs=wait_on_reqs)
        keys = {direction: self._link_key(direction) for direction, present in (
            ("send_next", tensor_send_next is not None),
            ("send_prev", tensor_send_prev is not None),
            ("recv_prev", recv_prev), ("recv_next", recv_next)) if present}
        # sends on an emulated edge leave through the link's delivery thread, unwaited; the
        # activation first, as the neighbour posts its receive from its previous stage first
        delayed_next = delayed_prev = None
        if tensor_send_next is not None and self.links.delays_sends_to(self.next_rank):
            delayed_next, tensor_send_next = tensor_send_next, None
        if tensor_send_prev is not None and self.links.delays_sends_to(self.prev_rank):
            delayed_prev, tensor_send_prev = tensor_send_prev, None
        if self.messages is not None and (delayed_next is not None or delayed_prev is not None):
            self._communicate_shapes(delayed_next, delayed_prev, False, False)  # the plan's
        group = self._send_group()
        for tensor, peer, direction in ((delayed_next, self.next_rank, "send_next"),
                                        (delayed_prev, self.prev_rank, "send_prev")):
            if tensor is not None:
                self.links.send(tensor, peer, group, keys[direction])
        received_prev, received_next, reqs = super()._communicate(
            tensor_send_next=tensor_send_next, tensor_send_prev=tensor_send_prev,
            recv_prev=recv_prev, recv_next=recv_next, tensor_shape=tensor_shape,
            wait_on_reqs=wait_on_reqs)
        if self.links.gpu:
            if reqs:
                raise PlannedShapeError("an emulated link on GPUs delays received messages "
                                        "after megatron-core waited for them; "
                                        "--overlap-p2p-communication-warmup-flush returns "
                                        "them unwaited")
            self.links.delay_received(received_prev, self.prev_rank, keys.get("recv_prev"))
            self.links.delay_received(received_next, self.next_rank, keys.get("recv_next"))
        return received_prev, received_next, reqs

    def _link_key(self, direction: str) -> MessageKey:
        index, keys = self._linked[direction], self.link_keys[direction]
        if index == len(keys):
            raise PlannedShapeError(f"pipeline p2p ({direction}): a message beyond the "
                                    f"{len(keys)} of this step's schedule")
        self._linked[direction] = index + 1
        return keys[index]

    def _send_group(self):
        """The group megatron-core's receiver posts this rank's messages on: its own
        pipeline group, except that unbatched p2p between two stages receives from odd
        ranks on the world group (p2p_communication._p2p_ops)."""
        group = self.pp_group
        if (self.config.batch_p2p_comm or group.size() != 2 or group.rank() % 2 == 0
                or dist.get_backend(group) == "ucc"):
            return group
        return dist.group.WORLD

    def _next(self, direction: str) -> tuple[int, tuple[int, ...]]:
        index, planned = self._done[direction], self.messages[direction]
        if index == len(planned):
            raise PlannedShapeError(
                f"pipeline p2p ({direction}): a message beyond the plan's {len(planned)} "
                "of this step")
        self._done[direction] = index + 1
        return index, planned[index]

    def _communicate_shapes(self, tensor_send_next, tensor_send_prev, recv_prev, recv_next):
        if self.messages is None:
            return super()._communicate_shapes(tensor_send_next, tensor_send_prev, recv_prev,
                                               recv_next)
        for direction, tensor in (("send_next", tensor_send_next),
                                  ("send_prev", tensor_send_prev)):
            if tensor is not None:
                index, planned = self._next(direction)
                if tuple(tensor.shape) != planned:
                    raise PlannedShapeError(
                        f"pipeline p2p ({direction}): message {index} of this step has shape "
                        f"{tuple(tensor.shape)}, the plan {planned}")
        return ([*self._next("recv_prev")[1]] if recv_prev else [0, 0, 0],
                [*self._next("recv_next")[1]] if recv_next else [0, 0, 0])


def boundary_tasks(num_microbatches: int, stage: int, pp_size: int, num_chunks: int,
                   group_size: int) -> dict[str, list[tuple[int, int]]]:
    """The (microbatch, model chunk of `stage`) of the messages each direction passes on
    `stage` in one step, in order; microbatch i is the i-th the schedule reads. 1F1B passes
    the microbatches in order in every direction. The interleaved schedule runs
    megatron-core's table of (microbatch, chunk) forward and, chunk by chunk in the same
    order, backward with the chunks reversed; the first stage's first chunk receives no
    activation and sends no gradient, the last stage's last chunk sends no activation and
    receives no gradient."""
    table = ([(mb, 0) for mb in range(num_microbatches)] if num_chunks == 1
             else get_schedule_table(num_microbatches, num_chunks, group_size))
    first, last = stage == 0, stage == pp_size - 1
    backward = [(microbatch, num_chunks - 1 - chunk) for microbatch, chunk in table]
    return {
        "recv_prev": [(mb, chunk) for mb, chunk in table if not (first and chunk == 0)],
        "send_next": [(mb, chunk) for mb, chunk in table
                      if not (last and chunk == num_chunks - 1)],
        "recv_next": [(mb, chunk) for mb, chunk in backward
                      if not (last and chunk == num_chunks - 1)],
        "send_prev": [(mb, chunk) for mb, chunk in backward if not (first and chunk == 0)],
    }


def boundary_messages(shapes: Sequence[Sequence[int]], stage: int, pp_size: int,
                      num_chunks: int, group_size: int) -> dict[str, list]:
    """The shapes of the messages each direction passes on `stage` in one step, given each
    microbatch's shape in the order the schedule reads them (boundary_tasks)."""
    tasks = boundary_tasks(len(shapes), stage, pp_size, num_chunks, group_size)
    return {direction: [shapes[mb] for mb, _ in tasks[direction]] for direction in tasks}


def boundary_link_keys(num_microbatches: int, stage: int, pp_size: int, num_chunks: int,
                       group_size: int) -> dict[str, list[MessageKey]]:
    """The key of each message boundary_tasks lists: the task it feeds at its receiver (an
    activation the next stage's forward, a gradient the previous stage's backward; the
    ring from the last stage to the first feeds the next chunk, and back the one before),
    as DPP's messages are keyed, so an emulated link draws the same delay for both."""
    tasks = boundary_tasks(num_microbatches, stage, pp_size, num_chunks, group_size)
    to_first, to_last = int(stage == pp_size - 1), int(stage == 0)
    activation, gradient = MessageKind.ACTIVATION, MessageKind.GRADIENT
    return {
        "send_next": [MessageKey(activation, c + to_first, mb) for mb, c in tasks["send_next"]],
        "send_prev": [MessageKey(gradient, c - to_last, mb) for mb, c in tasks["send_prev"]],
        "recv_prev": [MessageKey(activation, c, mb) for mb, c in tasks["recv_prev"]],
        "recv_next": [MessageKey(gradient, c, mb) for mb, c in tasks["recv_next"]],
    }


class PlannedShapes:
    """One stage's p2p for megatron-core's schedule, built once (the process groups, the
    stage's place); `arguments` gives each step's keyword arguments. `planned`: the
    receive shapes come from the plan (variable lengths); `links`: emulated links."""

    def __init__(self, pp_group, stage: int, config, num_chunks: int, sequence_split: int,
                 planned: bool = True, links: P2PLinks | None = None):
        self.pp_group, self.stage, self.config = pp_group, stage, config
        self.planned, self.links = planned, links
        self.pp_size = pp_group.size()
        self.num_chunks = num_chunks
        self.group_size = config.microbatch_group_size_per_vp_stage or self.pp_size
        self.sequence_split = sequence_split  # CP, and TP under sequence parallelism
        # megatron-core's own default groups: its schedules take a communicator only with them
        declared = {field.name for field in dataclasses.fields(ProcessGroupCollection)}
        self.groups = ProcessGroupCollection.use_mpu_process_groups(
            required_pgs=[name for name in _DEFAULT_GROUPS if name in declared])

    def arguments(self, microbatches: Sequence[tuple[int, int]], iteration: int) -> dict:
        """The schedule's `p2p_communicator` and `pg_collection` for one step of training
        iteration `iteration` whose microbatches are (padded length, rows), in the order the
        schedule reads them."""
        messages = link_keys = None
        if self.planned:
            shapes = [(length // self.sequence_split, rows, self.config.hidden_size)
                      for length, rows in microbatches]
            messages = boundary_messages(shapes, self.stage, self.pp_size, self.num_chunks,
                                         self.group_size)
        if self.links is not None:
            self.links.set_iteration(iteration)
            link_keys = boundary_link_keys(len(microbatches), self.stage, self.pp_size,
                                           self.num_chunks, self.group_size)
        return {"p2p_communicator": PlannedShapesP2P(self.pp_group, self.config, messages,
                                                     self.links, link_keys),
                "pg_collection": self.groups}
