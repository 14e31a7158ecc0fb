"""The runtime's emulation and the simulator draw from one model (megatron/dpp/variability.py):
for the same seed, each message gets the same delay and each task the same straggle factor,
whichever runtime carries it (DPP's send channels, megatron-core's p2p) and in the
simulator's engine."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron.dpp.actions import BACKWARD, FORWARD, Task
from megatron.dpp.sim.simulator import CostModel, link_latency, sample_durations
from megatron.dpp.topology import PipelineTopology
from megatron.dpp.transport import pipeline
from megatron.dpp.transport.channel import Edge, MessageKey, MessageKind, SendChannel
from megatron.dpp.transport.emulation import EdgeDelays
from megatron.dpp.variability import Emulation, LinkProfile, StragglerProfile
from megatron.trainer.core_compat.planned_p2p import boundary_link_keys

SEED, ITERATION, PP, CHUNKS, MICROBATCHES = 21, 3, 4, 2, 8
NBYTES = 64 * 32 * 8


class _Recorded(SendChannel):
    """A send channel that keeps what reached it."""

    def __init__(self, edge: Edge):
        self.edge, self.sent = edge, []

    def send(self, key, tensor):
        self.sent.append(key)

    def flush(self, timeout=None):
        pass

    def close(self, abort=False):
        pass


class _RecordedDelivery:
    """A delivery thread's stand-in: runs each action at once, keeping its delay."""

    def __init__(self, name: str):
        self.delays: list[float] = []

    def post(self, action, delay_s: float) -> None:
        self.delays.append(delay_s)
        action()

    def close(self, abort=False, timeout=None):
        pass


def _dpp_messages(topology: PipelineTopology, rank: int):
    """(destination rank, key) of every message `rank` sends under DPP, as its schedule
    keys them: the task each output feeds."""
    for kind in (FORWARD, BACKWARD):
        for chunk in range(topology.num_chunks):
            for microbatch in range(MICROBATCHES):
                route = topology.destination(rank, Task(kind, chunk, microbatch))
                if route is not None:
                    dst, consumer = route
                    message = (MessageKind.ACTIVATION if kind == FORWARD
                               else MessageKind.GRADIENT)
                    yield dst, MessageKey(message, consumer.chunk, consumer.microbatch)


def test_dpp_send_channels_delay_each_message_as_the_simulator_does(monkeypatch):
    link = LinkProfile(30.0, 20.0, 2.0, "all")
    emulation = Emulation(SEED, link)
    latency = link_latency(link, PP, SEED, ITERATION, NBYTES)
    topology = PipelineTopology(PP, CHUNKS)
    monkeypatch.setattr(pipeline, "DelayedDelivery", _RecordedDelivery)
    tensor = torch.zeros(64, 32, dtype=torch.float64)
    checked = 0
    for rank in range(PP):
        for dst, key in _dpp_messages(topology, rank):
            channel = pipeline.EmulatedSendChannel(
                _Recorded(Edge(rank, dst, key.kind)), EdgeDelays(emulation, rank, dst),
                torch.device("cpu"), None, 60.0, host_staged=False)
            channel.delays.iteration = ITERATION
            channel.send(key, tensor)
            kind = FORWARD if key.kind == MessageKind.ACTIVATION else BACKWARD
            simulated = latency(rank, dst, Task(kind, key.chunk, key.microbatch))
            assert channel._delivery.delays == [pytest.approx(simulated / 1000.0, abs=1e-12)]
            assert channel.inner.sent == [key]
            checked += 1
    # every edge of the ring at two chunks, both kinds, every microbatch but the ends'
    assert checked == 2 * (PP * CHUNKS - 1) * MICROBATCHES
    # the jitter is drawn per message and per iteration
    delays = EdgeDelays(emulation, 0, 1)
    first = [delays.of(MessageKey(MessageKind.ACTIVATION, 0, i), 0) for i in range(8)]
    delays.iteration = ITERATION + 1
    assert len(set(first)) == 8 and first != [
        delays.of(MessageKey(MessageKind.ACTIVATION, 0, i), 0) for i in range(8)]


@pytest.mark.parametrize("chunks", [1, 2])
def test_megatron_cores_messages_are_keyed_as_dpp_keys_them(chunks):
    """Under megatron-core's 1F1B and interleaved schedules each message's key, at its
    sender and at its receiver, is the one DPP gives the same message, so the same link
    draws the same delay for it (on CPU the sender delays, on a GPU the receiver)."""
    topology = PipelineTopology(PP, chunks)
    keys = [boundary_link_keys(MICROBATCHES, stage, PP, chunks, PP) for stage in range(PP)]
    for stage in range(PP):
        following, previous = (stage + 1) % PP, (stage - 1) % PP
        sent = {MessageKind.ACTIVATION: [], MessageKind.GRADIENT: []}
        for dst, key in _dpp_messages(topology, stage):
            sent[key.kind].append((dst, key))
        assert sorted(sent[MessageKind.ACTIVATION]) == sorted(
            (following, key) for key in keys[stage]["send_next"])
        assert sorted(sent[MessageKind.GRADIENT]) == sorted(
            (previous, key) for key in keys[stage]["send_prev"])
        if chunks > 1 or stage < PP - 1:
            assert keys[stage]["send_next"] == keys[following]["recv_prev"]
        if chunks > 1 or stage > 0:
            assert keys[stage]["send_prev"] == keys[previous]["recv_next"]


class _RecordedTask:
    """StretchedTask's stand-in: keeps the factor each finished task was given."""

    factors: list[tuple[str, float]] = []

    def __init__(self, device):
        pass

    def finish(self, factor, sleeper=None, kind=FORWARD):
        self.factors.append((kind, factor))


def test_the_trainers_stragglers_are_the_simulators(monkeypatch):
    from megatron.trainer.run import emulation as trainer_emulation

    straggler = StragglerProfile(None, 0.3, 3.0)
    durations = sample_durations(CostModel(forward=float(CHUNKS), straggler=straggler), PP,
                                 CHUNKS, MICROBATCHES, SEED, iteration=ITERATION)
    topology = PipelineTopology(PP, CHUNKS)
    monkeypatch.setattr(trainer_emulation, "StretchedTask", _RecordedTask)

    def forward_step(data_iterator, model):
        return torch.ones(2, requires_grad=True) * 2, None

    stretched = 0
    for stage in range(PP):
        for chunk in range(CHUNKS):
            v = topology.virtual_stage(stage, chunk)
            for microbatch in range(MICROBATCHES):
                # the key ForwardRng sets: (iteration, microbatch, chunk * PP + stage)
                rng = SimpleNamespace(current_key=(ITERATION, microbatch, chunk * PP + stage),
                                      pp_rank=stage, pp_size=PP)
                hook = trainer_emulation.Stragglers(Emulation(SEED, straggler=straggler),
                                                    rng, torch.device("cpu"))
                _RecordedTask.factors = []
                output, _ = hook.wrap(forward_step)(None, None)
                output.sum().backward()
                applied = dict(_RecordedTask.factors)
                simulated_forward = durations.forward[v][microbatch]  # 1 without straggling
                simulated_backward = durations.backward[v][microbatch] / 2.0
                assert applied.get(FORWARD, 1.0) == pytest.approx(simulated_forward)
                assert applied.get(BACKWARD, 1.0) == pytest.approx(simulated_backward)
                stretched += len(applied)
    tasks = 2 * PP * CHUNKS * MICROBATCHES
    assert 0.15 * tasks < stretched < 0.45 * tasks
