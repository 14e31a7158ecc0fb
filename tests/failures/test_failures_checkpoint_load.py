"""Checkpoints that do not load: a truncated or deleted shard, a truncated or deleted
.metadata, a garbage or deleted common.pt, a garbage metadata.json, an empty iteration
directory, another model's checkpoint. Each stops every rank before training with one line
naming the checkpoint's file and the cause, and leaves the checkpoint (here also --save)
byte for byte as it was. PP=2 on two gloo ranks, as the failures were found."""

from __future__ import annotations

import hashlib
import os
import shutil
import time

import pytest

from megatron.trainer.checkpoint.checkpoint_publish import CheckpointError
from tests.distributed import run_ranks
from tests.job import TINY_GPT, Job
from tests.trainer_runs import TINY, train_runs, with_flags

FLAGS = with_flags(TINY, num_layers=2, global_batch_size=4, train_iters=1,
                   pipeline_model_parallel_size=2)
ITERATION = "iter_0000001"
SHARD, OTHER_SHARD = "__0_0.distcp", "__1_0.distcp"

# the job stops at start-up: well under 30 s on an idle 2-core machine (its Python and torch
# imports included), with room for one shared with other jobs
STOP_S = 60


def _truncate(name):
    def damage(path):
        file = os.path.join(path, name)
        os.truncate(file, os.path.getsize(file) // 2)
    return damage


def _delete(name):
    return lambda path: os.remove(os.path.join(path, name))


def _overwrite(name):
    def damage(path):
        with open(os.path.join(path, name), "wb") as handle:
            handle.write(b"not a checkpoint\n")
    return damage


def _empty(path):
    shutil.rmtree(path)
    os.mkdir(path)


# case: (damage, the file named, what the line says of it)
DAMAGED = {
    "truncated shard": (_truncate(SHARD), SHARD, "is truncated:"),
    "deleted shard": (_delete(OTHER_SHARD), OTHER_SHARD, "is missing (.metadata names it)"),
    "truncated .metadata": (_truncate(".metadata"), ".metadata", "is unreadable (truncated"),
    "deleted .metadata": (_delete(".metadata"), ".metadata", "is missing"),
    "garbage common.pt": (_overwrite("common.pt"), "common.pt", "is not a file of torch.save"),
    "deleted common.pt": (_delete("common.pt"), "common.pt", "is missing"),
    "garbage metadata.json": (_overwrite("metadata.json"), "metadata.json",
                              "is not valid JSON"),
    "empty directory": (_empty, "", "is empty"),
}


def _snapshot(root) -> dict[str, str]:
    """SHA-256 of every file under `root`, by relative path."""
    digests = {}
    for directory, _, names in os.walk(root):
        for name in names:
            with open(os.path.join(directory, name), "rb") as handle:
                digests[os.path.relpath(os.path.join(directory, name), root)] = \
                    hashlib.file_digest(handle, "sha256").hexdigest()
    return digests


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint of FLAGS' model, and of two other models (wider, deeper)."""
    root = tmp_path_factory.mktemp("saved")
    roots = {"model": root / "model", "wider": root / "wider", "deeper": root / "deeper"}
    run_ranks(2, train_runs, [
        with_flags(FLAGS, save=roots["model"]),
        with_flags(FLAGS, save=roots["wider"], hidden_size=64),
        with_flags(FLAGS, save=roots["deeper"], num_layers=4),
    ], 2)
    return roots


@pytest.mark.slow
def test_each_damaged_or_foreign_checkpoint_is_one_line_naming_its_file(saved, tmp_path):
    roots = {}
    # megatron.core >= 0.19 keeps the common state in the shard files: no common.pt to damage
    # (tests/trainer/checkpoint/test_checkpoint_embedded_common.py covers that layout)
    writes_common_pt = (saved["model"] / ITERATION / "common.pt").exists()
    for case, (damage, name, _) in DAMAGED.items():
        if name == "common.pt" and not writes_common_pt:
            continue
        roots[case] = tmp_path / case.replace(" ", "_")
        shutil.copytree(saved["model"], roots[case])
        damage(str(roots[case] / ITERATION))
    for case in ("wider", "deeper"):
        roots[case] = tmp_path / case
        shutil.copytree(saved[case], roots[case])
    before = {case: _snapshot(root) for case, root in roots.items()}
    # --save is the damaged directory itself: a failed load must leave it as it was
    runs = [with_flags(FLAGS, load=root, save=root, train_iters=2) for root in roots.values()]
    results = run_ranks(2, train_runs, runs, 2, "gpt", None, (CheckpointError,))
    for index, case in enumerate(roots):
        messages = [rank[index].get("stopped", ("not stopped",))[0] for rank in results]
        assert all(rank[index]["losses"] == [] for rank in results), case  # before training
        if case in DAMAGED:
            assert messages[0] == messages[1], (case, messages)
        else:  # megatron.core >= 0.19 checks shapes on each rank: each names a tensor it holds
            assert all(message.startswith(f"{roots[case] / ITERATION} holds another model: ")
                       for message in messages), (case, messages)
        message = messages[0]
        assert "\n" not in message and "Traceback" not in message, (case, message)
        if case in DAMAGED:
            _, name, cause = DAMAGED[case]
            assert f"{roots[case] / ITERATION / name}".rstrip("/") + " " + cause in message, \
                (case, message)
        assert _snapshot(roots[case]) == before[case], case
    wider, deeper = (results[0][index]["stopped"][0] for index in (-2, -1))
    assert (f"{roots['wider'] / ITERATION} holds another model: tensor "
            "embedding.position_embeddings.weight is [16, 64] in the checkpoint but [16, 32] "
            "in this model (flags that differ, this run vs checkpoint: --hidden-size 32 vs 64"
            in wider), wider
    assert f"{roots['deeper'] / ITERATION} holds another model: tensor decoder.layers." in deeper
    assert "in the checkpoint but [2, " in deeper and "--num-layers 2 vs 4" in deeper, deeper


@pytest.mark.slow
def test_a_damaged_checkpoint_ends_the_job_in_one_line(saved, tmp_path):
    """The whole entry point: exit status 1 soon, one ERROR line per rank, no traceback."""
    root = tmp_path / "ckpt"
    shutil.copytree(saved["model"], root)
    _truncate(SHARD)(str(root / ITERATION))
    flags = with_flags(TINY_GPT, num_layers=2, global_batch_size=4, train_iters=2,
                       pipeline_model_parallel_size=2, load=root, save=root)
    started = time.monotonic()
    with Job("pretrain_gpt.py", flags, 2, tmp_path / "job") as job:
        statuses = [job.wait(rank, 60) for rank in (0, 1)]
    took = time.monotonic() - started
    assert statuses == [1, 1], job.log(0)[-3000:]
    for rank in (0, 1):
        log = job.log(rank)
        assert "Traceback" not in log, log[-3000:]
        errors = job.lines(rank, " ERROR ")
        assert len(errors) == 1, log[-3000:]
        assert f"checkpoint: {root / ITERATION / SHARD} is truncated:" in errors[0], errors
    assert took < STOP_S, f"the job took {took:.0f} s to stop"
