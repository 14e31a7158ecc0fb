"""Emulated links and stragglers: a message on an emulated edge is not usable before its
delay and comes within delay + jitter; the sender never waits for it; the straggler draw
depends on the task, not on the order a schedule runs tasks in; bad flags get one line."""

from __future__ import annotations

import random
import time

import pytest
import torch

from megatron.dpp.actions import BACKWARD, FORWARD
from megatron.dpp.variability import Emulation, LinkProfile, StragglerProfile
from tests.distributed import run_ranks

DELAY_MS, JITTER_MS = 120.0, 60.0
MESSAGES = 6
# what scheduling and the backend's own transfer may add on a loaded 2-core machine, where
# a process can wait seconds for a core: never a bound below the delay, only above it
LATE_MS = 5000.0


def _timed_messages(rank: int, transport: str):
    """Rank 0 sends MESSAGES tensors carrying their send time over an emulated link to rank
    1, which records when each became available; rank 0 records how long each send took."""
    import torch
    import torch.distributed as dist

    from megatron.dpp.transport.channel import MessageKey, MessageKind
    from megatron.dpp.transport.pipeline import PipelineTransport

    dist.init_process_group("gloo")
    emulation = Emulation(seed=5, link=LinkProfile(DELAY_MS, JITTER_MS, edges="all"))
    channels = PipelineTransport([0, 1], num_chunks=1, device=torch.device("cpu"),
                                 transport=transport, timeout=60, emulation=emulation)
    result = []
    try:
        channels.barrier()
        for i in range(MESSAGES):
            key = MessageKey(MessageKind.ACTIVATION, 0, i)
            if rank == 0:
                started = time.time()
                channels.send(1, key, torch.full((64, 32), started, dtype=torch.float64))
                result.append(time.time() - started)
                time.sleep(0.02)
            else:
                message = channels.take(key)
                result.append((time.time() - float(message[0, 0])) * 1000)
                assert bool((message == message[0, 0]).all()), f"message {i} corrupted"
        channels.flush()
        channels.barrier()
    finally:
        channels.close()
        dist.destroy_process_group()
    return result


def _timed_core_messages(rank: int):
    """As _timed_messages, through the links of megatron-core's p2p: rank 0 hands each
    tensor to its link, rank 1 receives it with a plain receive, as megatron-core does."""
    import torch
    import torch.distributed as dist

    from megatron.dpp.transport.channel import MessageKey, MessageKind
    from megatron.trainer.core_compat.emulated_p2p import P2PLinks

    dist.init_process_group("gloo")
    emulation = Emulation(seed=5, link=LinkProfile(DELAY_MS, JITTER_MS, edges="all"))
    links = P2PLinks(emulation, dist.group.WORLD, ["pod"] * 2, torch.device("cpu"), ring=False)
    result = []
    try:
        dist.barrier()
        for i in range(MESSAGES):
            if rank == 0:
                started = time.time()
                links.send(torch.full((64, 32), started, dtype=torch.float64), 1,
                           dist.group.WORLD, MessageKey(MessageKind.ACTIVATION, 0, i))
                result.append(time.time() - started)
                time.sleep(0.02)
            else:
                message = torch.empty(64, 32, dtype=torch.float64)
                dist.recv(message, 0)
                result.append((time.time() - float(message[0, 0])) * 1000)
                assert bool((message == message[0, 0]).all()), f"message {i} corrupted"
    finally:
        links.close()
        dist.destroy_process_group()
    return result


@pytest.mark.parametrize("transport", ["torch", "shm", "megatron-core"])
def test_emulated_link_delays_each_message_and_never_the_sender(transport):
    if transport == "megatron-core":
        sends, latencies = run_ranks(2, _timed_core_messages)
    else:
        sends, latencies = run_ranks(2, _timed_messages, transport)
    # a send that waited for the link would take DELAY_MS or more, every one of them
    assert sorted(sends)[len(sends) // 2] < DELAY_MS / 1000 and max(sends) < LATE_MS / 1000, (
        f"a send waited for the emulated link: {sends}")
    assert min(latencies) >= DELAY_MS, f"a message usable before {DELAY_MS} ms: {latencies}"
    assert max(latencies) <= DELAY_MS + JITTER_MS + LATE_MS, latencies
    # the jitter is drawn per message: not every message takes the same time
    assert max(latencies) - min(latencies) > 1.0, latencies


