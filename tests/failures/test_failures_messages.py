"""Failures that used to end in a traceback or a page of usage, each now one line naming
the file, the flag or the fix: a bad flag value (once per job), a damaged or unwritable
dataset index cache, a checkpoint without optimizer state, shm channels between ranks that
do not share /dev/shm, and torchrun's own error when no worker joins."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from megatron.trainer.config.arguments import ArgumentError, parse_args
from megatron.trainer.data.index_cache import IndexCacheError, check_cache
from tests.failures.test_failures_data import make_dataset
from tests.job import TINY_GPT, Job, mounted
from tests.node_runs import REPO, Node, two_node_settings

RUN_S = 180
SHAPE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--micro-batch-size", "2", "--mock-data",
         "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--train-iters", "2"]


def _one_error(text: str) -> str:
    errors = [line for line in text.splitlines() if " ERROR " in line]
    assert len(errors) == 1, text[-3000:]
    return errors[0].split("megatron.trainer.run.failures: ", 1)[1]


@pytest.mark.parametrize("flags, message", [
    (["--lr", "-1e-3"], "--lr -0.001 must be >= 0"),
    (["--num-layers", "four"], "argument --num-layers: invalid int value: 'four' (--help lists "
                               "the flags)"),
    (["--lr"], "argument --lr: expected one argument (--help lists the flags)"),
])
def test_a_bad_flag_value_is_one_line(flags, message):
    with pytest.raises(ArgumentError) as error:
        parse_args(SHAPE + flags, world_size=1)
    assert str(error.value) == message


@pytest.mark.slow
def test_a_bad_flag_value_in_the_launch_script_is_one_line_per_job(tmp_path):
    node = Node.script("run_single_gpt.sh", tmp_path, NUM_LAYERS="four")
    assert node.wait(RUN_S) == 2, node.output()[-3000:]
    out = node.output()
    assert "usage:" not in out and "Traceback" not in out
    lines = [line for line in out.splitlines() if "pretrain_gpt.py: " in line]
    assert lines == [f"{REPO / 'pretrain_gpt.py'}: argument --num-layers: invalid int value: "
                     "'four' (--help lists the flags)"], out[-3000:]


def _dataset_flags(tmp_path, cache) -> list[str]:
    rng = np.random.default_rng(0)
    documents = [[list(map(int, rng.integers(1, 120, size=30)))] for _ in range(20)]
    prefix = make_dataset(tmp_path / "corpus", documents)
    return [flag for flag in TINY_GPT if flag != "--mock-data"] + [
        "--data-path", prefix, "--data-cache-path", str(cache), "--split", "100,0,0",
        "--train-iters", "1"]


@pytest.mark.slow
def test_a_truncated_index_cache_file_is_named_with_the_fix(tmp_path):
    cache = tmp_path / "cache"
    flags = _dataset_flags(tmp_path, cache)
    with Job("pretrain_gpt.py", flags, 1, tmp_path / "first") as job:
        assert job.wait(0, RUN_S) == 0, job.log(0)[-3000:]
    index = max(cache.glob("*.npy"), key=lambda path: path.stat().st_size)
    needed = index.stat().st_size
    with open(index, "r+b") as handle:
        handle.truncate(200)  # past the header (128 bytes): the data cut short
    with Job("pretrain_gpt.py", flags, 1, tmp_path / "second") as job:
        status = job.wait(0, RUN_S)
    assert status == 1, job.log(0)[-3000:]
    assert _one_error(job.log(0)) == (f"dataset index cache: {index} is truncated: 200 bytes, "
                                      f"its header needs {needed}: delete it (the run writes "
                                      "it again)")
    assert "Traceback" not in job.log(0)


def test_a_cache_file_that_is_not_numpy_is_named(tmp_path):
    (tmp_path / "x-document_index.npy").write_bytes(b"not numpy")
    with pytest.raises(IndexCacheError, match=r"x-document_index\.npy is not a readable \.npy"):
        check_cache(str(tmp_path), [])


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a read-only filesystem needs root")
def test_a_read_only_cache_directory_is_named_with_the_flag(tmp_path):
    read_only = tmp_path / "read-only"
    read_only.mkdir()
    flags = _dataset_flags(tmp_path, read_only / "cache")
    flags[flags.index("--train-iters") + 1] = "2"
    with mounted("-t", "tmpfs", "-o", "ro", "tmpfs", read_only):
        with Job("pretrain_gpt.py", flags + ["--pipeline-model-parallel-size", "2"], 2,
                 tmp_path / "job") as job:
            statuses = [job.wait(rank, RUN_S) for rank in (0, 1)]
    assert statuses == [1, 1], job.log(0)[-3000:] + job.log(1)[-3000:]
    assert _one_error(job.log(0)) == (
        f"dataset index cache: cannot write to --data-cache-path {read_only / 'cache'}: "
        f"Read-only file system ({read_only / 'cache'}); give --data-cache-path a writable "
        "directory")
    assert "Traceback" not in job.log(0) + job.log(1)


@pytest.mark.slow
def test_a_checkpoint_without_optimizer_state_names_no_load_optim(tmp_path):
    save = tmp_path / "checkpoints"
    flags = TINY_GPT + ["--save", str(save)]
    with Job("pretrain_gpt.py", flags + ["--train-iters", "1", "--no-save-optim"], 1,
             tmp_path / "save") as job:
        assert job.wait(0, RUN_S) == 0, job.log(0)[-3000:]
    resume = flags + ["--train-iters", "2", "--load", str(save)]
    with Job("pretrain_gpt.py", resume, 1, tmp_path / "load") as job:
        status = job.wait(0, RUN_S)
    assert status == 1
    assert _one_error(job.log(0)) == (
        f"checkpoint: {save / 'iter_0000001'} holds no optimizer state (saved with "
        "--no-save-optim): resume from it with --no-load-optim (a new optimizer state), or "
        "from a checkpoint saved with one")
    with Job("pretrain_gpt.py", resume + ["--no-load-optim"], 1, tmp_path / "fresh") as job:
        assert job.wait(0, RUN_S) == 0, job.log(0)[-3000:]


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="a /dev/shm of its own needs root (unshare -m)")
def test_ranks_of_one_host_name_without_a_shared_dev_shm_are_told_the_fix(tmp_path):
    """Two containers on the host network: one host name, two /dev/shm."""
    flags = TINY_GPT + ["--train-iters", "2", "--pipeline-model-parallel-size", "2",
                        "--use-dpp", "--dpp-transport", "shm"]
    env = dict(os.environ, WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=two_node_settings()["MASTER_PORT"], OMP_NUM_THREADS="1",
               PYTHONWARNINGS="ignore", PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="")
    entry = [sys.executable, str(REPO / "pretrain_gpt.py"), *flags]
    own_shm = ["unshare", "-m", "sh", "-c", 'mount -t tmpfs tmpfs /dev/shm && exec "$@"', "sh"]
    ranks = []
    for rank, command in ((0, entry), (1, own_shm + entry)):
        with open(tmp_path / f"rank{rank}.log", "w") as log:
            ranks.append(subprocess.Popen(command, env=dict(env, RANK=str(rank),
                                                             LOCAL_RANK=str(rank)),
                                          cwd=REPO, stdout=log, stderr=subprocess.STDOUT))
    try:
        statuses = [rank.wait(RUN_S) for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    logs = [(tmp_path / f"rank{rank}.log").read_text() for rank in (0, 1)]
    assert statuses == [1, 1], logs[0][-3000:] + logs[1][-3000:]
    for text in logs:
        error = _one_error(text)
        assert error.startswith("pipeline transport: ShmBackend.open on rank ")
        assert error.endswith(
            "No such file or directory (errno 2) (the shm channels need the ranks of one host "
            "name to share /dev/shm; containers on the host network with their own /dev/shm do "
            "not: give them one, or use --dpp-transport torch)")


@pytest.mark.slow
def test_a_master_without_workers_shows_torchruns_last_line_and_the_fix(tmp_path):
    node = Node.script("run_master_gpt.sh", tmp_path, **two_node_settings(RDZV_TIMEOUT=3))
    assert node.wait(RUN_S) == 1, node.output()[-3000:]
    out = node.output()
    assert "Traceback" not in out and "  File " not in out, out[-3000:]
    assert "torch.distributed.DistStoreError: Timed out after" in out
    assert "waiting for clients. 1/2 clients joined." in out
    assert ("[run_master_gpt.sh] no worker joined within RDZV_TIMEOUT=3 s: start the worker "
            "command printed above on each other node") in out
    assert "Traceback" in node.log()  # the log keeps it
