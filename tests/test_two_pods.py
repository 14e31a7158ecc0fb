"""Two pods on one host: run_master_gpt.sh and run_worker_gpt.sh with NODE_IPS="127.0.0.1
127.0.0.2", two CPU processes a pod, PP=4. The edges between the pods take torch (never
shared memory, though both pods share the host), each rank names every edge's transport,
the emulated link applies to the edges between pods only, and the losses are those of the
same stages in one pod."""

from __future__ import annotations

import os
import re
import signal
import subprocess

import pytest

from megatron.trainer import launch
from tests.test_launch import REPO, RUN_TIMEOUT, logged_losses, run_script, script_env

ITERS = 3
PODS = "127.0.0.1 127.0.0.2"
# the edges each rank sends or receives on, PP=4 over ranks 0,1 (pod 0) and 2,3 (pod 1)
EDGES = {0: ["0->1:A", "1->0:G"], 1: ["0->1:A", "1->0:G", "1->2:A", "2->1:G"],
         2: ["1->2:A", "2->1:G", "2->3:A", "3->2:G"], 3: ["2->3:A", "3->2:G"]}
CROSSING = {"1->2:A", "2->1:G"}


def _edge_lines(log: str) -> dict[int, dict[str, str]]:
    """{rank: {edge: the rest of its transport line}} from a node's train.log."""
    found: dict[int, dict[str, str]] = {}
    for rank, transport, edge, rest in re.findall(
            r"rank(\d+)\] INFO \S+: DPP transport (\w+) for edge (\S+)(.*)", log):
        found.setdefault(int(rank), {})[edge] = f"{transport}{rest}"
    return found


@pytest.mark.slow
def test_two_pods_on_one_host_train_with_one_pods_losses(tmp_path):
    # the same four stages in one pod (dropout draws are keyed by stage: the same layout)
    single = run_script("run_single_gpt.sh", script_env(
        tmp_path / "single", GPUS_PER_NODE=4, PP=4, TRAIN_ITERS=ITERS, LOG_INTERVAL=1,
        DATA_PATH="mock"))
    assert single.returncode == 0, single.stderr[-3000:]
    reference = logged_losses((tmp_path / "single" / "train.log").read_text())
    assert len(reference) == ITERS
    settings = dict(NODE_IPS=PODS, GPUS_PER_NODE=2, PP=4, TRAIN_ITERS=ITERS, LOG_INTERVAL=1,
                    DATA_PATH="mock", MASTER_PORT=launch.free_port(), RDZV_TIMEOUT=120)
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
    # the last stage, in the second pod, logs one pod's losses
    assert logged_losses(logs[1]) == pytest.approx(reference, rel=1e-5)
    lines = _edge_lines(logs[0]) | _edge_lines(logs[1])
    assert sorted(lines) == [0, 1, 2, 3]
    for rank, edges in EDGES.items():
        assert sorted(lines[rank]) == edges, lines[rank]
        for edge in edges:
            if edge in CROSSING:
                src, dst = ("127.0.0.1", "127.0.0.2") if edge.endswith("A") else (
                    "127.0.0.2", "127.0.0.1")
                assert lines[rank][edge] == (f"torch (across pods {src} -> {dst}, "
                                             "emulated link)"), (rank, edge)
            else:
                assert lines[rank][edge] == "shm", (rank, edge)