def test_straggler_draw_is_the_same_in_any_task_order():
    emulation = Emulation(seed=11, straggler=StragglerProfile(None, 0.3, 3.0))
    tasks = [(iteration, microbatch, stage, chunk, kind) for iteration in range(1, 4)
             for microbatch in range(16) for stage in range(4) for chunk in range(2)
             for kind in (FORWARD, BACKWARD)]
    shuffled = list(tasks)
    random.Random(3).shuffle(shuffled)

    def straggling(run, order):
        return {task for task in order if run.straggle_factor(*task) > 1}

    first, second = straggling(emulation, tasks), straggling(emulation, shuffled)
    assert first == second
    assert 0.2 * len(tasks) < len(first) < 0.4 * len(tasks)
    assert {emulation.straggle_factor(*task) for task in first} == {3.0}
    # another seed draws other tasks; a stage outside STAGES never straggles
    other = Emulation(seed=12, straggler=StragglerProfile(None, 0.3, 3.0))
    assert straggling(other, tasks) != first
    only_two = Emulation(seed=11, straggler=StragglerProfile((2,), 0.3, 3.0))
    assert straggling(only_two, tasks) == {t for t in first if t[2] == 2}


def test_link_and_straggler_specs_parse():
    assert LinkProfile.parse("30") == LinkProfile(30.0, 0.0)
    assert LinkProfile.parse("30,7.5", 25.0, "all") == LinkProfile(30.0, 7.5, 25.0, "all")
    assert StragglerProfile.parse("all:0.1:3") == StragglerProfile(None, 0.1, 3.0)
    assert StragglerProfile.parse("1,3:0.5:2").stages == (1, 3)
    for bad in ("", "a", "30,", "-1", "1,2,3"):
        with pytest.raises(ValueError, match="--emulate-link-ms"):
            LinkProfile.parse(bad)
    for bad in ("all:0.1", "x:0.1:3", "all:1.5:3", "all:0.1:0.5", "-1:0.1:2"):
        with pytest.raises(ValueError, match="--emulate-straggler"):
            StragglerProfile.parse(bad)


BASE = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--train-iters", "2", "--lr", "1e-3", "--mock-data", "--tokenizer-type",
        "NullTokenizer", "--vocab-size", "128", "--pipeline-model-parallel-size", "4"]


@pytest.mark.parametrize("flags, problem", [
    (["--emulate-link-ms", "30"], "this job has one pod, so no edge would be emulated"),
    (["--emulate-link-ms", "30,x", "--emulate-link-edges", "all"],
     "--emulate-link-ms '30,x': expected D or D,J"),
    (["--emulate-link-gbps", "10"], "--emulate-link-gbps adds size / G"),
    (["--emulate-straggler", "4:0.1:3"], "stages are 0..3 at --pipeline-model-parallel-size 4"),
    (["--emulate-straggler", "all:2:3"], "--emulate-straggler 'all:2:3': expected"),
])
def test_bad_emulation_flags_get_one_line(flags, problem):
    from megatron.trainer.config.arguments import ArgumentError, parse_args

    with pytest.raises(ArgumentError) as error:
        parse_args(BASE + flags, world_size=4)
    assert problem in str(error.value) and "\n" not in str(error.value)


def test_emulation_is_off_by_default_and_described_once_on():
    from megatron.trainer.config.arguments import parse_args
    from megatron.trainer.config.configs import EmulationConfig

    assert not EmulationConfig.from_args(parse_args(BASE, world_size=4)).emulation().active
    args = parse_args(BASE + ["--emulate-link-ms", "30,10", "--emulate-link-gbps", "25",
                              "--emulate-link-edges", "all", "--emulate-straggler",
                              "1:0.1:3", "--seed", "9"], world_size=4)
    emulation = EmulationConfig.from_args(args).emulation()
    assert emulation.link == LinkProfile(30.0, 10.0, 25.0, "all")
    assert emulation.describe() == (
        "emulated: link 30 ms + U(0, 10) ms + size / 25 GB/s on every pipeline edge; "
        "stragglers on stage 1: p 0.1, x3 (seed 9; time only, values untouched)")


