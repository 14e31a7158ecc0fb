"""The torch.distributed channel backend: bytes arrive intact in any consumption order, and
a dead peer is an error, not a hang."""

from __future__ import annotations

import os
import random
import signal
import time

import pytest
import torch

from tests.distributed import run_ranks

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64]


def _message(seed: int) -> torch.Tensor:
    rng = random.Random(seed)
    shape = [rng.randint(1, 7) for _ in range(rng.randint(0, 4))]
    dtype = DTYPES[seed % len(DTYPES)]
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.int64:
        return torch.randint(-(2**40), 2**40, shape, generator=generator)
    return torch.randn(shape, generator=generator).to(dtype)


def _open(rank: int):
    import torch.distributed as dist

    from megatron.dpp.transport.channel import Edge, MessageKind, PythonInbox
    from megatron.dpp.transport.torch_backend import TorchBackend

    dist.init_process_group("gloo")
    edges = [Edge(0, 1, MessageKind.ACTIVATION), Edge(1, 0, MessageKind.GRADIENT)]
    inbox = PythonInbox()
    senders, receivers = TorchBackend(torch.device("cpu")).open(edges, rank, inbox)
    return inbox, senders, receivers


def _exchange(rank: int, count: int):
    import torch.distributed as dist

    from megatron.dpp.transport.channel import MessageKey, MessageKind

    inbox, senders, receivers = _open(rank)
    (sender,) = senders.values()
    kind = MessageKind.ACTIVATION if rank == 0 else MessageKind.GRADIENT
    incoming = MessageKind.GRADIENT if rank == 0 else MessageKind.ACTIVATION
    for i in range(count):
        sender.send(MessageKey(kind, i % 3, i), _message(1000 * rank + i))
    order = list(range(count))
    random.Random(rank).shuffle(order)
    peer = 1 - rank
    for i in order:
        received = inbox.take(MessageKey(incoming, i % 3, i), timeout=60)
        expected = _message(1000 * peer + i)
        assert received.dtype == expected.dtype and received.shape == expected.shape, i
        assert torch.equal(received, expected), f"message {i} corrupted"
    sender.flush(60)
    sender.close()
    for receiver in receivers.values():
        receiver.close()
    dist.destroy_process_group()
    return len(inbox)


def test_messages_arrive_intact_in_any_order():
    leftovers = run_ranks(2, _exchange, 400)
    assert leftovers == [0, 0]


def _survive_dead_peer(rank: int):
    from megatron.dpp.transport.channel import MessageKey, MessageKind, TransportError

    inbox, _, _ = _open(rank)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(TransportError, match="rank 1"):
        inbox.take(MessageKey(MessageKind.GRADIENT, 0, 0), timeout=30)
    return time.monotonic() - started


def test_dead_peer_raises_a_named_error():
    (waited,) = run_ranks(2, _survive_dead_peer, reporting=[0])
    assert waited < 30
