"""Stopping on request and when the launcher is gone.

--exit-signal-handler (Megatron-LM's flag): SIGTERM (docker stop, Kubernetes, scancel) and
SIGINT (Ctrl-C) do not end the rank where it stands. The handler only records the signal;
at each step boundary the ranks all-reduce what they received, so every rank stops after
the same iteration, saves a checkpoint when --save is given and exits with 128 + the
signal's number (143 for SIGTERM, 130 for SIGINT), as a shell reports a signal.

`LauncherWatch`: a rank that torchrun started stops when torchrun, or the launch script that
started torchrun, is gone (killed with SIGKILL, say), instead of training on as an orphan
nobody waits for: it sends itself SIGTERM (with --exit-signal-handler: save at the next step
boundary and exit), and SIGKILL if it is still alive a grace period later (blocked on a peer
that is gone too).
"""

from __future__ import annotations

import logging
import os
import select
import signal
import threading

import torch
import torch.distributed as dist

log = logging.getLogger("megatron.trainer.run.exit_signals")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
LAUNCH_SCRIPT_PID = "DPP_LAUNCH_SCRIPT_PID"


class StoppedBySignal(Exception):
    """The run stopped at a step boundary after SIGTERM or SIGINT; `status` is the
    process's exit status."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.status = 128 + signum


class ExitSignals:
    """Context manager: while it is open, SIGTERM and SIGINT are recorded instead of
    ending the process (a second SIGINT does end it: Ctrl-C twice does not wait)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.received = 0  # the first signal's number; 0: none
        self._previous: dict[int, object] = {}

    def __enter__(self) -> ExitSignals:
        for signum in STOP_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._record)
        return self

    def __exit__(self, *exc) -> bool:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        return False

    def _record(self, signum, frame) -> None:
        if self.received == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt
        if not self.received:
            self.received = signum
            log.warning("received %s: stopping after this iteration (--exit-signal-handler)",
                        signal.Signals(signum).name)

    def agreed(self) -> int:
        """At a step boundary, on every rank: the signal any rank received (the larger
        number where two ranks received different ones), else 0."""
        flag = torch.tensor([self.received], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())


def launched_by_torchrun(env=os.environ) -> bool:
    """torchrun's agent gives its workers TORCHELASTIC_RUN_ID."""
    return "TORCHELASTIC_RUN_ID" in env


def follow_torchrun(env=os.environ) -> None:
    """In a rank torchrun started, from the start: Ctrl-C, which torchrun passes on, ends
    the rank (a torchrun started in the background by a script gives its ranks an ignored
    SIGINT), and the rank stops when torchrun or the launch script that started it is gone
    (LauncherWatch)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    LauncherWatch(launch_script=launch_script_pid(env)).start()


def launch_script_pid(env=os.environ) -> int | None:
    """The launch script that started torchrun (examples/launch_common.sh gives torchrun its pid
    in DPP_LAUNCH_SCRIPT_PID), where it is torchrun's parent or has already ended; else None."""
    value = env.get(LAUNCH_SCRIPT_PID, "")
    if not value.isdigit():
        return None
    pid = int(value)
    if _parent_of(os.getppid()) == pid or not os.path.exists(f"/proc/{pid}"):
        return pid
    return None  # a live process that did not start torchrun: not ours to follow


class LauncherWatch:
    """A daemon thread that waits for this process's parent (the launcher) and, given its
    pid, the launch script that started the launcher to end; see the module's docstring.
    `grace_s`: how long after its SIGTERM the rank may still run."""

    GRACE_S = 60.0

    def __init__(self, grace_s: float = GRACE_S, launch_script: int | None = None):
        self.grace_s = grace_s
        self.parent = os.getppid()
        # (pid, the pid of its child on this process's line of ancestors, what it is)
        self.watched = [(self.parent, os.getpid(), "the launcher")]
        if launch_script is not None:
            self.watched.append((launch_script, self.parent, "the launch script"))
        self._thread = threading.Thread(target=self._watch, name="launcher watch", daemon=True)

    def start(self) -> LauncherWatch:
        self._thread.start()
        return self

    def _watch(self) -> None:
        pid, _, name = self.watched[_wait_for_first_exit(self.watched)]
        log.error("%s (pid %d) ended; stopping this rank (SIGTERM to itself, SIGKILL after "
                  "%.0f s)", name, pid, self.grace_s)
        os.kill(os.getpid(), signal.SIGTERM)
        threading.Event().wait(self.grace_s)
        log.error("still running %.0f s after %s ended: killing this rank", self.grace_s, name)
        logging.shutdown()
        os.kill(os.getpid(), signal.SIGKILL)


def _wait_for_first_exit(watched: list[tuple[int, int, str]]) -> int:
    """Blocks until one of the `watched` processes has ended (as LauncherWatch.watched) and
    returns its index: on pidfds where the kernel has them (Linux 5.3), else by looking each
    second whether its child was re-parented."""
    pidfds: list[int] = []
    try:
        for pid, _, _ in watched:
            pidfds.append(os.pidfd_open(pid))
    except ProcessLookupError:  # already gone
        ended = len(pidfds)
        _closed(pidfds)
        return ended
    except (AttributeError, OSError):
        pidfds = _closed(pidfds)
    try:
        gone = threading.Event()
        while True:
            # a pidfd opened after its process ended (and its pid reused): the re-parenting
            # of the child shows it
            for index, (pid, child, _) in enumerate(watched):
                if _parent_of(child) != pid:
                    return index
            if pidfds:
                ready, _, _ = select.select(pidfds, [], [])
                return pidfds.index(ready[0])
            gone.wait(1.0)
    finally:
        _closed(pidfds)


def _closed(fds: list[int]) -> list[int]:
    for fd in fds:
        os.close(fd)
    return []


def _parent_of(pid: int) -> int | None:
    """The parent of process `pid` (None once it is gone)."""
    if pid == os.getpid():
        return os.getppid()
    try:
        with open(f"/proc/{pid}/stat") as stat:
            # pid (comm) state ppid ...: comm may hold spaces and parentheses
            return int(stat.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None
