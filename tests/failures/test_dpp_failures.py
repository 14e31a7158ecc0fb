"""A pipeline peer that dies mid-training: the survivor raises an error naming the peer
within the timeout (never a hang), and no shared-memory segment is left behind."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import time

import pytest

from megatron.dpp.transport import native
from tests.distributed import run_ranks
from tests.pipeline_runs import TINY_GPT, one_step


def _dying_forward_step(forward_step, after: int):
    """The stage's forward step, except that the process is killed at forward `after`."""
    calls = []

    def step(data_iterator, model):
        calls.append(1)
        if len(calls) > after:
            os.kill(os.getpid(), signal.SIGKILL)
        return forward_step(data_iterator, model)

    return step


def _train_then_lose_a_peer(rank, transport, mid_iteration):
    from megatron.dpp.transport import shm
    from megatron.dpp.transport.channel import TransportError
    from megatron.trainer.config.arguments import parse_args
    from megatron.trainer.run.training import setup
    from megatron.trainer.tasks.gpt import GPT_TASK

    # the job's segment names hold the token its ranks agree on: the test looks for those
    # only (other tests running beside it have their own)
    tokens = []
    agree = shm.ShmBackend._agree_token
    shm.ShmBackend._agree_token = lambda backend: tokens.append(agree(backend)) or tokens[-1]
    flags = TINY_GPT + ["--global-batch-size", "8", "--pipeline-model-parallel-size", "2",
                        "--use-dpp", "--dpp-transport", transport, "--dpp-timeout", "20"]
    args = parse_args(flags, world_size=2)
    with contextlib.ExitStack() as stack:
        trainer = setup(GPT_TASK, args, stack)
        one_step(trainer, trainer.schedule, args.num_microbatches)
        if rank == 1:
            if not mid_iteration:
                os.kill(os.getpid(), signal.SIGKILL)
            task = trainer.task
            trainer.task = dataclasses.replace(task, make_forward_step=lambda *a: (
                _dying_forward_step(task.make_forward_step(*a), after=2)))
        started = time.monotonic()
        with pytest.raises(TransportError) as caught:
            one_step(trainer, trainer.schedule, args.num_microbatches)
        return time.monotonic() - started, str(caught.value), tokens


def _dpp_segments() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith("dpp-")}


TRANSPORTS = ["torch"] + (["shm"] if native.available() else [])


@pytest.mark.parametrize("mid_iteration", [False, True], ids=["between", "during"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_survivor_raises_when_a_stage_dies(transport, mid_iteration):
    ((waited, message, tokens),) = run_ranks(2, _train_then_lose_a_peer, transport, mid_iteration,
                                     reporting=[0])
    assert waited < 20, f"took {waited:.1f} s to notice"
    # the survivor names the dead rank: on the channel it waited on, or at the barrier that
    # opens each schedule call (a token from each stage)
    assert "peer rank 1" in message, message
    if not mid_iteration:
        assert "did not reach the start of this schedule call" in message, message
    assert (transport == "shm") == bool(tokens)
    left = {name for name in _dpp_segments() if any(token in name for token in tokens)}
    assert not left, f"shared-memory segments left behind: {left}"
