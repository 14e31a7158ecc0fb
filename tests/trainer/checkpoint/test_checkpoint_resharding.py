"""A torch_dist checkpoint resumes at another parallel layout (PP 2 -> 1, PP 2 -> 4,
DP 1 -> 2, virtual stages on -> off and off -> on), with its Adam state: the 5 losses after
the resume equal the saving run's own next 5 to 1e-4 relative (fp32, dropout off; only the
order of the sums differs). The RNG states are restored where the layout is the saved one
and skipped with a log line where it is not."""

from __future__ import annotations

import shutil

import pytest

from megatron.trainer.checkpoint.checkpoint_publish import POINTER
from tests.distributed import run_ranks
from tests.trainer_runs import TINY, train_runs, with_flags

SAVED_AT, MORE = 2, 5
# TINY's 4 layers split over 1, 2 or 4 stages, or 2 stages of 2 virtual ones
BASE = with_flags(TINY, global_batch_size=8, train_iters=SAVED_AT + MORE)
PP2 = with_flags(BASE, pipeline_model_parallel_size=2)
VPP = with_flags(PP2, num_layers_per_virtual_pipeline_stage=1)
SKIPPED = "its RNG states are not restored: saved at PP 2 x TP 1 x DP 1, this run is"


def _losses(run) -> list[float]:
    return [step["lm loss"] for step in run["losses"]]


def _last_rank_losses(results, index) -> list[float]:
    return _losses(results[-1][index])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """For PP=2 and PP=2 x VPP=2: the checkpoint of iteration SAVED_AT alone under a root of
    its own, and the saving run's losses after it."""
    work = tmp_path_factory.mktemp("saving")
    runs = {"pp2": PP2, "vpp": VPP}
    results = run_ranks(2, train_runs, [with_flags(flags, save=work / name,
                                                   save_interval=SAVED_AT)
                                        for name, flags in runs.items()], 2)
    checkpoints = {}
    for index, name in enumerate(runs):
        root = work / f"{name}_at_{SAVED_AT}"
        shutil.copytree(work / name / f"iter_{SAVED_AT:07d}", root / f"iter_{SAVED_AT:07d}")
        (root / POINTER).write_text(f"{SAVED_AT}\n")
        losses = _last_rank_losses(results, index)
        assert len(losses) == SAVED_AT + MORE
        checkpoints[name] = (root, losses[SAVED_AT:])
    return checkpoints


def _resume(world_size: int, resumes: list[tuple[str, list[str]]], saved) -> list:
    runs = [with_flags(flags, load=saved[name][0]) for name, flags in resumes]
    return run_ranks(world_size, train_runs, runs, world_size)


def _check(results, index: int, expected: list[float], rng_restored: bool) -> None:
    resumed = _last_rank_losses(results, index)
    assert resumed == pytest.approx(expected, rel=1e-4), (resumed, expected)
    logs = [message for rank in results for _, message in rank[index]["logs"]]
    assert any(f"(iteration {SAVED_AT})" in message for message in logs)
    assert any(SKIPPED in message for message in logs) != rng_restored, logs


@pytest.mark.slow
def test_same_size_other_stages(saved):
    """On two ranks: virtual stages on -> off and off -> on; PP 2 -> 1 (so DP 1 -> 2)."""
    results = _resume(2, [("vpp", PP2), ("pp2", VPP),
                          ("pp2", with_flags(BASE))], saved)
    # the same (PP, TP, DP): the RNG states are each rank's own
    _check(results, 0, saved["vpp"][1], rng_restored=True)
    _check(results, 1, saved["pp2"][1], rng_restored=True)
    _check(results, 2, saved["pp2"][1], rng_restored=False)


@pytest.mark.slow
def test_pp2_to_pp1_on_one_rank(saved):
    results = _resume(1, [("pp2", BASE)], saved)
    _check(results, 0, saved["pp2"][1], rng_restored=False)


@pytest.mark.slow
def test_pp2_to_pp4_and_dp1_to_dp2_on_four_ranks(saved):
    results = _resume(4, [("pp2", with_flags(BASE, pipeline_model_parallel_size=4)),
                          ("pp2", PP2)], saved)
    _check(results, 0, saved["pp2"][1], rng_restored=False)
    _check(results, 1, saved["pp2"][1], rng_restored=False)
