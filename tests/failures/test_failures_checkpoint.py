"""Checkpoint saves that fail: a full disk (an injected ENOSPC, and a real small tmpfs where
this process may mount one), a crash while an existing iteration is saved again, a rank
killed in the middle of a save. The previous checkpoint and the pointer stay loadable, no
partial directory stays, no process of the job outlives it, and each rank says why in one
line. Real jobs of pretrain_gpt.py (tests/job.py)."""

from __future__ import annotations

import os
import signal

import pytest

from megatron.trainer.checkpoint import checkpoint_publish, checkpointing
from tests.job import TINY_GPT, Job, mounted

RUN_S = 180  # a whole short job, on a loaded 2-core machine
POINTER = checkpointing.POINTER


def _listing(root) -> list[str]:
    return sorted(os.listdir(root))


def _pointer(root) -> str:
    return (root / POINTER).read_text()


def _one_error(job: Job, rank: int) -> str:
    log = job.log(rank)
    errors = job.lines(rank, " ERROR ")
    assert len(errors) == 1, log[-3000:]
    assert "Traceback" not in log
    return errors[0]


# Every write of the checkpoint of iteration 4 fails as on a full disk.
NO_SPACE_AT_ITERATION_4 = """
import errno, functools
from megatron.core.dist_checkpointing.strategies import filesystem_async
write_item = filesystem_async._write_item
@functools.wraps(write_item)  # megatron.core reads its signature
def full_disk_write_item(*args, **kwargs):
    stream = next(a for a in args if hasattr(a, "name"))
    if "iter_0000004" in str(stream.name):
        raise OSError(errno.ENOSPC, "No space left on device")
    return write_item(*args, **kwargs)
filesystem_async._write_item = full_disk_write_item
"""

# Saving iteration 2 over its existing directory: killed after the swap, before the old
# copy is deleted.
KILLED_AFTER_THE_SWAP = """
import os, signal
from megatron.trainer.checkpoint import checkpoint_publish
rmtree = checkpoint_publish.shutil.rmtree
def killing_rmtree(path, *args, **kwargs):
    if str(path).endswith("iter_0000002.tmp") and os.path.isdir(str(path)[:-4]):
        os.kill(os.getpid(), signal.SIGKILL)
    return rmtree(path, *args, **kwargs)
checkpoint_publish.shutil.rmtree = killing_rmtree
"""


@pytest.mark.slow
@pytest.mark.long
def test_a_full_disk_then_a_crashed_resave_leave_a_loadable_checkpoint(tmp_path):
    root = tmp_path / "ckpt"
    # the runs below resume with other --train-iters: the checkpoint's lr schedule continues
    flags = TINY_GPT + ["--save", str(root), "--use-checkpoint-opt_param-scheduler"]
    with Job("pretrain_gpt.py", flags + ["--train-iters", "4", "--save-interval", "2"], 1,
             tmp_path / "full", NO_SPACE_AT_ITERATION_4) as job:
        status = job.wait(0, RUN_S)
    assert status == 1, job.log(0)[-3000:]
    error = _one_error(job, 0)
    staging = root / "iter_0000004.tmp"
    assert (f"checkpoint: No space left on device saving checkpoint iteration 4 to {staging}"
            in error), error
    assert f"removed the partial checkpoint; {root / POINTER} names iteration 2" in error
    assert _listing(root) == ["iter_0000002", POINTER] and _pointer(root) == "2\n"

    # the finished run saved again onto itself (--load d --save d): no iteration to train,
    # iteration 2 is saved again, and the rank dies between the swap and the delete
    again = flags + ["--load", str(root), "--train-iters", "2"]
    with Job("pretrain_gpt.py", again, 1, tmp_path / "resave", KILLED_AFTER_THE_SWAP) as job:
        status = job.wait(0, RUN_S)
    assert status == -signal.SIGKILL, job.log(0)[-3000:]
    # it loaded what the full disk left
    assert job.lines(0, f"loaded checkpoint {root / 'iter_0000002'} (iteration 2)")
    assert _listing(root) == ["iter_0000002", "iter_0000002.tmp", POINTER]
    assert _pointer(root) == "2\n"

    with Job("pretrain_gpt.py", flags + ["--load", str(root), "--train-iters", "3"], 1,
             tmp_path / "resume") as job:
        status = job.wait(0, RUN_S)
    assert status == 0, job.log(0)[-3000:]
    assert job.lines(0, f"loaded checkpoint {root / 'iter_0000002'} (iteration 2)")
    assert job.lines(0, " iteration        3/       3 |")
    # the stale copy went with the next save
    assert _listing(root) == ["iter_0000002", "iter_0000003", POINTER]


