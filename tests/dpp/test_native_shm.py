"""Shared-memory channels of the native transport, between real processes (gloo for the
collective open)."""

from __future__ import annotations

import multiprocessing
import os
import queue
import random
import signal
import threading
import time
import traceback

import pytest
import torch

from megatron.dpp.transport import native
from megatron.trainer.launch import free_port

pytestmark = pytest.mark.skipif(
    not native.available(), reason="native transport extension megatron.dpp._native not built")

MESSAGES = 10_000
DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.int64)
SLOTS, SLOT_BYTES = 8, 64 << 10  # small ring: fragmentation and full-ring waits happen


def job_token() -> str:
    """A job's segment-name token, so that a test looks for its own job's segments only
    (test files running beside it create and remove theirs meanwhile)."""
    return "test" + os.urandom(6).hex()


def job_segments(token: str) -> set[str]:
    """The segments of `_edges()` that a job with this token left in /dev/shm."""
    from megatron.dpp.transport.shm import segment_name

    return {name for name in (segment_name(token, edge).lstrip("/") for edge in _edges())
            if os.path.exists(f"/dev/shm/{name}")}


def message_tensor(src: int, index: int) -> torch.Tensor:
    """The index-th message of rank src: random dtype, rank and shape; every 500th is
    larger than several slots."""
    pick = random.Random(src * 1_000_003 + index)
    dtype = pick.choice(DTYPES)
    if index % 500 == 7:
        shape = [3, 50_000]
    else:
        shape = [pick.randint(1, 9) for _ in range(pick.randint(0, 4))]
    generator = torch.Generator().manual_seed(src * 1_000_003 + index)
    if dtype == torch.int64:
        return torch.randint(-(2**40), 2**40, shape, dtype=dtype, generator=generator)
    return torch.randn(shape, generator=generator).to(dtype)


def checksum(tensor: torch.Tensor) -> float:
    return float(tensor.double().mul(torch.arange(tensor.numel()).reshape(tensor.shape)).sum())


def key_of(kind, index: int):
    from megatron.dpp.transport.channel import MessageKey

    return MessageKey(kind, index % 3, index)


def _init(rank: int, port: int, world: int = 2):
    import torch.distributed as dist

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)


def _edges():
    from megatron.dpp.transport.channel import Edge, MessageKind

    return [Edge(0, 1, MessageKind.ACTIVATION), Edge(1, 0, MessageKind.GRADIENT)]


def exchange_worker(rank: int, port: int, messages: int, gpu_path: str | None, token: str,
                    results) -> None:
    """Both directions at once: a thread sends while the main thread takes the peer's
    messages in shuffled blocks (out of order) and checks each against its checksum.
    With `gpu_path` the tensors live on the GPUs (rank % GPU count) and travel that way."""
    try:
        _init(rank, port)
        from megatron.dpp.transport.native import NativeInbox
        from megatron.dpp.transport.shm import ShmBackend

        device = torch.device("cpu")
        if gpu_path is not None:
            device = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(device)
        inbox = NativeInbox()
        backend = ShmBackend(timeout=10.0, slots=SLOTS, slot_bytes=SLOT_BYTES,
                             device_slot_bytes=SLOT_BYTES, path=gpu_path or "auto",
                             token=token)
        senders, receivers = backend.open(_edges(), rank, inbox)
        (out_edge,), (in_edge,) = senders, receivers
        send_failure = []

        def send_all():
            try:
                for index in range(messages):
                    senders[out_edge].send(key_of(out_edge.kind, index),
                                           message_tensor(rank, index).to(device))
            except Exception as error:
                send_failure.append(error)

        sender_thread = threading.Thread(target=send_all)
        sender_thread.start()
        order = random.Random(rank)
        mismatches = 0
        for start in range(0, messages, 100):
            block = list(range(start, min(start + 100, messages)))
            order.shuffle(block)
            for index in block:
                got = inbox.take(key_of(in_edge.kind, index), timeout=30)
                if got.device != device:
                    mismatches += 1
                got = got.cpu()
                expected = message_tensor(in_edge.src, index)
                if (got.dtype != expected.dtype or got.shape != expected.shape
                        or checksum(got) != checksum(expected) or not torch.equal(got, expected)):
                    mismatches += 1
        sender_thread.join()
        for channel in [*senders.values(), *receivers.values()]:
            channel.close()
        results.put((rank, "ok", mismatches, send_failure and repr(send_failure[0]), len(inbox)))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


