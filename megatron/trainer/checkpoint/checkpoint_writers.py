"""megatron.core's checkpoint writers: their errors raised, their processes die with the rank."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal

from megatron.trainer.checkpoint.checkpoint_publish import _LIBC, CheckpointError
from megatron.trainer.core_compat import core_overrides

_PR_SET_PDEATHSIG = 1


@contextlib.contextmanager
def _write_errors_raised():
    """megatron-core >= 0.17 writes a rank's last bucket (with one writer thread, all of
    it) in the writer itself, and reports the OSError that write returns as an assertion on
    its type: errno and text are lost. Raised instead, megatron-core's error carries its
    text. Writes in threads (and 0.16's processes) hand theirs over their queue as before."""
    write = core_overrides.WRITE_BUCKET.resolve()
    with core_overrides.WRITE_BUCKET.swapped(
            staticmethod(functools.partial(_write_raising_its_error, write))):
        yield


def _write_raising_its_error(write, *args, **kwargs):
    output = write(*args, **kwargs)
    if kwargs.get("results_queue") is None and isinstance(output, tuple) and isinstance(
            output[-1], Exception):
        raise output[-1]
    return output


def _writing_with_errors_raised(write_buckets, *args, **kwargs):
    """The writer process's work: its error goes to the rank's CheckpointError, not its log."""
    with _write_errors_raised(), _writer_errors_raised_not_logged():
        return write_buckets(*args, **kwargs)


@contextlib.contextmanager
def _writer_errors_raised_not_logged():
    """megatron.core logs a writer's error and raises it too; the CheckpointError carries
    it (one line per rank), so below DEBUG its log stays quiet during the save."""
    logger = logging.getLogger("megatron.core.dist_checkpointing")
    if logger.isEnabledFor(logging.DEBUG):
        yield
        return
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _use_results_queue(results) -> None:
    """megatron.core hands its writers' results over a queue of a multiprocessing Manager
    that it spawns on the first save and keeps: a server process (~270 MB) that outlives
    a killed rank, and keeps a resource tracker alive. A synchronous save puts and gets
    those results in this process, so a plain queue serves (and starts nothing); the
    asynchronous saves bring their own (Checkpointer._async_results_queue)."""
    owner, name = core_overrides.WRITE_RESULTS_QUEUE.owner_and_name()
    setattr(owner, name, results)  # declared, so verified to exist at start-up


class ForkedChildren:
    """While `die_with_this_process()` is active, every process forked from this one (the
    checkpoint writers megatron.core forks per save) gets SIGKILL when this process dies
    (Linux PR_SET_PDEATHSIG; the signal follows the forking thread, here the main one),
    and ignores SIGINT: Ctrl-C is this rank's to handle. Without it a writer of a rank
    killed mid-save stays blocked on a queue lock of the dead rank."""

    def __init__(self):
        self.parent_pid = 0
        if _LIBC is not None:
            os.register_at_fork(after_in_child=self._after_fork_in_child)

    @contextlib.contextmanager
    def die_with_this_process(self):
        self.parent_pid = os.getpid()
        try:
            yield
        finally:
            self.parent_pid = 0

    def _after_fork_in_child(self) -> None:
        if self.parent_pid == 0:
            return
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != self.parent_pid:  # the parent died before prctl took effect
            os._exit(1)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        self.parent_pid = os.getpid()  # and its own children die with it


WRITER_CHILDREN = ForkedChildren()


def _require_psutil() -> None:
    """dist_checkpointing's writer processes import psutil; without it they die and the
    save waits for them until the job times out, so fail here with the fix instead."""
    try:
        import psutil  # noqa: F401
    except ImportError as error:
        raise CheckpointError("saving checkpoints needs psutil: pip install psutil") from error