@pytest.mark.slow
def test_a_full_disk_under_an_asynchronous_save_is_named_in_one_line(tmp_path):
    """The write fails in the writer process (megatron-core >= 0.17: in the process itself,
    0.16: in a process of its own); its errno reaches the rank's one line."""
    root = tmp_path / "ckpt"
    flags = TINY_GPT + ["--save", str(root), "--async-save", "--train-iters", "6",
                        "--save-interval", "2"]
    with Job("pretrain_gpt.py", flags, 1, tmp_path / "job", NO_SPACE_AT_ITERATION_4) as job:
        status = job.wait(0, RUN_S)
    assert status == 1, job.log(0)[-3000:]
    error = _one_error(job, 0)
    assert (f"checkpoint: No space left on device saving checkpoint iteration 4 to "
            f"{root / 'iter_0000004.tmp'}" in error), error
    assert _listing(root) == ["iter_0000002", POINTER] and _pointer(root) == "2\n"


# Rank 1's write of a shard, in the save of iteration 4, kills its rank; where the write
# runs in a process of its own (megatron-core 0.16), that process then hangs (as
# megatron.core's writers did, blocked on a queue lock of the dead rank).
WRITER_KILLS_RANK_1_AT_ITERATION_4 = """
import functools, os, signal, time
if os.environ["RANK"] == "1":
    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        FileSystemWriterAsync)
    write, rank_process = FileSystemWriterAsync.write_preloaded_data, os.getpid()
    @functools.wraps(write)  # the trainer checks its signature
    def killing_write(transform_list, **kwargs):
        if "iter_0000004" in str(kwargs["write_bucket"][0]):
            os.kill(rank_process, signal.SIGKILL)
            time.sleep(120)
        return write(transform_list, **kwargs)
    FileSystemWriterAsync.write_preloaded_data = staticmethod(killing_write)
"""


@pytest.mark.slow
def test_a_rank_killed_during_a_save_leaves_no_process_and_the_previous_checkpoint(tmp_path):
    root = tmp_path / "ckpt"
    flags = TINY_GPT + ["--pipeline-model-parallel-size", "2", "--train-iters", "100",
                        "--save", str(root), "--save-interval", "2"]
    with Job("pretrain_gpt.py", flags, 2, tmp_path, WRITER_KILLS_RANK_1_AT_ITERATION_4) as job:
        killed = job.wait(1, RUN_S)
        assert killed == -signal.SIGKILL, job.log(1)[-3000:]
        left = job.wait_until_gone(10)
        assert left == [], f"processes {left} of the job still alive 10 s after the kill"
        status = job.wait(0, 1)
    assert status == 1, job.log(0)[-3000:]
    error = _one_error(job, 0)
    assert (f"checkpoint: saving checkpoint iteration 4 to {root / 'iter_0000004.tmp'} "
            "failed: a peer rank failed or disconnected" in error), error
    assert _listing(root) == ["iter_0000002", POINTER] and _pointer(root) == "2\n"


@pytest.mark.slow
def test_a_real_full_filesystem_is_reported_on_every_rank(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (the injected-ENOSPC test runs anyway)")
    disk = tmp_path / "disk"
    disk.mkdir()
    with mounted("-t", "tmpfs", "-o", "size=900k", "tmpfs", disk):
        root = disk / "ckpt"
        # a checkpoint of this model takes about 600 kB: the second one does not fit
        flags = TINY_GPT + ["--pipeline-model-parallel-size", "2", "--train-iters", "4",
                            "--save", str(root), "--save-interval", "2"]
        with Job("pretrain_gpt.py", flags, 2, tmp_path / "job") as job:
            statuses = [job.wait(rank, RUN_S) for rank in (0, 1)]
        assert statuses == [1, 1], job.log(0)[-2000:] + job.log(1)[-2000:]
        errors = [_one_error(job, rank) for rank in (0, 1)]
        staging = root / "iter_0000004.tmp"
        # rank 0 writes the metadata and sees the failures of every rank
        assert f"No space left on device saving checkpoint iteration 4 to {staging}" \
            in errors[0], errors
        assert all(f"iteration 4 to {staging}" in error for error in errors), errors
        assert _listing(root) == ["iter_0000002", POINTER] and _pointer(root) == "2\n"


@pytest.mark.parametrize("atomic_swap", [True, False], ids=["renameat2", "two-renames"])
def test_saving_an_iteration_again_replaces_its_directory(tmp_path, monkeypatch, atomic_swap):
    if not atomic_swap:  # filesystems without RENAME_EXCHANGE (NFS, for one)
        monkeypatch.setattr(checkpoint_publish, "_exchange", lambda first, second: False)
    final, staging = tmp_path / "iter_0000002", tmp_path / "iter_0000002.tmp"
    for directory, content in ((final, "old"), (staging, "new")):
        directory.mkdir()
        (directory / "common.pt").write_text(content)
    checkpoint_publish._move_into_place(str(tmp_path), str(staging), str(final), 2)
    assert _listing(tmp_path) == ["iter_0000002", POINTER] and _pointer(tmp_path) == "2\n"
    assert (final / "common.pt").read_text() == "new"