def kill_worker(rank: int, port: int, victim: int, timeout: float, token: str,
                results) -> None:
    """Rank `victim` kills itself with SIGKILL after 50 messages; the other must raise a
    TransportError naming the dead peer within the timeout."""
    try:
        _init(rank, port)
        from megatron.dpp.transport.channel import TransportError
        from megatron.dpp.transport.native import NativeInbox
        from megatron.dpp.transport.shm import ShmBackend

        inbox = NativeInbox()
        senders, _ = ShmBackend(timeout=timeout, slots=SLOTS, slot_bytes=SLOT_BYTES,
                                token=token).open(_edges()[:1], rank, inbox)
        if rank == victim:
            if rank == 0:
                for index in range(50):
                    senders[_edges()[0]].send(key_of(_edges()[0].kind, index),
                                              message_tensor(0, index))
            else:
                for index in range(50):
                    inbox.take(key_of(_edges()[0].kind, index), timeout=30)
            results.put((rank, "dying"))
            time.sleep(0.2)
            os.kill(os.getpid(), signal.SIGKILL)
        started = None
        try:
            index = 0
            while True:
                if rank == 0:
                    senders[_edges()[0]].send(key_of(_edges()[0].kind, index),
                                              message_tensor(0, index))
                else:
                    inbox.take(key_of(_edges()[0].kind, index), timeout=4 * timeout)
                index += 1
                if index == 50:
                    started = time.monotonic()
        except TransportError as error:
            elapsed = time.monotonic() - (started or time.monotonic())
            results.put((rank, "raised", str(error), elapsed))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    # The dead peer can never join a teardown collective: leave without one, after the
    # queue's feeder thread delivered the result.
    results.close()
    results.join_thread()
    os._exit(0)


def run_job(target, world: int, *args):
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [context.Process(target=target, args=(rank, port, *args, results))
                 for rank in range(world)]
    for process in processes:
        process.start()
    return processes, results


