"""DPP's slack chosen at run time (megatron/dpp/slack_measurement.py) on a real PP=2 gloo
pipeline: the first two training calls measure at slack 0, then every rank runs the one
slack rank 0 chose and logged; slow arrivals get slack, a memory budget caps it, and the
losses stay megatron-core's; the trainer's own schedule on CPU, its backward split, has the
choice simulate its W order."""

from __future__ import annotations

import contextlib
import logging

import pytest

from tests.distributed import run_ranks
from tests.pipeline_runs import one_step
from tests.trainer_runs import TINY, with_flags

FLAGS = with_flags(TINY, pipeline_model_parallel_size=2, global_batch_size=16, train_iters=1)


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(level=logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def adaptive_runs(rank, world_size, runs, one_core_last=False):
    """Per (delivery jitter in ms, memory budget, rule) of `runs`: the slack and rule of
    each of four training calls of one adaptive DppSchedule, their losses, and what was
    logged (the rule: DppOptions.static, None to choose it too). `one_core_last`: the
    last run's ranks all run on one core."""
    import os

    import torch
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron.dpp.config import DppOptions
    from megatron.dpp.schedule import DppSchedule
    from megatron.dpp.transport.pipeline import JITTER_ENV
    from megatron.trainer.config.arguments import parse_args
    from megatron.trainer.run.training import setup
    from megatron.trainer.tasks.gpt import GPT_TASK

    args = parse_args(FLAGS, world_size=world_size)
    handler = _Lines()
    logging.getLogger("megatron.dpp.slack_measurement").addHandler(handler)
    logging.getLogger("megatron.dpp.slack_measurement").setLevel(logging.INFO)
    with contextlib.ExitStack() as stack:
        trainer = setup(GPT_TASK, args, stack)
        m = args.num_microbatches
        result = {"core": one_step(trainer, get_forward_backward_func(), m)[0], "runs": []}
        for index, (jitter, budget, static) in enumerate(runs):
            if one_core_last and index == len(runs) - 1:
                os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
            os.environ[JITTER_ENV] = str(jitter)
            handler.lines.clear()
            dpp = DppSchedule(DppOptions(transport="torch", adaptive=True,
                                         memory_budget=budget, static=static))
            slacks, rules, losses = [], [], []
            try:
                for _ in range(4):
                    slacks.append(dpp.slack)
                    rules.append(dpp.runs_static)
                    losses.append(one_step(trainer, dpp, m)[0])
            finally:
                dpp.close()
            result["runs"].append({"slacks": slacks, "rules": rules, "losses": losses,
                                   "lines": list(handler.lines),
                                   "threads": torch.get_num_threads()})
    return result


@pytest.mark.slow
def test_slow_arrivals_get_slack_a_budget_caps_it_and_losses_stay():
    runs = [(60, None, False), (60, "1.0x", False), (60, None, None), (60, None, False)]
    results = run_ranks(2, adaptive_runs, 2, runs, True)
    for rank, result in enumerate(results):
        for run in result["runs"]:
            assert all(losses == result["core"] for losses in run["losses"])
            # measuring: None for two calls, then the choice
            assert run["slacks"][:2] == [None, None]
            assert run["slacks"][2] == run["slacks"][3]
            assert len(run["lines"]) == (1 if rank == 0 else 0)
    jittered, budgeted, chosen, one_core = (run for run in results[0]["runs"])
    assert jittered["rules"] == [False] * 4
    # the rule chosen too: the plan in order while measuring, then, with arrivals far
    # later than a forward, the dynamic rule, on every rank
    for result in results:
        assert result["runs"][2]["rules"] == [True, True, False, False]
    assert "the dynamic rule runs" in chosen["lines"][0], chosen["lines"][0]
    # arrivals 30 ms late on average: far more than a forward of the tiny model
    assert jittered["slacks"][2] == 2 and results[1]["runs"][0]["slacks"][2] == 2
    assert jittered["lines"][0].startswith("DPP slack 2: measured hop ")
    # 1F1B's busiest stage (rank 0 holds 2 microbatches): no room for one more
    assert budgeted["slacks"][2] == 0 and results[1]["runs"][1]["slacks"][2] == 0
    assert "budget 1x 1F1B's busiest stage (caps the slack at 0)" in budgeted["lines"][0]
    # both ranks on one core: the decision simulates the two ranks sharing it (the core
    # over both ranks' threads, a share of it each)
    shared = 2 / (one_core["threads"] + results[1]["runs"][3]["threads"])
    cores = f"{shared:g} core" + ("" if shared == 1 else "s")
    assert f"on {cores} shared by the ranks" in one_core["lines"][0], \
        one_core["lines"][0]


def split_backward_choice(rank, world_size):
    """The slack line of the trainer's own schedule (`--use-dpp`, the split backward on CPU,
    the slack and the rule chosen) over three training calls under stragglers, on rank 0."""
    from megatron.trainer.config.arguments import parse_args
    from megatron.trainer.run.training import setup
    from megatron.trainer.tasks.gpt import GPT_TASK

    flags = with_flags(FLAGS, use_dpp=True, dpp_transport="torch",
                       emulate_straggler="all:0.3:3")
    args = parse_args(flags, world_size=world_size)
    handler = _Lines()
    logger = logging.getLogger("megatron.dpp.slack_measurement")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        with contextlib.ExitStack() as stack:
            trainer = setup(GPT_TASK, args, stack)
            for _ in range(3):
                one_step(trainer, trainer.schedule, args.num_microbatches)
    finally:
        logger.removeHandler(handler)
    return handler.lines


@pytest.mark.slow
def test_on_cpu_the_choice_simulates_the_ws_in_the_order_the_rule_runs_them():
    """On CPU the rule runs the pending W tasks shortest B first; the slack chosen from the
    first two calls simulates that order, and its line says so."""
    lines, others = run_ranks(2, split_backward_choice, 2)
    assert others == [] and len(lines) == 1, lines
    assert "the dynamic rule (W tasks shortest B first) 1.00/" in lines[0], lines[0]
