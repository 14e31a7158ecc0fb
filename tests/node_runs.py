"""Launch scripts and torchrun started as a test's "nodes" (loopback addresses 127.0.0.1 and
127.0.0.2 on this machine), each started by setsid (a process group of its own, as a
terminal's job), with what a test needs to stop, kill or interrupt them and to find every
process they left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from megatron.trainer import launch
from megatron.trainer.launch import free_port
from tests.job import kill_all, live_processes, wait_until_gone

REPO = Path(__file__).resolve().parent.parent
POLL_S = 0.2
# settings of the caller that would change what the scripts do
NODE_SETTINGS = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "NNODES", "NODE_IPS", "RANK",
                 "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GPUS_PER_NODE", "DATA_PATH")
LOOPBACK_NODES = "127.0.0.1 127.0.0.2"


def script_env(run_dir: Path, **settings) -> dict[str, str]:
    """The environment of a launch script on CPU, its run directory `run_dir`."""
    env = {k: v for k, v in os.environ.items() if k not in NODE_SETTINGS}
    env.update(SKIP_PREREQ="1", OMP_NUM_THREADS="1", RUN_DIR=str(run_dir),
               PYTHON=sys.executable, PYTHONWARNINGS="ignore", CUDA_VISIBLE_DEVICES="",
               DATA_PATH="mock")
    env.update({k: str(v) for k, v in settings.items()})
    return env


def two_node_settings(**settings) -> dict[str, str]:
    return {"NODE_IPS": LOOPBACK_NODES, "MASTER_PORT": str(free_port()), "RDZV_TIMEOUT": "120",
            **{k: str(v) for k, v in settings.items()}}


def _interruptible() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Node:
    """One launch script (or any command) started by setsid; its output goes to `out` in
    the run directory."""

    def __init__(self, command: list[str], env: dict[str, str], run_dir: Path):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.out_path = self.run_dir / "out"
        with open(self.out_path, "w") as out:
            # a suite started in the background (`cmd &`) passes an ignored SIGINT on: the
            # node must take Ctrl-C as a terminal's user would send it
            self.process = subprocess.Popen(command, cwd=REPO, env=env, stdout=out,
                                            stderr=subprocess.STDOUT, start_new_session=True,
                                            preexec_fn=_interruptible)
        self.known: set[int] = {self.process.pid}

    @classmethod
    def script(cls, name: str, run_dir: Path, **settings) -> Node:
        return cls(["bash", str(REPO / name)], script_env(run_dir, **settings), run_dir)

    def output(self) -> str:
        return self.out_path.read_text(errors="replace")

    def log(self) -> str:
        """The script's train.log (the ranks' and torchrun's whole output)."""
        path = self.run_dir / "train.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def wait_for(self, text: str, timeout: float) -> None:
        """Until `text` is in train.log; fails if the node ends or time runs out."""
        deadline = time.monotonic() + timeout
        while text not in self.log():
            self.processes()  # remember the ranks while they live
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"never logged {text!r}:\n{self.output()[-3000:]}")
            time.sleep(POLL_S)

    def wait(self, timeout: float) -> int | None:
        """The exit status, or None if it still runs after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while self.process.poll() is None and time.monotonic() < deadline:
            self.processes()
            time.sleep(POLL_S)
        return self.process.poll()

    def processes(self) -> list[int]:
        """The live processes started from this node's command, those torchrun moved out of
        its process group included (it starts each rank with setsid): every process whose
        parent is one of them, remembered once seen so that orphans are found too."""
        parents = {pid: int(fields[1]) for pid, fields in live_processes().items()}
        grew = True
        while grew:
            children = {pid for pid, parent in parents.items() if parent in self.known}
            grew = not children <= self.known
            self.known |= children
        return sorted(pid for pid in self.known if pid in parents)

    def wait_until_gone(self, timeout: float) -> list[int]:
        """Waits until no process of the node is alive; returns those alive at the end."""
        return wait_until_gone(self.processes, [self.process], timeout)

    def kill(self) -> None:
        """SIGKILL every process of the node (a machine that dies)."""
        kill_all(self.processes(), [self.process])

    def losses(self) -> list[float]:
        return [row["lm loss"] for row in launch.read_iterations(self.log().splitlines())]