def _pipeline_runs(rank: int, runs: list[list[str]]):
    """Each run's (losses, gradient norms, trainer log), and the pipeline edge lines this
    rank logged over all runs."""
    import logging

    from megatron.dpp.transport.pipeline import EDGE_LOGGER
    from tests.trainer_runs import train_runs

    edges: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: edges.append(record.getMessage())
    logging.getLogger(EDGE_LOGGER).addHandler(handler)
    results = [(record["losses"], record["grad_norms"], record["logs"])
               for record in train_runs(rank, runs, 4)]
    return results, edges


@pytest.mark.slow
def test_emulation_changes_time_only_under_both_schedules():
    """PP=4 on CPU: megatron-core's 1F1B and --use-dpp train with the same losses and
    gradient norms with a jittery link on every edge and stragglers on every stage as
    without them, and as one stage does."""
    from tests.trainer_runs import TINY, train_run, with_flags

    base = with_flags(TINY, global_batch_size=16, train_iters=3, seed=4)
    emulated = ["--emulate-link-ms", "15,10", "--emulate-link-edges", "all",
                "--emulate-straggler", "all:0.3:2"]
    pipelined = with_flags(base, pipeline_model_parallel_size=4)
    dpp = with_flags(pipelined, use_dpp=True)
    runs = [pipelined, pipelined + emulated, dpp, dpp + emulated]
    by_rank = run_ranks(4, _pipeline_runs, runs)
    core, core_emulated, dpp_plain, dpp_emulated = by_rank[3][0]
    one_stage = run_ranks(1, train_run, base, 1)[0]
    reference = [step["lm loss"] for step in one_stage["losses"]]
    for losses, grad_norms, _ in (core, core_emulated, dpp_plain, dpp_emulated):
        assert [step["lm loss"] for step in losses] == pytest.approx(reference, rel=1e-5)
        assert grad_norms == pytest.approx(one_stage["grad_norms"], rel=1e-4)
    assert core_emulated[0] == core[0] and core_emulated[1] == core[1]
    assert dpp_emulated[0] == dpp_plain[0] and dpp_emulated[1] == dpp_plain[1]
    # every rank names each edge it sends on, under each schedule, emulated or not
    _, middle_edges = by_rank[1]
    for line in ("megatron-core p2p over gloo for edge 1->2", "megatron-core p2p over gloo "
                 "for edge 1->0 (emulated link)", "DPP transport shm for edge 1->2:A",
                 "DPP transport shm for edge 2->1:G (emulated link)"):
        assert line in middle_edges, middle_edges
    assert not any("edge 0->3" in line for line in by_rank[0][1])  # no ring at one chunk


def _two_stage_runs(rank: int, runs: list[list[str]]):
    from tests.trainer_runs import train_runs

    return [(record["losses"], record["grad_norms"]) for record in train_runs(rank, runs, 2)]


@pytest.mark.slow
def test_emulated_link_under_megatron_cores_interleaved_schedule():
    """PP=2 with two chunks a stage: megatron-core's interleaved schedule sends activations
    and gradients to the same neighbour, unbatched (one neighbour), odd ranks on the world
    group; through the emulated link the losses stay those without it and of PP=1."""
    from tests.trainer_runs import TINY, train_run, with_flags

    base = with_flags(TINY, global_batch_size=16, train_iters=2, seed=6)
    interleaved = with_flags(base, pipeline_model_parallel_size=2,
                             virtual_pipeline_model_parallel_size=2)
    emulated = interleaved + ["--emulate-link-ms", "10,10", "--emulate-link-edges", "all"]
    plain, with_link = run_ranks(2, _two_stage_runs, [interleaved, emulated])[1]
    one_stage = run_ranks(1, train_run, base, 1)[0]
    assert with_link == plain
    assert [step["lm loss"] for step in with_link[0]] == pytest.approx(
        [step["lm loss"] for step in one_stage["losses"]], rel=1e-5)


TASK_S = 0.1


