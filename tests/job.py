"""An entry point run as a job of rank processes, as torchrun starts them (its environment
variables, without its agent), so that a test can stop, kill or interrupt one rank, watch
how the others end, and find every process the job left behind.

Each rank runs in a session of its own (children it forks or spawns stay in it) and writes
its output to `rank{r}.log`. `prelude` is Python run in every rank before the entry point,
to inject a fault (it sees the rank in os.environ["RANK"]).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron.trainer.launch import free_port

REPO = Path(__file__).resolve().parent.parent
POLL_S = 0.1


def process_fields(pid: int | str) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (the state first); None once
    the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def live_processes() -> dict[int, list[str]]:
    """pid -> `process_fields` of every live process (zombies left out)."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := process_fields(entry)) is not None \
                and fields[0] not in ("Z", "X"):
            table[int(entry)] = fields
    return table


class Job:
    def __init__(self, entry: str, flags: list[str], world_size: int, workdir: Path,
                 prelude: str = "", env: dict[str, str] | None = None):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        port = str(free_port())
        # a job started in the background (`cmd &` in a script) inherits an ignored SIGINT;
        # each rank gets Python's handler back, as in a terminal's foreground job
        restore = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)"
        run = f"import runpy; runpy.run_path({str(REPO / entry)!r}, run_name='__main__')"
        self.ranks: list[subprocess.Popen] = []
        try:
            for rank in range(world_size):
                # CPU ranks whatever the machine has (a GPU test passes its own value)
                rank_env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank),
                                WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
                                MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                                OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
                                PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="")
                rank_env.update(env or {})
                with open(self.log_path(rank), "w") as log:
                    self.ranks.append(subprocess.Popen(
                        [sys.executable, "-c", f"{restore}\n{prelude}\n{run}", *flags], cwd=REPO,
                        env=rank_env, stdout=log, stderr=subprocess.STDOUT,
                        start_new_session=True))
        except BaseException:
            self.kill()
            raise

    def log_path(self, rank: int) -> Path:
        return self.workdir / f"rank{rank}.log"

    def log(self, rank: int) -> str:
        return self.log_path(rank).read_text(errors="replace")

    def lines(self, rank: int, containing: str) -> list[str]:
        return [line for line in self.log(rank).splitlines() if containing in line]

    def wait_for(self, rank: int, text: str, timeout: float) -> None:
        """Until `text` is in the rank's output; fails if the rank ends or time runs out."""
        deadline = time.monotonic() + timeout
        while text not in self.log(rank):
            if self.ranks[rank].poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"rank {rank} never printed {text!r}:\n"
                                     f"{self.log(rank)[-3000:]}")
            time.sleep(POLL_S)

    def wait(self, rank: int, timeout: float) -> int | None:
        """The rank's exit status, or None if it still runs after `timeout` seconds."""
        try:
            return self.ranks[rank].wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def signal(self, rank: int, signum: int) -> None:
        os.kill(self.ranks[rank].pid, signum)

    def wait_stopped(self, rank: int, timeout: float) -> None:
        """Until the rank is stopped (SIGSTOP, from itself or another process)."""
        deadline = time.monotonic() + timeout
        while (process_fields(self.ranks[rank].pid) or ["gone"])[0] != "T":
            if self.ranks[rank].poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"rank {rank} did not stop:\n{self.log(rank)[-3000:]}")
            time.sleep(POLL_S)

    def processes(self) -> list[int]:
        """Live processes of the job: its ranks and everything they started."""
        sessions = {str(rank.pid) for rank in self.ranks}
        return [pid for pid, fields in live_processes().items() if fields[3] in sessions]

    def wait_until_gone(self, timeout: float) -> list[int]:
        """Waits until no process of the job is alive; returns those alive at the end."""
        return wait_until_gone(self.processes, self.ranks, timeout)

    def kill(self) -> None:
        """SIGKILL every process of the job (stopped ones too)."""
        kill_all(self.processes(), self.ranks)

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc) -> None:
        self.kill()


TINY_GPT = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
    "--global-batch-size", "8", "--lr", "1e-3", "--mock-data", "--tokenizer-type",
    "NullTokenizer", "--vocab-size", "128", "--eval-iters", "0", "--log-interval", "1",
]


def wait_until_gone(processes, started: list[subprocess.Popen], timeout: float) -> list[int]:
    """Waits until `processes()` (the pids of what `started` began) is empty, reaping the
    started ones that end; returns those alive at the end."""
    deadline = time.monotonic() + timeout
    while True:
        for process in started:
            process.poll()
        alive = processes()
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(POLL_S)


def kill_all(pids: list[int], started: list[subprocess.Popen]) -> None:
    """SIGKILL each of `pids`, then reap the processes in `started`."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for process in started:
        process.wait()


@contextlib.contextmanager
def mounted(*arguments):
    """`mount ARGUMENTS` (root only, as the tests that need a mount are) for the block, the
    last argument its mount point, unmounted after it (lazily: a rank process may still hold
    it); a mount that fails skips the test, saying why."""
    result = subprocess.run(["mount", *map(str, arguments)], capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"mount {' '.join(map(str, arguments))}: {result.stderr.strip()}")
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", str(arguments[-1])], capture_output=True)

