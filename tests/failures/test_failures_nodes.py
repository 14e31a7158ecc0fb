"""Jobs of two "nodes" (127.0.0.1 and 127.0.0.2 on this machine) that cannot go on: nodes
given different settings, a node that dies or fails at its end, a launcher killed under its
ranks. Each ends with one line naming the cause, the stated exit status, and no process
left behind within the stated time."""

from __future__ import annotations

import os
import re
import signal
import sys
import time

import pytest

from megatron.trainer.launch import free_port
from tests.node_runs import REPO, Node, two_node_settings

START_S = 240  # start-up to the first iterations, on a loaded 2-core machine
PEERS_ENDED_S = 60  # a node whose peers ended stops within this


@pytest.mark.slow
def test_nodes_given_different_settings_stop_with_one_line_naming_each(tmp_path):
    shared = two_node_settings(LOG_INTERVAL=1)
    master = Node.script("run_master_gpt.sh", tmp_path / "master", NUM_LAYERS=4, TRAIN_ITERS=3,
                         **shared)
    worker = Node.script("run_worker_gpt.sh", tmp_path / "worker", NUM_LAYERS=2, TRAIN_ITERS=6,
                         **shared)
    try:
        statuses = [node.wait(START_S) for node in (master, worker)]
        left = [node.wait_until_gone(5) for node in (master, worker)]
    finally:
        master.kill()
        worker.kill()
    assert statuses == [2, 2], master.output()[-3000:] + worker.output()[-3000:]
    assert left == [[], []]
    expected = ("the nodes were given different settings: --num-layers 4 on node 0, 2 on node 1; "
                "--train-iters 3 on node 0, 6 on node 1; --eval-interval 3 on node 0, 6 on node 1 "
                "(start every node with the same flags and settings)")
    for node in (master, worker):
        errors = [line for line in node.output().splitlines() if " ERROR " in line]
        assert len(errors) == 1 and errors[0].endswith(expected), node.output()[-3000:]
        assert "Traceback" not in node.output()
    # nothing was built: the check comes before the model
    assert "parameters on this rank" not in master.log() + worker.log()


@pytest.mark.slow
def test_a_node_whose_peer_node_died_stops_within_a_minute(tmp_path):
    shared = two_node_settings(LOG_INTERVAL=1, TRAIN_ITERS=100000, DPP_TRANSPORT="torch")
    master = Node.script("run_master_gpt.sh", tmp_path / "master", **shared)
    worker = Node.script("run_worker_gpt.sh", tmp_path / "worker", **shared)
    try:
        worker.wait_for(" iteration        2/", START_S)
        master.processes()
        worker.kill()
        died = time.monotonic()
        status = master.wait(PEERS_ENDED_S)
        left = master.wait_until_gone(max(1.0, PEERS_ENDED_S - (time.monotonic() - died)))
    finally:
        master.kill()
    assert status == 1, master.output()[-3000:]
    assert left == []
    errors = [line for line in master.output().splitlines() if " ERROR " in line]
    # rank 0 was receiving a gradient, sending an activation or in a collective (the
    # gradient norm, the step's end) when its peer went: each names the peer's failure
    assert len(errors) == 1 and re.search(
        r"pipeline transport: (pipeline peer rank 1 failed|send to rank 1 failed)"
        r"|a peer rank failed, disconnected or timed out in a collective operation",
        errors[0]), \
        master.output()[-3000:]
    assert "training failed (exit 1)" in master.output()


TORCHRUN_GPT = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
    "--global-batch-size", "8", "--lr", "1e-3", "--mock-data", "--tokenizer-type",
    "NullTokenizer", "--vocab-size", "128", "--eval-iters", "0", "--log-interval", "1",
    "--pipeline-model-parallel-size", "2", "--exit-signal-handler",
]


def torchrun(nnodes: int, node_rank: int, nproc: int, port: int, entry: str,
             flags: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes),
            "--node_rank", str(node_rank), "--nproc_per_node", str(nproc), "--master_addr",
            "127.0.0.1", "--master_port", str(port), str(entry), *flags]


def torchrun_env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
                CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(REPO))


