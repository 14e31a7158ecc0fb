"""SIGTERM (docker stop, Kubernetes, scancel) and SIGINT (Ctrl-C) under --exit-signal-handler:
every rank finishes the same iteration, saves, and exits 143 or 130 with one line; the
checkpoint resumes to the losses of a run never stopped."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
from torch.distributed.launcher.api import LaunchConfig

from megatron.trainer import launch
from megatron.trainer.run.exit_signals import LAUNCH_SCRIPT_PID, ExitSignals, launch_script_pid
from megatron.trainer.run.settings_agreement import mismatch_message
from tests.job import TINY_GPT, Job
from tests.node_runs import REPO, Node, script_env

START_S = 240
ITERS = 20
STOPPED = re.compile(r"ERROR megatron\.trainer\.run\.failures: stopped by (SIG\w+) after "
                     rf"iteration (\d+) of {ITERS}; (.*)$", re.MULTILINE)
RECEIVED = re.compile(r"received (SIG\w+): stopping after this iteration")
# torchrun passing a signal on to a rank (its words before torch 2.12 and from it)
CLOSING = re.compile(r"Closing process \d+ via signal|Sending process \d+ closing signal")


def _stop_script(tmp_path, signum: int, whole_group: bool, **settings) -> tuple[Node, int]:
    """run_single_gpt.sh stopped by `signum` once it logged iteration 2: sent to the script
    alone (docker stop, Kubernetes) or to its whole process group (a terminal's Ctrl-C)."""
    # started as from a terminal, SIGHUP not ignored: a shell cannot trap a signal that was
    # ignored when it started, and a test runner may have inherited that (nohup)
    hangup = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        node = Node.script("run_single_gpt.sh", tmp_path, TRAIN_ITERS=ITERS, LOG_INTERVAL=1,
                           **settings)
    finally:
        signal.signal(signal.SIGHUP, hangup)
    try:
        node.wait_for(" iteration        2/", START_S)
        if whole_group:
            os.killpg(node.process.pid, signum)
        else:
            node.process.send_signal(signum)
        status = node.wait(60)
        assert node.wait_until_gone(10) == [], "processes left after the script ended"
    finally:
        node.kill()
    return node, status


@pytest.mark.slow
def test_sigterm_to_the_launch_script_saves_and_resumes_to_the_same_losses(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    stopped, status = _stop_script(tmp_path / "stopped", signal.SIGTERM, whole_group=False,
                                   CHECKPOINT_DIR=checkpoints)
    out = stopped.output()
    assert status == 143, out[-3000:]
    lines = STOPPED.findall(out)
    assert len(lines) == 1, out[-3000:]  # every rank logs it; the terminal shows it once
    name, iteration, saved = lines[0]
    assert name == "SIGTERM" and saved == f"saved iteration {iteration} to {checkpoints}"
    assert "Traceback" not in out and "SignalException" not in out
    assert "[run_single_gpt.sh] stopped by SIGTERM (exit 143)" in out
    # the log has every rank's line
    assert len(STOPPED.findall(stopped.log())) == 2
    assert (checkpoints / "latest_checkpointed_iteration.txt").read_text().strip() == iteration
    stop = int(iteration)
    assert 2 <= stop < ITERS and len(stopped.losses()) == stop

    resumed = Node.script("run_single_gpt.sh", tmp_path / "resumed", TRAIN_ITERS=ITERS,
                          LOG_INTERVAL=1, CHECKPOINT_DIR=checkpoints)
    never_stopped = Node.script("run_single_gpt.sh", tmp_path / "whole", TRAIN_ITERS=ITERS,
                                LOG_INTERVAL=1)
    try:
        assert resumed.wait(START_S) == 0, resumed.output()[-3000:]
        assert never_stopped.wait(START_S) == 0, never_stopped.output()[-3000:]
    finally:
        resumed.kill()
        never_stopped.kill()
    reference = never_stopped.losses()
    assert len(reference) == ITERS
    assert stopped.losses() == reference[:stop]
    assert resumed.losses() == reference[stop:]


@pytest.mark.slow
def test_ctrl_c_on_the_launch_script_ends_with_130_and_the_log_keeps_the_last_lines(tmp_path):
    node, status = _stop_script(tmp_path, signal.SIGINT, whole_group=True)
    out = node.output()
    assert status == 130, out[-3000:]
    lines = STOPPED.findall(out)
    # torchrun before torch 2.12 passes SIGTERM on to the ranks whatever it received
    assert len(lines) == 1 and lines[0][0] in ("SIGINT", "SIGTERM"), out[-3000:]
    assert lines[0][2] == "no checkpoint saved (no --save)"
    assert "Traceback" not in out
    # tee ignored the Ctrl-C: train.log has both ranks' last line
    log = node.log()
    assert len(STOPPED.findall(log)) == 2, log[-3000:]
    # torchrun got the Ctrl-C once (from the script, not also from the terminal): it passed
    # it on once to each rank
    assert len(CLOSING.findall(log)) == 2, log[-3000:]


@pytest.mark.slow
def test_a_second_ctrl_c_on_the_launch_script_ends_the_ranks_without_the_step(tmp_path):
    """Every task 30x as long, so a step lasts seconds: the first Ctrl-C asks the ranks to
    stop after it, the second ends them at once (no line of a finished step)."""
    node = Node(["bash", str(REPO / "run_single_gpt.sh"), "--emulate-straggler", "all:1:30"],
                script_env(tmp_path, TRAIN_ITERS=ITERS, LOG_INTERVAL=1), tmp_path)
    try:
        node.wait_for(" iteration        1/", START_S)
        os.killpg(node.process.pid, signal.SIGINT)
        deadline = time.monotonic() + 30
        while len(RECEIVED.findall(node.log())) < 2:
            assert time.monotonic() < deadline and node.process.poll() is None, node.log()[-3000:]
            time.sleep(0.05)
        os.killpg(node.process.pid, signal.SIGINT)
        status = node.wait(30)
        assert node.wait_until_gone(10) == [], "processes left after the script ended"
    finally:
        node.kill()
    log, out = node.log(), node.output()
    assert status == 130, out[-3000:]
    assert "[run_single_gpt.sh] stopped by SIGINT (exit 130)" in out
    if set(RECEIVED.findall(log)) == {"SIGTERM"}:
        # torchrun before torch 2.12 passed the first Ctrl-C on as SIGTERM: ranks stopping on
        # SIGTERM take a SIGINT as another signal and finish their step
        assert [name for name, _, _ in STOPPED.findall(log)] == ["SIGTERM"] * 2, log[-3000:]
        return
    assert log.count("ERROR megatron.trainer.run.failures: interrupted (SIGINT)") == 2, log[-3000:]
    assert not STOPPED.findall(log), log[-3000:]


@pytest.mark.slow
def test_a_closed_terminal_saves_and_stops_as_sigterm_does(tmp_path):
    """SIGHUP to the script's group (the terminal closed, an ssh session dropped): the
    script passes it on as SIGTERM, so the ranks save and stop; the job's status is SIGHUP's."""
    checkpoints = tmp_path / "checkpoints"
    node, status = _stop_script(tmp_path, signal.SIGHUP, whole_group=True,
                                CHECKPOINT_DIR=checkpoints)
    out = node.output()
    assert status == 129, out[-3000:]
    lines = STOPPED.findall(node.log())
    assert len(lines) == 2 and len(set(lines)) == 1, node.log()[-3000:]
    name, iteration, saved = lines[0]
    assert name == "SIGTERM" and saved == f"saved iteration {iteration} to {checkpoints}"
    assert (checkpoints / "latest_checkpointed_iteration.txt").read_text().strip() == iteration
    assert "[run_single_gpt.sh] stopped by SIGHUP (exit 129)" in out


@pytest.mark.slow
def test_ranks_killed_before_they_stopped_are_named(tmp_path):
    """No grace (STOP_GRACE=0): torchrun kills the ranks as soon as it passed SIGTERM on,
    before they end their step and save; the script says that the save is lost."""
    if "shutdown_timeout" not in LaunchConfig.__dataclass_fields__:
        pytest.skip("torchrun before torch 2.12 gives its ranks 30 s whatever STOP_GRACE says")
    node, status = _stop_script(tmp_path, signal.SIGTERM, whole_group=False, STOP_GRACE=0,
                                CHECKPOINT_DIR=tmp_path / "checkpoints")
    out = node.output()
    assert status == 143, out[-3000:]
    assert "[run_single_gpt.sh] torchrun killed ranks that had not stopped 0 s after it " \
        "passed the signal on (STOP_GRACE" in out, out[-3000:]
    assert not STOPPED.findall(node.log()), node.log()[-3000:]


@pytest.mark.slow
def test_ranks_save_and_stop_when_the_launch_script_is_killed(tmp_path):
    """The script killed (SIGKILL: the kernel's out-of-memory killer, a batch system): every
    rank sees it gone, stops after the same iteration, saves, and torchrun ends with them."""
    checkpoints = tmp_path / "checkpoints"
    node = Node.script("run_single_gpt.sh", tmp_path, TRAIN_ITERS=ITERS, LOG_INTERVAL=1,
                       CHECKPOINT_DIR=checkpoints)
    try:
        node.wait_for(" iteration        2/", START_S)
        node.process.kill()
        left = node.wait_until_gone(60)
    finally:
        node.kill()
    log = node.log()
    assert left == [], log[-3000:]
    seen = re.findall(r"ERROR megatron\.trainer\.run\.exit_signals: the launch script "
                      rf"\(pid {node.process.pid}\) ended; stopping this rank", log)
    assert len(seen) == 2, log[-3000:]
    lines = STOPPED.findall(log)
    assert len(lines) == 2 and len(set(lines)) == 1, log[-3000:]
    name, iteration, saved = lines[0]
    assert name == "SIGTERM" and saved == f"saved iteration {iteration} to {checkpoints}"
    assert 2 <= int(iteration) < ITERS
    assert (checkpoints / "latest_checkpointed_iteration.txt").read_text().strip() == iteration


def test_a_rank_follows_the_launch_script_only_where_it_started_torchrun(tmp_path):
    assert launch_script_pid({}) is None
    assert launch_script_pid({LAUNCH_SCRIPT_PID: "not a pid"}) is None
    # a live process that is not this process's grandparent: another job's script
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) as other:
        try:
            assert launch_script_pid({LAUNCH_SCRIPT_PID: str(other.pid)}) is None
        finally:
            other.kill()
    # gone before this rank started: followed, so that the rank stops at once
    assert launch_script_pid({LAUNCH_SCRIPT_PID: str(other.pid)}) == other.pid
    grandparent = int(open(f"/proc/{os.getppid()}/stat").read().rsplit(")", 1)[1].split()[1])
    assert launch_script_pid({LAUNCH_SCRIPT_PID: str(grandparent)}) == grandparent


@pytest.mark.slow
def test_a_signal_that_reached_a_rank_only_is_named_as_a_stop(tmp_path):
    """scancel, or another node's Ctrl-C: the ranks stop and save, and the script, which
    received nothing, says what stopped them instead of "training failed"."""
    checkpoints = tmp_path / "checkpoints"
    node = Node.script("run_single_gpt.sh", tmp_path, TRAIN_ITERS=ITERS, LOG_INTERVAL=1,
                       CHECKPOINT_DIR=checkpoints)
    try:
        node.wait_for(" iteration        2/", START_S)
        os.kill(_pids(node, b"pretrain_gpt.py", b"torchrun")[0], signal.SIGTERM)
        status = node.wait(60)
        assert node.wait_until_gone(10) == [], "processes left after the script ended"
    finally:
        node.kill()
    out = node.output()
    assert status == 143, out[-3000:]
    lines = STOPPED.findall(node.log())
    assert len(lines) == 2 and len(set(lines)) == 1 and lines[0][0] == "SIGTERM", out[-3000:]
    assert "[run_single_gpt.sh] stopped by SIGTERM, which reached the ranks but not this " \
        "script" in out, out[-3000:]
    assert "training failed" not in out


def _pids(node: Node, name: bytes, unless: bytes | None = None) -> list[int]:
    """The node's processes with a word named `name` in their command line (and none named
    `unless`): the last part of a path, so that a file in the test's directory, whose name
    holds the test's, does not count."""
    found = []
    for pid in node.processes():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                words = {os.path.basename(word) for word in cmdline.read().split(b"\0")}
        except OSError:  # ended meanwhile
            continue
        if name in words and (unless is None or unless not in words):
            found.append(pid)
    return found


def _running(node: Node, name: bytes, unless: bytes | None = None) -> bool:
    return bool(_pids(node, name, unless))


def _ctrl_c_once(node: Node, ready, settle_s: float = 0.0) -> tuple[int | None, list[int]]:
    """A terminal's Ctrl-C to the node's process group once `ready(node)` (and `settle_s`
    after): the node's exit status and the processes left 10 s after it ended."""
    try:
        while not ready(node):
            assert node.process.poll() is None, node.output()[-3000:]
            time.sleep(0.02)
        time.sleep(settle_s)
        os.killpg(node.process.pid, signal.SIGINT)
        return node.wait(15), node.wait_until_gone(10)
    finally:
        node.kill()


def test_ctrl_c_while_the_ranks_start_ends_at_once_without_a_traceback(tmp_path):
    node = Node.script("run_single_gpt.sh", tmp_path, TRAIN_ITERS=ITERS)
    # once torchrun has started the ranks, which then import torch and megatron-core
    status, left = _ctrl_c_once(node, lambda n: _running(n, b"pretrain_gpt.py", b"torchrun"),
                                settle_s=0.5)
    out = node.output()
    assert status == 130 and left == [], out[-3000:]
    assert "Traceback" not in out and "During handling" not in out, out[-3000:]
    assert "[run_single_gpt.sh] stopped by SIGINT (exit 130)" in out


def test_ctrl_c_while_torchrun_starts_is_not_lost(tmp_path):
    """A Ctrl-C while torchrun still imports torch (it ignores SIGINT then, as a script's
    background command) ends the job at once: no rank starts training."""
    node = Node.script("run_single_gpt.sh", tmp_path, TRAIN_ITERS=ITERS)
    status, left = _ctrl_c_once(node, lambda n: _running(n, b"torchrun"))
    out = node.output()
    assert status == 130 and left == [], out[-3000:]
    assert " iteration " not in node.log(), out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert "[run_single_gpt.sh] stopped by SIGINT (exit 130)" in out


def test_sigterm_to_one_rank_stops_every_rank_after_the_same_iteration(tmp_path):
    """scancel or a node's own shutdown may reach some ranks only: they agree at each
    step boundary, so the others stop after the same iteration and the save is whole."""
    save = tmp_path / "checkpoints"
    flags = TINY_GPT + ["--train-iters", "100000", "--pipeline-model-parallel-size", "2",
                        "--use-dpp", "--exit-signal-handler", "--save", str(save)]
    with Job("pretrain_gpt.py", flags, 2, tmp_path / "job") as job:
        job.wait_for(1, " iteration        2/", START_S)
        job.signal(0, signal.SIGTERM)
        statuses = [job.wait(rank, 60) for rank in (0, 1)]
        left = job.wait_until_gone(10)
    assert statuses == [143, 143] and left == [], job.log(0)[-2000:] + job.log(1)[-2000:]
    stopped = [re.findall(r"stopped by SIGTERM after iteration (\d+) of 100000; saved "
                          rf"iteration (\d+) to {re.escape(str(save))}", job.log(rank))
               for rank in (0, 1)]
    assert stopped[0] == stopped[1] and len(stopped[0]) == 1, stopped
    iteration = stopped[0][0][0]
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == iteration
    assert "Traceback" not in job.log(0) + job.log(1)


def test_a_second_ctrl_c_does_not_wait_for_the_step():
    before = signal.getsignal(signal.SIGINT)
    with ExitSignals(device=None) as signals:
        os.kill(os.getpid(), signal.SIGTERM)
        assert signals.received == signal.SIGTERM
        os.kill(os.getpid(), signal.SIGINT)  # after another signal: still waits
        assert signals.received == signal.SIGTERM
    with ExitSignals(device=None) as signals, pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
        assert signals.received == signal.SIGINT
        os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before


def test_the_console_hides_torchruns_traceback_on_a_signal():
    log = [
        "[12:00:00 rank1] ERROR megatron.trainer.run.failures: stopped by SIGTERM after "
        "iteration 6 of 40; saved iteration 6 to /ckpt\n",
        "W1129 12:00:00.1 torch/distributed/elastic/agent/server/api.py:751] Received "
        "Signals.SIGTERM death signal, shutting down workers\n",
        "W1129 12:00:00.2 torch/distributed/elastic/multiprocessing/api.py:871] Closing "
        "process 42 via signal SIGTERM\n",
        "Traceback (most recent call last):\n",
        '  File "/venv/bin/torchrun", line 8, in <module>\n',
        "    sys.exit(main())\n",
        "torch.distributed.elastic.multiprocessing.api.SignalException: Process 41 got "
        "signal: 15\n",
    ]
    assert list(launch.console_lines(log)) == log[:1]
    # a second signal while torchrun stops the ranks chains a second traceback to the first
    chained = log + ["\n", "During handling of the above exception, another exception "
                     "occurred:\n", "\n"] + log[3:] + ["[run_single_gpt.sh] stopped\n"]
    assert list(launch.console_lines(chained)) == [log[0], "[run_single_gpt.sh] stopped\n"]


def test_settings_that_differ_within_a_node_name_the_ranks():
    same = {"--num-layers": "4", "--seed": "1"}
    gathered = [(0, same), (0, {**same, "--seed": "2"}), (1, same), (1, same)]
    assert mismatch_message(gathered) == (
        "the nodes were given different settings: --seed 1 on rank 0 (node 0), node 1, 2 on "
        "rank 1 (node 0) (start every node with the same flags and settings)")
    assert mismatch_message([(0, same), (1, dict(same))]) is None