def collect(processes, results, expected: int, deadline: float = 60.0):
    found = []
    end = time.monotonic() + deadline
    try:
        while len(found) < expected:
            found.append(results.get(timeout=max(0.1, end - time.monotonic())))
    except queue.Empty:
        pass
    for process in processes:
        process.join(timeout=max(0.1, end - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join()
    errors = [item[2] for item in found if item[1] == "error"]
    assert not errors, "\n".join(errors)
    assert len(found) == expected, f"only {found} arrived before the deadline"
    return found


def test_exchange_random_messages_both_directions_out_of_order():
    token = job_token()
    processes, results = run_job(exchange_worker, 2, MESSAGES, None, token)
    found = collect(processes, results, 2)
    for rank, status, mismatches, send_failure, leftover in found:
        assert status == "ok"
        assert mismatches == 0, f"rank {rank}: {mismatches} messages differ"
        assert not send_failure, f"rank {rank}: {send_failure}"
        assert leftover == 0
    assert job_segments(token) == set()
    assert all(process.exitcode == 0 for process in processes)


def test_two_jobs_with_the_same_ranks_side_by_side():
    tokens = [job_token(), job_token()]
    jobs = [run_job(exchange_worker, 2, 1000, None, token) for token in tokens]
    for processes, results in jobs:
        for _, status, mismatches, send_failure, _ in collect(processes, results, 2):
            assert status == "ok" and mismatches == 0 and not send_failure
    assert set().union(*map(job_segments, tokens)) == set()


@pytest.mark.skipif(not (torch.cuda.is_available() and native.build_info()["cuda"]),
                    reason="needs a CUDA GPU and the extension built with CUDA")
@pytest.mark.parametrize("path", ["ipc", "staged"])
def test_gpu_tensors_arrive_intact_over_each_gpu_path(path):
    """Two processes (on two GPUs where there are two): GPU tensors of every dtype, many
    larger than a slot, both directions, taken out of order."""
    token = job_token()
    processes, results = run_job(exchange_worker, 2, 2000, path, token)
    for rank, status, mismatches, send_failure, leftover in collect(processes, results, 2, 120):
        assert status == "ok" and not send_failure, (rank, send_failure)
        assert mismatches == 0, f"rank {rank}: {mismatches} messages differ"
        assert leftover == 0
    assert job_segments(token) == set()


@pytest.mark.parametrize("victim", [1, 0], ids=["receiver-killed", "sender-killed"])
def test_kill_minus_9_makes_the_peer_raise_a_named_error(victim):
    timeout = 2.0
    token = job_token()
    processes, results = run_job(kill_worker, 2, victim, timeout, token)
    found = collect(processes, results, 2)
    survivor = [item for item in found if item[0] != victim]
    assert [item[1] for item in survivor] == ["raised"], found
    _, _, message, elapsed = survivor[0]
    assert f"pipeline peer rank {victim} (pid" in message and "died" in message, message
    assert elapsed < timeout + 2.0
    assert processes[victim].exitcode == -signal.SIGKILL
    assert job_segments(token) == set()


def test_receiver_removes_its_segment_when_the_sender_never_attaches():
    from megatron.dpp.transport.channel import Edge, MessageKind, TransportError
    from megatron.dpp.transport.native import NativeInbox
    from megatron.dpp.transport.shm import ShmBackend, segment_name

    token = job_token()
    edge = Edge(1, 0, MessageKind.GRADIENT)
    inbox = NativeInbox()
    _, receivers = ShmBackend(timeout=0.5, token=token).open([edge], 0, inbox)
    assert os.path.exists("/dev/shm" + segment_name(token, edge))
    with pytest.raises(TransportError, match="attach"):
        inbox.take(key_of(edge.kind, 0), timeout=5)
    assert not os.path.exists("/dev/shm" + segment_name(token, edge))
    receivers[edge].close()


def test_a_message_whose_size_does_not_match_its_shape_fails_by_name():
    from megatron.dpp.transport.channel import TransportError
    from megatron.dpp.transport.native import NativeInbox

    extension = native.module()
    name = "/dpp-mismatch" + os.urandom(6).hex()
    receiver = extension.ShmReceiver(name, SLOTS, SLOT_BYTES, 0, 1, 5.0)
    inbox = NativeInbox()
    drain = extension.ShmDrain(receiver, inbox.mailbox, "shm channel 1->0 (test)", -1, 0, 0)
    sender = extension.ShmSender(name, 1, 0, 5.0)
    payload = torch.zeros(2, dtype=torch.float32)
    # Three float32 values need 12 bytes; the message carries 8.
    sender.send(0, 0, 0, 0, [3], payload.data_ptr(), 8)
    with pytest.raises(TransportError, match=r"1->0 \(test\).*8 bytes does not match"):
        inbox.take(key_of(0, 0), timeout=5)
    drain.join()
    sender.close()
    receiver.close()
    assert not os.path.exists("/dev/shm" + name)


def test_bad_settings_are_rejected_by_name():
    from megatron.dpp.transport.shm import ShmBackend

    with pytest.raises(ValueError, match="slots must be >= 2"):
        ShmBackend(slots=1)
    with pytest.raises(ValueError, match="path must be one of"):
        ShmBackend(path="nvlink")
    with pytest.raises(ValueError, match="timeout must be > 0"):
        ShmBackend(timeout=0)


def test_build_info_reports_the_shared_memory_part():
    info = native.build_info()
    assert info["shm"] is True
    assert set(info) == {"shm", "cuda", "rdma"}
