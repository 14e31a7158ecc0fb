"""Crafted checkpoints do not run their code: a legacy (--ckpt-format torch) file whose
pickle calls os.mkdir is refused by name (also by --use-checkpoint-args, before any process
group exists), and a world-writable or another user's torch_dist checkpoint, whose
.metadata torch unpickles, is refused before anything reads it. Each stops the job in one
line; the payload's directory never appears."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch

from megatron.trainer.checkpoint.checkpoint_publish import POINTER, CheckpointError
from megatron.trainer.checkpoint.checkpoint_trust import untrusted_problem
from megatron.trainer.config.arguments import parse_args
from tests.job import TINY_GPT, Job
from tests.trainer_runs import with_flags


class Payload:
    """Unpickled, it creates the directory `marker`."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def _root_with(tmp_path, files: dict[str, object]):
    """--load directory whose iteration 1 holds `files` (JSON for .json names, torch.save
    for .pt ones, else pickle)."""
    root = tmp_path / "ckpt"
    iteration = root / "iter_0000001"
    for name, content in files.items():
        file = iteration / name
        file.parent.mkdir(parents=True, exist_ok=True)
        if name.endswith(".json"):
            file.write_text(json.dumps(content))
        elif name.endswith(".pt"):
            torch.save(content, file)
        else:
            file.write_bytes(pickle.dumps(content))
    (root / POINTER).write_text("1\n")
    return root, iteration


def _stopped_in_one_line(tmp_path, flags) -> str:
    with Job("pretrain_gpt.py", flags, 1, tmp_path / "job") as job:
        status = job.wait(0, 60)
    log = job.log(0)
    assert status == 1, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    errors = job.lines(0, " ERROR ")
    assert len(errors) == 1, log[-3000:]
    return errors[0]


@pytest.mark.slow
def test_a_crafted_legacy_checkpoint_is_refused(tmp_path):
    marker = tmp_path / "ran"
    root, iteration = _root_with(tmp_path, {
        "mp_rank_00/model_optim_rng.pt": {"model": Payload(marker), "iteration": 1}})
    flags = with_flags(TINY_GPT, load=root, ckpt_format="torch", train_iters=2)
    error = _stopped_in_one_line(tmp_path, flags)
    assert (f"checkpoint: loading {iteration}: a file in it holds posix.mkdir, which loading "
            "does not build" in error), error
    assert "--trust-checkpoint" in error
    # --use-checkpoint-args reads the same file before the job starts
    with pytest.raises(CheckpointError, match="posix.mkdir"):
        parse_args(with_flags(flags, use_checkpoint_args=True), world_size=1)
    assert not marker.exists()


@pytest.mark.slow
def test_a_world_writable_torch_dist_checkpoint_is_refused(tmp_path):
    marker = tmp_path / "ran"
    root, iteration = _root_with(tmp_path, {
        ".metadata": Payload(marker), "common.pt": {}, "metadata.json": {
            "sharded_backend": "torch_dist", "sharded_backend_version": 1,
            "common_backend": "torch", "common_backend_version": 1}})
    os.chmod(iteration / ".metadata", 0o666)
    flags = with_flags(TINY_GPT, load=root, train_iters=2)
    error = _stopped_in_one_line(tmp_path, flags)
    assert (f"checkpoint: refusing to load {iteration}: {iteration / '.metadata'} is "
            "world-writable, and loading a checkpoint unpickles its files" in error), error
    assert "give --trust-checkpoint to load it anyway" in error
    assert not marker.exists()


def test_another_users_checkpoint_is_not_trusted(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    root, iteration = _root_with(tmp_path, {"common.pt": {}})
    os.chown(iteration / "common.pt", 12345, 12345)
    problem = untrusted_problem(str(root), str(iteration))
    assert f"{iteration / 'common.pt'} is owned by uid 12345, not this user (uid 0)" in problem
    os.chown(iteration / "common.pt", 0, 0)
    assert untrusted_problem(str(root), str(iteration)) is None
