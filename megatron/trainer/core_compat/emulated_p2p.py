"""Emulated links under megatron-core's pipeline schedules (1F1B, interleaved).

The trainer's p2p communicator (planned_p2p.PlannedShapesP2P) hands each message on an
emulated edge to `P2PLinks`. On CPU the sender returns at once and a delivery thread per
neighbour posts the real send once the message's delay has passed (emulation.py), so
neither megatron-core's wait on its send requests nor its batched p2p holds the sender for
the delay; the receiver's posted receive completes when the message comes. On a GPU the
sends stay in megatron-core's NCCL calls (a send moved out of a batch could deadlock the
communicator): each message received on an emulated edge becomes usable after a
device-side sleep on a link stream, counted from its arrival, and the compute stream
waits on the event after it.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from megatron.dpp.transport.channel import MessageKey
from megatron.dpp.transport.emulation import CudaLink, CudaSleep, DelayedDelivery, EdgeDelays
from megatron.dpp.transport.pipeline import EDGE_LOGGER
from megatron.dpp.variability import Emulation

edge_log = logging.getLogger(EDGE_LOGGER)


class P2PLinks:
    """The emulated links between this rank and its two pipeline neighbours, for the whole
    run (`close()` at its end). `pods[r]` is global rank r's pod; `ring`: the pipeline's
    last stage feeds its first (virtual chunks). Each message's delay is drawn by the
    iteration (`set_iteration`) and its key, the task it feeds (planned_p2p.py)."""

    def __init__(self, emulation: Emulation, pp_group, pods: list[str], device: torch.device,
                 ring: bool, timeout: float = 60.0):
        self.rank = dist.get_rank()
        self.pp_group = pp_group
        self.gpu = device.type == "cuda"
        self.timeout = timeout
        neighbours = _neighbours(pp_group, ring)
        stage_of = {rank: stage for stage, rank in
                    enumerate(dist.get_process_group_ranks(pp_group))}
        sleeper = CudaSleep() if self.gpu else None
        # one link a neighbour: its messages keep the order the schedule sent them in, which
        # is the order the neighbour posts its receives in
        self._links: dict[int, DelayedDelivery | CudaLink] = {}
        self._delays: dict[int, EdgeDelays] = {}
        for peer in neighbours:
            # on CPU the sender delays, on a GPU the receiver: the edge into this rank
            src, dst = (peer, self.rank) if self.gpu else (self.rank, peer)
            if emulation.link_between(pods[src], pods[dst]) is not None:
                self._delays[peer] = EdgeDelays(emulation, stage_of[src], stage_of[dst])
                self._links[peer] = (CudaLink(sleeper, device) if self.gpu
                                     else DelayedDelivery(f"{src}->{dst}"))
        log_edges(pp_group, pods, ring, set(self._links))

    def set_iteration(self, iteration: int) -> None:
        """The training iteration the next messages belong to."""
        for delays in self._delays.values():
            delays.iteration = iteration

    def delays_sends_to(self, peer: int) -> bool:
        return not self.gpu and peer in self._links

    def send(self, tensor: torch.Tensor, peer: int, group, key: MessageKey) -> None:
        """Post `tensor` (the message `key`) to `peer` on `group` once its delay has
        passed; returns at once. The schedule frees its output's storage after sending: the
        detached tensor keeps its own reference."""
        tensor = tensor.detach()
        delay_s = self._delays[peer].of(key, tensor.numel() * tensor.element_size())
        self._links[peer].post(lambda: dist.send(tensor, peer, group=group), delay_s)

    def delay_received(self, tensor: torch.Tensor | None, peer: int,
                       key: MessageKey | None) -> None:
        """GPU: the current stream uses `tensor` (the message `key`, received from `peer`)
        only after the link's delay."""
        link = self._links.get(peer) if self.gpu else None
        if tensor is None or link is None:
            return
        delay_s = self._delays[peer].of(key, tensor.numel() * tensor.element_size())
        _, delivered = link.delayed_stream(delay_s)
        torch.cuda.current_stream().wait_event(delivered)

    def close(self, abort: bool = False) -> None:
        for link in self._links.values():
            if isinstance(link, DelayedDelivery):
                link.close(abort, self.timeout)
        self._links.clear()


def _neighbours(pp_group, ring: bool) -> list[int]:
    """The global ranks this rank sends to: the next stage's (activations) and the
    previous stage's (gradients); without a `ring` the last stage has no next and the
    first no previous."""
    ranks = dist.get_process_group_ranks(pp_group)
    here = ranks.index(dist.get_rank())
    peers = []
    if ring or here < len(ranks) - 1:
        peers.append(ranks[(here + 1) % len(ranks)])
    if ring or here > 0:
        peers.append(ranks[(here - 1) % len(ranks)])
    return sorted(set(peers) - {ranks[here]})


def log_edges(pp_group, pods: list[str], ring: bool, emulated: set[int] = frozenset()) -> None:
    """One line per pipeline edge of this rank under megatron-core's schedules, to and
    from each neighbour: the process group's backend carries it (with NCCL, its transport
    follows the NCCL_* environment: docs/two_pods.md), across pods or not, emulated or not
    (`emulated`: the neighbours whose link is)."""
    rank = dist.get_rank()
    backend = dist.get_backend(pp_group)
    for peer in _neighbours(pp_group, ring):
        for src, dst in ((rank, peer), (peer, rank)):
            notes = [note for note in (
                "" if pods[src] == pods[dst] else f"across pods {pods[src]} -> {pods[dst]}",
                "emulated link" if peer in emulated else "") if note]
            edge_log.info("megatron-core p2p over %s for edge %d->%d%s", backend, src, dst,
                          f" ({', '.join(notes)})" if notes else "")
