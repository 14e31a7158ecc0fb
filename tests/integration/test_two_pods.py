"""Two pods on one host: run_master_gpt.sh and run_worker_gpt.sh with NODE_IPS="127.0.0.1
127.0.0.2", two CPU processes a pod, PP=4. The edges between the pods take torch (never
shared memory, though both pods share the host), each rank names every edge's transport
under DPP and under megatron-core's 1F1B, the emulated link applies to the edges between
pods only, and the losses are those of the same stages in one pod."""

from __future__ import annotations

import os
import re
import signal
import subprocess

import pytest

from megatron.trainer import launch
from tests.integration.test_launch import REPO, RUN_TIMEOUT, logged_losses, run_script, script_env

ITERS = 3
PODS = "127.0.0.1 127.0.0.2"
# the edges each rank sends or receives on, PP=4 over ranks 0,1 (pod 0) and 2,3 (pod 1)
EDGES = {0: ["0->1", "1->0"], 1: ["0->1", "1->0", "1->2", "2->1"],
         2: ["1->2", "2->1", "2->3", "3->2"], 3: ["2->3", "3->2"]}
CROSSING = {"1->2": "127.0.0.1 -> 127.0.0.2", "2->1": "127.0.0.2 -> 127.0.0.1"}
# the transport line of each schedule: (pattern, in-pod transport, cross-pod transport)
SCHEDULES = {
    "dpp": (r"DPP transport (\w+) for edge (\d+->\d+):[AG](.*)", "shm", "torch"),
    "megatron-core": (r"megatron-core p2p over (\w+) for edge (\d+->\d+)(.*)", "gloo", "gloo"),
}


def _edge_lines(log: str, pattern: str) -> dict[int, dict[str, str]]:
    """{rank: {edge: its transport and the rest of its line}} from a pod's train.log."""
    found: dict[int, dict[str, str]] = {}
    for rank, transport, edge, rest in re.findall(rf"rank(\d+)\] INFO \S+: {pattern}", log):
        found.setdefault(int(rank), {})[edge] = f"{transport}{rest}"
    return found


@pytest.fixture(scope="module")
def one_pod_losses(tmp_path_factory):
    """The same four stages in one pod (dropout draws are keyed by stage: the same layout)."""
    run_dir = tmp_path_factory.mktemp("one-pod")
    single = run_script("run_single_gpt.sh", script_env(
        run_dir, GPUS_PER_NODE=4, PP=4, TRAIN_ITERS=ITERS, LOG_INTERVAL=1, DATA_PATH="mock"))
    assert single.returncode == 0, single.stderr[-3000:]
    losses = logged_losses((run_dir / "train.log").read_text())
    assert len(losses) == ITERS
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_two_pods_on_one_host_train_with_one_pods_losses(one_pod_losses, schedule, tmp_path):
    settings = dict(NODE_IPS=PODS, GPUS_PER_NODE=2, PP=4, TRAIN_ITERS=ITERS, LOG_INTERVAL=1,
                    DATA_PATH="mock", MASTER_PORT=launch.free_port(), RDZV_TIMEOUT=120,
                    USE_DPP=int(schedule == "dpp"))
    runs = []
    try:
        for node, script in enumerate(("run_master_gpt.sh", "run_worker_gpt.sh")):
            env = script_env(tmp_path / f"pod{node}", NODE_RANK=node, **settings)
            runs.append(subprocess.Popen(
                ["bash", str(REPO / script), "--emulate-link-ms", "20,5"], env=env, cwd=REPO,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                start_new_session=True))
        outputs = [process.communicate(timeout=RUN_TIMEOUT)[0] for process in runs]
    finally:
        for process in runs:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    for process, output in zip(runs, outputs, strict=True):
        assert process.returncode == 0, output[-4000:]
    logs = [(tmp_path / f"pod{node}" / "train.log").read_text() for node in (0, 1)]
    assert "emulated: link 20 ms + U(0, 5) ms on the edges between pods" in logs[0]
    # the last stage, in the second pod, logs the losses
    assert logged_losses(logs[1]) == pytest.approx(one_pod_losses, rel=1e-5)
    pattern, in_pod, across = SCHEDULES[schedule]
    lines = _edge_lines(logs[0], pattern) | _edge_lines(logs[1], pattern)
    assert sorted(lines) == [0, 1, 2, 3]
    for rank, edges in EDGES.items():
        assert sorted(lines[rank]) == edges, lines[rank]
        for edge in edges:
            expected = (f"{across} (across pods {CROSSING[edge]}, emulated link)"
                        if edge in CROSSING else in_pod)
            assert lines[rank][edge] == expected, (rank, edge, lines[rank][edge])
