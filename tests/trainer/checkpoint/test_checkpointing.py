"""Checkpoints: saving at iteration k and resuming with --load gives the losses of an
uninterrupted run; checkpoints are written atomically; --load of an empty directory starts
fresh with a warning; a pointer to a missing checkpoint is an error naming the path."""

from __future__ import annotations

import logging
import os
import sys

import pytest

from megatron.trainer.checkpoint import checkpoint_load, checkpoint_state, checkpointing
from megatron.trainer.checkpoint.checkpoint_config import CheckpointConfig
from tests.distributed import run_ranks
from tests.trainer_runs import TINY, train_runs, with_flags

ITERS, SAVE_AT, BATCH = 4, 2, 8
# dropout on: its draws are keyed by the iteration, which a resumed run must continue
BASE = with_flags(TINY, global_batch_size=BATCH, train_iters=ITERS, hidden_dropout=0.1,
                  attention_dropout=0.1, save_interval=SAVE_AT)


def _losses(run):
    return [step["lm loss"] for step in run["losses"]]


def _leftovers(root):
    return [os.path.join(d, name) for d, dirs, files in os.walk(root)
            for name in dirs + files if name.endswith(".tmp")]


def _save_resume_and_compare(tmp_path, flags, world_size):
    """Uninterrupted run; run stopped after the save at SAVE_AT; resumed run. The resumed
    losses must equal the uninterrupted run's from SAVE_AT on. `flags` may be a list of
    flag lists, checked one after the other in the same processes."""
    flag_sets = flags if isinstance(flags[0], list) else [flags]
    runs = []
    for index, flags in enumerate(flag_sets):
        whole, parts = str(tmp_path / f"whole{index}"), str(tmp_path / f"parts{index}")
        # a staging directory left by an earlier crash at the same iteration is replaced
        os.makedirs(os.path.join(parts, f"iter_{SAVE_AT:07d}.tmp"))
        open(os.path.join(parts, f"iter_{SAVE_AT:07d}.tmp", "junk"), "w").close()
        runs += [
            with_flags(flags, save=whole, load=whole),
            with_flags(flags, save=parts, exit_interval=SAVE_AT),
            with_flags(flags, save=parts, load=parts),
        ]
    results = run_ranks(world_size, train_runs, runs, world_size)
    for index in range(len(flag_sets)):
        _check_resumed([rank[3 * index: 3 * index + 3] for rank in results],
                       str(tmp_path / f"whole{index}"), str(tmp_path / f"parts{index}"))
    return results


def _check_resumed(results, whole, parts):
    uninterrupted, stopped, resumed = results[-1]
    assert len(_losses(uninterrupted)) == ITERS
    assert _losses(stopped) == _losses(uninterrupted)[:SAVE_AT]
    # same processes, same thread count: bit-identical
    assert _losses(resumed) == _losses(uninterrupted)[SAVE_AT:]
    assert resumed["grad_norms"] == uninterrupted["grad_norms"][SAVE_AT:]
    state = dict(resumed["state"])
    # the FLOP count continues from the checkpoint's, adding the same numbers in order
    assert state.pop("floating_point_operations") == \
        uninterrupted["state"]["floating_point_operations"] > 0
    assert state == {"iteration": ITERS, "consumed_samples": ITERS * BATCH,
                     "skipped_iterations": 0}
    for root in (whole, parts):
        assert sorted(os.listdir(root)) == [
            "iter_0000002", "iter_0000004", checkpointing.POINTER]
        assert _leftovers(root) == []
        with open(os.path.join(root, checkpointing.POINTER)) as pointer:
            assert pointer.read() == f"{ITERS}\n"
    for rank in results:
        first_run_warnings = [m for level, m in rank[0]["logs"] if level == "WARNING"]
        assert any(f"no checkpoint under {whole}" in m for m in first_run_warnings)
    for rank in (results[0], results[-1]):  # the ranks that log at INFO
        assert any(f"loaded checkpoint {parts}/iter_0000002" in m for _, m in rank[2]["logs"])


@pytest.mark.slow
@pytest.mark.parametrize("precision", [[], ["--bf16"]], ids=["fp32", "bf16"])
def test_resume_gpt_pp2(tmp_path, precision):
    # bf16 also checks that the Float16Module wrapper stays out of the checkpoint's keys
    flags = with_flags(BASE, pipeline_model_parallel_size=2) + precision
    _save_resume_and_compare(tmp_path, flags, 2)


@pytest.mark.slow
def test_resume_distributed_optimizer_dp2(tmp_path):
    flags = BASE + ["--use-distributed-optimizer"]
    results = _save_resume_and_compare(tmp_path, flags, 2)
    # both data-parallel ranks report the same (all-reduced) losses
    assert _losses(results[0][2]) == _losses(results[1][2])


def test_load_empty_directory_starts_fresh(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="megatron.trainer.checkpoint.checkpointing"):
        state = checkpoint_load.load_checkpoint(str(tmp_path), None, None, None, None)
    assert state == checkpointing.TrainingState()
    assert f"no checkpoint under {tmp_path}" in caplog.text


def test_pointer_to_missing_iteration_names_the_path(tmp_path):
    (tmp_path / checkpointing.POINTER).write_text("7\n")
    with pytest.raises(checkpointing.CheckpointError) as caught:
        checkpoint_load.load_checkpoint(str(tmp_path), None, None, None, None)
    assert str(tmp_path / "iter_0000007") in str(caught.value)
    assert "names iteration 7" in str(caught.value)


def test_unreadable_pointer_names_the_file(tmp_path):
    (tmp_path / checkpointing.POINTER).write_text("release\n")
    with pytest.raises(checkpointing.CheckpointError) as caught:
        checkpointing.latest_iteration(str(tmp_path))
    assert str(tmp_path / checkpointing.POINTER) in str(caught.value)
    assert "'release'" in str(caught.value)


def test_checkpoint_dir_layout():
    config = CheckpointConfig(distributed_optimizer=True)
    assert checkpointing.checkpoint_dir("/ckpt", 12) == "/ckpt/iter_0000012"
    assert checkpoint_state.optimizer_metadata(config) == {
        "distrib_optim_sharding_type": "dp_reshardable"}


def test_save_without_psutil_fails_fast(tmp_path, monkeypatch):
    # dist_checkpointing's writer processes would die on the import and the save would
    # wait for them until the job times out
    monkeypatch.setitem(sys.modules, "psutil", None)
    with pytest.raises(checkpointing.CheckpointError, match="pip install psutil"):
        checkpointing.save_checkpoint(str(tmp_path), [], None, None,
                                      checkpointing.TrainingState(), None)
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
def test_resume_virtual_stages_under_both_schedules(tmp_path):
    """PP=2 x VPP=2: every chunk's parameters and optimizer state are saved under their own
    key (the chunks' local names repeat) and come back; megatron-core's schedule and DPP,
    with torch's Adam and with the distributed optimizer, resume exactly."""
    flags = with_flags(BASE, pipeline_model_parallel_size=2,
                       virtual_pipeline_model_parallel_size=2)
    dpp = ["--use-dpp", "--dpp-transport", "torch"]
    distributed = ["--use-distributed-optimizer"]
    _save_resume_and_compare(tmp_path, [flags, flags + dpp, flags + distributed,
                                        flags + dpp + distributed], 2)