def _compute(seconds: float) -> None:
    """A task's own work: matrix products until this thread has spent `seconds` of CPU
    time (a straggler on CPU is stretched by its task's CPU time, not its wall time)."""
    end = time.thread_time() + seconds
    matrix = torch.ones(64, 64)
    while time.thread_time() < end:
        matrix = (matrix @ matrix).clamp_(max=1.0)


class _SlowBackward(torch.autograd.Function):
    """Doubles its input; its backward computes for TASK_S."""

    @staticmethod
    def forward(ctx, value):
        return value * 2

    @staticmethod
    def backward(ctx, grad):
        _compute(TASK_S)
        return grad * 2


@pytest.fixture
def stretches(monkeypatch):
    """The sleeps the emulation's stretched tasks ask for, in order (each also slept): the
    stretch a task gets, apart from how long a busy machine made its work take."""
    from types import SimpleNamespace

    from megatron.dpp.transport import emulation as transport_emulation

    asked: list[float] = []

    def sleep(seconds: float) -> None:
        asked.append(seconds)
        time.sleep(seconds)

    monkeypatch.setattr(transport_emulation, "time", SimpleNamespace(
        thread_time=time.thread_time, monotonic=time.monotonic, sleep=sleep))
    return asked


def test_a_straggling_task_takes_factor_times_as_long(stretches):
    """The trainer's hook stretches a straggling forward after it ran and a straggling
    backward from its output's gradient to the end of the pass, on CPU by sleeping for
    (factor - 1) times the CPU time the task spent: a task that only waited is not stretched."""
    from types import SimpleNamespace

    from megatron.trainer.run.emulation import Stragglers

    task_s, factor = TASK_S, 3.0
    rng = SimpleNamespace(current_key=(1, 0, 0), pp_rank=0, pp_size=1)

    def forward_step(data_iterator, model):
        _compute(task_s)
        x = torch.ones(4, requires_grad=True)
        return _SlowBackward.apply(x), None

    def waiting_step(data_iterator, model):  # a task that spends its time waiting, not computing
        time.sleep(task_s)
        return torch.ones(4, requires_grad=True) * 2, None

    def step(prob: float, forward_step) -> list[float]:
        emulation = Emulation(seed=1, straggler=StragglerProfile(None, prob, factor))
        stretches.clear()
        output, _ = Stragglers(emulation, rng, torch.device("cpu")).wrap(forward_step)(None, None)
        output.sum().backward()
        return list(stretches)

    # the forward's sleep, then the backward's, each (factor - 1) times its CPU time
    forward_sleep, backward_sleep = step(1.0, forward_step)
    for slept in (forward_sleep, backward_sleep):
        assert (factor - 1) * task_s <= slept < (factor - 1) * task_s * 1.5
    assert step(0.0, forward_step) == []
    # a forward that slept task_s (and its backward): next to no CPU time, next to no stretch
    waited = step(1.0, waiting_step)
    assert len(waited) == 2 and max(waited) < 0.1 * task_s


def test_a_straggling_weight_task_takes_factor_times_as_long(stretches):
    """DPP runs its W parts itself: each straggles by its backward's draw (microbatch,
    chunk and stage in that iteration; on CPU by sleeping after it for (factor - 1) times
    its CPU time), and its result is the task's."""
    from megatron.dpp.actions import WEIGHT
    from megatron.dpp.transport.emulation import StragglingTasks

    factor, task_s = 3.0, TASK_S / 4
    emulation = Emulation(seed=2, straggler=StragglerProfile(None, 0.5, factor))
    stragglers = StragglingTasks(emulation, stage=1, device=torch.device("cpu"))
    stragglers.iteration = 4
    draws = {m: emulation.straggle_factor(4, m, 1, 0, WEIGHT) for m in range(12)}
    assert set(draws.values()) == {1.0, factor}  # some W straggle, some do not
    for microbatch, drawn in draws.items():
        stretches.clear()
        result = stragglers.run(WEIGHT, 0, microbatch, lambda: _compute(task_s) or "done")
        assert result == "done"
        if drawn > 1:
            (slept,) = stretches
            assert (factor - 1) * task_s <= slept < (factor - 1) * task_s * 1.5, microbatch
        else:
            assert stretches == [], microbatch
