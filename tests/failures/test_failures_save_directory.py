"""--save is checked and claimed at start: a second job on the same directory stops naming
the first one's process; a crashed holder leaves no lock; a checkpoint series without
--load, a garbage pointer and a read-only directory each stop the job in one line, before
anything is built, and nothing in the directory changes."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest

from megatron.trainer.checkpoint.checkpoint_publish import POINTER
from megatron.trainer.checkpoint.save_directory import SaveDirectory
from tests.job import REPO, TINY_GPT, Job, mounted

HOLD = """
import sys, time
from megatron.trainer.checkpoint.save_directory import SaveDirectory
directory = SaveDirectory(sys.argv[1])
assert directory.claim(resuming=False) is None
print("locked", flush=True)
time.sleep(600)
"""

# the job stops at start-up: well under 30 s on an idle 2-core machine (its Python and torch
# imports included), with room for one shared with other jobs
STOP_S = 60


def _holder(path) -> subprocess.Popen:
    """Another process that claims `path` and keeps it."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], cwd=REPO,
                              env=dict(os.environ, PYTHONPATH=str(REPO)),
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "locked\n"
    return holder


@pytest.mark.slow
def test_a_second_job_on_the_same_save_stops_naming_the_holder(tmp_path):
    root = tmp_path / "ckpt"
    holder = _holder(root)
    try:
        flags = TINY_GPT + ["--train-iters", "2", "--save", str(root)]
        started = time.monotonic()
        with Job("pretrain_gpt.py", flags, 1, tmp_path / "job") as job:
            status = job.wait(0, 60)
        took = time.monotonic() - started
        assert status == 1, job.log(0)[-3000:]
        assert "Traceback" not in job.log(0)
        errors = job.lines(0, " ERROR ")
        assert len(errors) == 1, job.log(0)[-3000:]
        assert (f"checkpoint: --save {root} is in use by another job (pid {holder.pid}: "
                in errors[0]), errors
        assert took < STOP_S, f"the job took {took:.0f} s to stop"
        assert os.listdir(root) == []  # nothing saved over the holder's directory
    finally:
        holder.kill()
        holder.wait()


def test_a_killed_holder_leaves_no_lock(tmp_path):
    holder = _holder(tmp_path)
    assert f"pid {holder.pid}" in SaveDirectory(str(tmp_path)).claim(resuming=False)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    directory = SaveDirectory(str(tmp_path))
    assert directory.claim(resuming=False) is None
    directory.release()


def test_a_checkpoint_series_without_load_is_not_replaced(tmp_path):
    (tmp_path / "iter_0000080").mkdir()
    (tmp_path / POINTER).write_text("80\n")
    problem = SaveDirectory(str(tmp_path)).claim(resuming=False)
    assert problem == (
        f"--save {tmp_path} already holds a checkpoint series ({tmp_path / POINTER} names "
        "iteration 80) and there is no --load: give --load with it to resume that run, or "
        "another --save (this run would replace its checkpoints)")
    directory = SaveDirectory(str(tmp_path))
    assert directory.claim(resuming=True) is None
    directory.release()
    assert sorted(os.listdir(tmp_path)) == ["iter_0000080", POINTER]


def test_a_garbage_pointer_is_found_at_start(tmp_path):
    (tmp_path / POINTER).write_text("release\n")
    problem = SaveDirectory(str(tmp_path)).claim(resuming=True)
    assert problem == (f"--save {tmp_path}: its pointer is unreadable: {tmp_path / POINTER}: "
                       "expected an iteration number, found 'release'")


@contextlib.contextmanager
def _read_only(path):
    """`path` read-only for this process in the block: a read-only bind mount for root (who
    writes through permission bits), else its mode."""
    if os.geteuid() != 0:
        os.chmod(path, 0o555)
        yield
    else:
        with mounted("--bind", "-o", "ro", path, path):
            yield


def test_a_read_only_save_is_found_at_start(tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    with _read_only(root):
        message = SaveDirectory(str(root)).claim(resuming=False)
    assert message in (f"--save {root} is not writable: Read-only file system",
                       f"--save {root} is not writable: Permission denied"), message