# the last stage's TensorBoard / W&B writer fails when the run ends, after the last step
FAILING_AT_THE_END = f"""
import runpy, sys
from megatron.trainer.run import metrics

def close(self):
    raise OSError(28, "No space left on device")

metrics.ScalarLog.close = close
sys.argv[0] = {str(REPO / 'pretrain_gpt.py')!r}
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.slow
def test_a_node_whose_peers_failed_at_their_end_does_not_wait_for_them(tmp_path):
    """torchrun waits up to 300 s for the other nodes' torchrun when its own ranks ended
    well; the ranks end together, so a failure on one node fails the other's too."""
    entry = tmp_path / "failing_at_the_end.py"
    entry.write_text(FAILING_AT_THE_END)
    port = free_port()
    flags = TORCHRUN_GPT + ["--train-iters", "3"]
    master = Node(torchrun(2, 0, 1, port, REPO / "pretrain_gpt.py", flags), torchrun_env(),
                  tmp_path / "master")
    worker = Node(torchrun(2, 1, 1, port, entry, flags), torchrun_env(), tmp_path / "worker")
    try:
        worker_status = worker.wait(START_S)
        ended = time.monotonic()
        master_status = master.wait(PEERS_ENDED_S)
        waited = time.monotonic() - ended
        left = master.wait_until_gone(5) + worker.wait_until_gone(5)
    finally:
        master.kill()
        worker.kill()
    assert worker_status == 1, worker.output()[-3000:]
    assert master_status == 1, f"{waited:.0f} s after the worker:\n{master.output()[-3000:]}"
    assert left == []
    errors = [line for line in master.output().splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "a peer rank failed, disconnected or timed out in a collective " \
        "operation" in errors[0], master.output()[-3000:]


def _training_torchrun(tmp_path, save) -> Node:
    """A bare torchrun of two ranks saving to `save`, once they logged iteration 2."""
    job = Node(torchrun(1, 0, 2, free_port(), REPO / "pretrain_gpt.py", TORCHRUN_GPT + [
        "--train-iters", "100000", "--save", str(save)]), torchrun_env(), tmp_path)
    deadline = time.monotonic() + START_S
    while " iteration        2/" not in job.output():
        if time.monotonic() > deadline or job.process.poll() is not None:
            job.kill()
            raise AssertionError(job.output()[-3000:])
        job.processes()  # remember the ranks while they live
        time.sleep(0.2)
    return job


@pytest.mark.slow
def test_ranks_save_and_stop_when_torchrun_is_killed(tmp_path):
    save = tmp_path / "checkpoints"
    job = _training_torchrun(tmp_path, save)
    try:
        ranks = [pid for pid in job.processes() if pid != job.process.pid]
        os.kill(job.process.pid, signal.SIGKILL)
        left = job.wait_until_gone(30)
    finally:
        job.kill()
    assert len(ranks) == 2 and left == [], job.output()[-3000:]
    out = job.output()
    launcher_lines = re.findall(r"ERROR megatron\.trainer\.run\.exit_signals: the launcher "
                                rf"\(pid {job.process.pid}\) ended; stopping this rank", out)
    assert len(launcher_lines) == 2, out[-3000:]
    stopped = re.findall(r"stopped by SIGTERM after iteration (\d+) of 100000; saved iteration "
                         rf"(\d+) to {re.escape(str(save))}", out)
    assert stopped and all(a == b == stopped[0][0] for a, b in stopped), out[-3000:]
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == stopped[0][0]


@pytest.mark.slow
def test_ctrl_c_on_a_raw_torchrun_saves_and_stops_every_rank(tmp_path):
    """Ctrl-C in the terminal of a bare torchrun (its process group): every rank stops after
    the same iteration with its line and saves; torchrun's own status is its choice (1, with
    its SignalException traceback), the launch scripts turn it into 130."""
    save = tmp_path / "checkpoints"
    job = _training_torchrun(tmp_path, save)
    try:
        os.killpg(job.process.pid, signal.SIGINT)
        status = job.wait(60)
        left = job.wait_until_gone(10)
    finally:
        job.kill()
    out = job.output()
    assert status not in (None, 0) and left == [], out[-3000:]
    # torchrun before 2.12 passes SIGTERM on to the ranks whatever it received
    stopped = re.findall(r"stopped by (SIGINT|SIGTERM) after iteration (\d+) of 100000; saved "
                         rf"iteration (\d+) to {re.escape(str(save))}", out)
    assert len(stopped) == 2 and len({it for _, it, _ in stopped}) == 1, out[-3000:]
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == stopped[0][1]
