"""A pipeline stage that hangs, a rank killed during shared-memory set-up, Ctrl-C: the job
ends within the timeout, each rank with one line naming the cause, and leaves nothing
behind. Real jobs of pretrain_gpt.py (tests/job.py)."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from megatron.dpp.transport import native
from tests.distributed import run_ranks
from tests.job import TINY_GPT, Job

TIMEOUT_S = 5
START_S = 180  # start-up to the first iterations, on a loaded 2-core machine
DPP = TINY_GPT + ["--train-iters", "100000", "--pipeline-model-parallel-size", "2",
                  "--use-dpp", "--dpp-timeout", str(TIMEOUT_S)]
needs_shm = pytest.mark.skipif(not native.available(),
                               reason="native transport extension megatron.dpp._native not built")


def _stop_at_forward(rank: int, call: int) -> str:
    """Prelude: `rank` stops itself (SIGSTOP) in its `call`-th forward step, inside a
    schedule call, so that the other stage waits for it on the pipeline."""
    return f"""
import os, signal
if os.environ["RANK"] == "{rank}":
    import megatron.dpp.schedule as schedule
    step, calls = schedule.forward_step, []
    def stopping_step(*args, **kwargs):
        calls.append(1)
        if len(calls) == {call}:
            os.kill(os.getpid(), signal.SIGSTOP)
        return step(*args, **kwargs)
    schedule.forward_step = stopping_step
"""


@pytest.mark.slow
@pytest.mark.parametrize("transport, stopped", [
    ("torch", 1), pytest.param("shm", 0, marks=needs_shm)])
def test_a_stopped_stage_ends_the_job_within_the_timeout(tmp_path, transport, stopped):
    survivor = 1 - stopped
    # the second microbatch of the fourth iteration (4 microbatches per iteration)
    prelude = _stop_at_forward(stopped, 3 * 4 + 2)
    with Job("pretrain_gpt.py", DPP + ["--dpp-transport", transport], 2, tmp_path,
             prelude) as job:
        job.wait_stopped(stopped, START_S)
        stopped_at = time.monotonic()
        status = job.wait(survivor, TIMEOUT_S + 10)
        waited = time.monotonic() - stopped_at
    log = job.log(survivor)
    assert status == 1, f"rank {survivor} still ran {waited:.0f} s later:\n{log[-3000:]}"
    errors = job.lines(survivor, "ERROR")
    assert len(errors) == 1, log[-3000:]
    kind = "ACTIVATION" if stopped == 0 else "GRADIENT"
    assert re.search(rf"pipeline transport: timed out after {TIMEOUT_S} s waiting for {kind} "
                     rf"chunk 0 microbatch \d+ from pipeline peer rank {stopped} "
                     rf"\(edge {stopped}->{survivor}\)", errors[0]), errors
    assert "Traceback" not in log


@pytest.mark.slow
def test_ctrl_c_ends_every_rank_with_one_line(tmp_path):
    with Job("pretrain_gpt.py", DPP + ["--dpp-transport", "torch"], 2, tmp_path) as job:
        job.wait_for(1, " iteration        2/", START_S)
        for rank in (0, 1):
            job.signal(rank, signal.SIGINT)
        statuses = [job.wait(rank, 10) for rank in (0, 1)]
    for rank in (0, 1):
        log = job.log(rank)
        assert statuses[rank] == 130, (f"exit statuses {statuses}; rank {rank}:\n{log[-3000:]}"
                                       f"\nrank {1 - rank}:\n{job.log(1 - rank)[-1500:]}")
        errors = job.lines(rank, "ERROR")
        assert len(errors) == 1 and errors[0].endswith(
            "megatron.trainer.run.failures: interrupted (SIGINT)"), log[-3000:]
        assert "Traceback" not in log


def _open_and_lose_a_peer(rank, token, record):
    """Rank 1 dies in shm set-up after creating its receiving segment, before the set-up
    barrier; it records the segments that exist at that moment."""
    import torch.distributed as dist

    from megatron.dpp.transport.channel import Edge, MessageKind, TransportError
    from megatron.dpp.transport.native import NativeInbox
    from megatron.dpp.transport.shm import ShmBackend

    dist.init_process_group("gloo")
    backend = ShmBackend(timeout=TIMEOUT_S, token=token)
    if rank == 1:
        def die():
            with open(record, "w") as out:
                out.write(" ".join(name for name in os.listdir("/dev/shm") if token in name))
            os.kill(os.getpid(), signal.SIGKILL)

        backend._barrier = die
    edges = [Edge(0, 1, MessageKind.ACTIVATION), Edge(1, 0, MessageKind.GRADIENT)]
    started = time.monotonic()
    with pytest.raises(TransportError) as caught:
        backend.open(edges, rank, NativeInbox())
    return time.monotonic() - started, str(caught.value)


@needs_shm
def test_a_rank_killed_during_shm_set_up_leaves_no_segment(tmp_path):
    token = "setup" + os.urandom(4).hex()
    record = tmp_path / "segments"
    ((waited, message),) = run_ranks(2, _open_and_lose_a_peer, token, str(record),
                                     reporting=[0])
    assert "a peer rank failed or disconnected before every channel was created" in message
    assert waited < TIMEOUT_S
    # rank 1's own segment existed when it died; no segment of the job is left
    assert f"dpp-{token}-0-1-0" in record.read_text().split()
    assert [name for name in os.listdir("/dev/shm") if token in name] == []
