"""The launch scripts: syntax, templates, MPI rank mapping, node checks, and real CPU runs
(single node; two "nodes" in network namespaces joined by a veth pair)."""

from __future__ import annotations

import importlib.util
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron.trainer import launch
from megatron.trainer.run.metrics import IterationStats
from tests import REPO

SCRIPTS = sorted(REPO.glob("run_*_*.sh")) + sorted((REPO / "examples").rglob("*.sh")) + [
    REPO / "examples/slurm/run.slurm"]
# settings of the caller that would change what the scripts do
NODE_SETTINGS = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "NNODES", "NODE_IPS", "RANK",
                 "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GPUS_PER_NODE", "DATA_PATH")
RUN_TIMEOUT = 240


def script_env(tmp_path: Path, **settings) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in NODE_SETTINGS}
    # CPU processes, also on a machine with GPUs (the GPU runs say so explicitly)
    env.update(SKIP_PREREQ="1", OMP_NUM_THREADS="1", RUN_DIR=str(tmp_path),
               PYTHON=sys.executable, PYTHONWARNINGS="ignore", CUDA_VISIBLE_DEVICES="")
    env.update({k: str(v) for k, v in settings.items()})
    return env


def run_script(name: str, env, timeout=RUN_TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REPO / name)], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


def torch_cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def logged_losses(text: str) -> list[float]:
    return [row["lm loss"] for row in launch.read_iterations(text.splitlines())]


# ---- syntax and templates ---------------------------------------------------------------

def test_every_script_parses():
    assert len(SCRIPTS) >= 10
    for script in SCRIPTS:
        result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert result.returncode == 0, f"{script}: {result.stderr}"


def _renderer():
    spec = importlib.util.spec_from_file_location(
        "render_pytorchjob", REPO / "examples/kubernetes/render.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pytorchjob_template_renders_to_valid_yaml():
    render = _renderer()
    text = render.render((REPO / "examples/kubernetes/pytorchjob.yaml").read_text(),
                         {"IMAGE": "registry.example/dpp:7", "NNODES": "4",
                          "GPUS_PER_NODE": "2", "JOB_NAME": "dpp-test"})
    job = yaml.safe_load(text)
    assert job["kind"] == "PyTorchJob" and job["metadata"]["name"] == "dpp-test"
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert replicas["Master"]["replicas"] == 1 and replicas["Worker"]["replicas"] == 3
    container = replicas["Worker"]["template"]["spec"]["containers"][0]
    assert container["image"] == "registry.example/dpp:7"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2
    command = container["args"][0]
    assert "--nnodes=4 --nproc_per_node=2" in command
    # runtime shell variables stay for the container; no template placeholder is left
    assert "--node_rank=${PET_NODE_RANK:-$RANK}" in command
    assert "${IMAGE" not in text and "${NNODES" not in text


def test_pytorchjob_renderer_dry_run_and_missing_value():
    env = {k: v for k, v in os.environ.items() if k not in ("IMAGE", "NNODES")}
    cli = [sys.executable, str(REPO / "examples/kubernetes/render.py"), "--check"]
    ok = subprocess.run(cli, env={**env, "IMAGE": "img:1", "NNODES": "2"},
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert yaml.safe_load(ok.stdout)["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 1
    missing = subprocess.run(cli, env=env, capture_output=True, text=True)
    assert missing.returncode == 2
    assert "pytorchjob.yaml:" in missing.stderr and "set IMAGE" in missing.stderr


# ---- MPI rank mapping --------------------------------------------------------------------

MASTER = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}


@pytest.mark.parametrize("flavour_env, expected", [
    ({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8",
      "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, (5, 8, 1, 4, 1)),
    # Cray PALS also sets PMI_RANK; PALS wins, and PMI_LOCAL_SIZE fills the local size
    ({"PALS_RANKID": "6", "PMI_RANK": "6", "PMI_SIZE": "8", "PALS_LOCAL_RANKID": "2",
      "PMI_LOCAL_SIZE": "4"}, (6, 8, 2, 4, 1)),
    ({"PMI_RANK": "3", "PMI_SIZE": "6", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "3"},
     (3, 6, 0, 3, 1)),
    ({"SLURM_PROCID": "2", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0",
      "SLURM_NTASKS_PER_NODE": "2(x2)"}, (2, 4, 0, 2, 1)),
])
def test_mpi_ranks_map_to_torch_distributed(flavour_env, expected):
    env = launch.torch_env_from_mpi({**flavour_env, **MASTER})
    got = tuple(int(env[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                     "GROUP_RANK"))
    assert got == expected
    assert env["MASTER_ADDR"] == "10.0.0.1" and env["MASTER_PORT"] == "29500"


def test_mpi_mapping_errors_name_the_problem():
    with pytest.raises(launch.LaunchError, match="no MPI rank variables"):
        launch.torch_env_from_mpi(MASTER)
    ompi = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2",
            "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}
    with pytest.raises(launch.LaunchError, match="MASTER_ADDR and MASTER_PORT not set"):
        launch.torch_env_from_mpi(ompi)
    with pytest.raises(launch.LaunchError, match="rank 4/2"):
        launch.torch_env_from_mpi({**ompi, "OMPI_COMM_WORLD_RANK": "4", **MASTER})


def test_mpi_exec_runs_the_command_with_torch_variables():
    env = {**os.environ, **MASTER, "PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1",
           "MPI_LOCALNRANKS": "2", "PYTHONPATH": str(REPO)}
    probe = "import os; print(*(os.environ[k] for k in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK')))"
    result = subprocess.run([sys.executable, "-m", "megatron.trainer.launch", "mpi-exec", "--",
                             sys.executable, "-c", probe], env=env, capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1", "2", "1"]


# ---- node checks (127.0.0.0/8 is all local on Linux: two "nodes" without namespaces) -------

def test_preflight_resolves_worker_rank_and_master():
    with socket.create_server(("127.0.0.1", 0)) as master:
        port = master.getsockname()[1]
        out = launch.preflight("worker", {"NODE_IPS": "127.0.0.1,127.0.0.2",
                                          "MASTER_PORT": str(port)})
    assert out["NODE_RANK"] == "1" and out["NNODES"] == "2"
    assert out["MASTER_ADDR"] == "127.0.0.1" and out["NODE_IPS"] == "127.0.0.1 127.0.0.2"
    assert out["GLOO_SOCKET_IFNAME"] == "lo"


@pytest.mark.parametrize("role, env, message", [
    ("master", {"NODE_IPS": "127.0.0.1 127.0.0.2", "NNODES": "3"},
     "NNODES=3 but NODE_IPS lists 2 addresses"),
    ("master", {"NODE_IPS": "127.0.0.1 node-b"}, "NODE_IPS: 'node-b' is not an IP address"),
    ("master", {"NODE_IPS": "192.0.2.1 127.0.0.1"}, "the master runs on the first node"),
    ("master", {"NODE_IPS": "127.0.0.1 127.0.0.2", "NODE_RANK": "1"}, "the master is node 0"),
    ("worker", {"NODE_IPS": "127.0.0.1 192.0.2.7", "NODE_RANK": "1"},
     "wrong node rank: NODE_RANK=1 is NODE_IPS[1]=192.0.2.7"),
    ("worker", {"NODE_IPS": "127.0.0.1 127.0.0.2", "NODE_RANK": "2"},
     "wrong node rank: NODE_RANK=2, but workers are nodes 1..1"),
    ("worker", {"NODE_IPS": "127.0.0.1 127.0.0.2", "MASTER_ADDR": "127.0.0.3"},
     "MASTER_ADDR=127.0.0.3 differs from NODE_IPS[0]=127.0.0.1"),
])
def test_preflight_rejects_inconsistent_nodes(role, env, message):
    with pytest.raises(launch.LaunchError) as error:
        launch.preflight(role, {"MASTER_PORT": str(launch.free_port()), **env})
    assert message in str(error.value)


def test_preflight_reports_unreachable_master_within_timeout():
    port = launch.free_port()
    with pytest.raises(launch.LaunchError, match=f"cannot reach the master at 127.0.0.1:{port}"):
        launch.preflight("worker", {"NODE_IPS": "127.0.0.1 127.0.0.2", "MASTER_PORT": str(port),
                                    "RDZV_TIMEOUT": "1"})


@pytest.mark.slow
def test_master_script_reports_node_ips_mismatch(tmp_path):
    result = run_script("run_master_gpt.sh", script_env(
        tmp_path, NODE_IPS="127.0.0.1 127.0.0.2", NNODES=3), timeout=60)
    assert result.returncode == 2
    assert "NNODES=3 but NODE_IPS lists 2 addresses (127.0.0.1 127.0.0.2)" in result.stderr


@pytest.mark.slow
def test_scripts_report_port_in_use(tmp_path):
    with socket.create_server(("", 0)) as busy:
        port = busy.getsockname()[1]
        for script, nodes in (("run_master_gpt.sh", {"NODE_IPS": "127.0.0.1 127.0.0.2"}),
                              ("run_single_bert.sh", {})):
            result = run_script(script, script_env(tmp_path, MASTER_PORT=port, **nodes),
                                timeout=60)
            assert result.returncode == 2, result.stderr
            assert f"MASTER_PORT={port} is already in use on this machine" in result.stderr


def test_log_summary_reads_the_trainers_iteration_line():
    def line(iteration, loss, elapsed_ms):
        return IterationStats(
            iteration=iteration, train_iters=4, consumed_samples=8 * iteration,
            elapsed_ms=elapsed_ms, lr=1e-3, global_batch_size=8, losses={"lm loss": loss},
            loss_scale=1.0, grad_norm=0.5, skipped=0, nan=0, tokens=1024, world_size=2,
            flops=1e9, peak_tflops=None).line(with_throughput=True)

    lines = [line(1, 9.5, 4000.0), "unrelated", line(2, 9.0, 500.0), line(3, 8.5, 250.0)]
    rows = launch.read_iterations(lines)
    assert [row["lm loss"] for row in rows] == [9.5, 9.0, 8.5]
    assert rows[1]["tokens/s"] == pytest.approx(2048) and rows[2]["grad norm"] == 0.5
    summary = launch.summarize(lines)
    # the first interval (warm-up) is left out: mean of 2048 and 4096 tokens/s
    assert summary.startswith("throughput: 3072 tokens/s (mean over logged iterations 2-3)")
    assert "lm loss 9.5000 -> 8.5000" in summary


# ---- real runs on CPU --------------------------------------------------------------------

TWO_NODE_ITERS = 3


@pytest.fixture(scope="module")
def single_gpt_run(tmp_path_factory):
    """run_single_gpt.sh on the sample data, PP=2 over 2 CPU processes, --use-dpp."""
    run_dir = tmp_path_factory.mktemp("single-gpt")
    result = run_script("run_single_gpt.sh", script_env(
        run_dir, TRAIN_ITERS=TWO_NODE_ITERS, LOG_INTERVAL=1))
    return result, run_dir


@pytest.mark.slow
def test_single_gpt_script_trains_on_cpu(single_gpt_run):
    result, run_dir = single_gpt_run
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    log = (run_dir / "train.log").read_text()
    losses = logged_losses(log)
    assert len(losses) == TWO_NODE_ITERS and all(math.isfinite(x) for x in losses)
    assert "--use-dpp" in (run_dir / "command.txt").read_text()
    assert "throughput: " in result.stdout and "tokens/s" in result.stdout


@pytest.mark.slow
@pytest.mark.long
def test_single_bert_script_trains_on_cpu(tmp_path):
    result = run_script("run_single_bert.sh", script_env(tmp_path, TRAIN_ITERS=2,
                                                         LOG_INTERVAL=1, USE_DPP=0))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = launch.read_iterations((tmp_path / "train.log").read_text().splitlines())
    assert [int(row["iteration"]) for row in rows] == [1, 2]
    assert all(math.isfinite(row["lm loss"]) and "sop loss" in row for row in rows)
    assert "--use-dpp" not in (tmp_path / "command.txt").read_text()


@pytest.mark.slow
def test_single_process_trains_without_dpp_and_says_why(tmp_path):
    """One process (what one GPU gives): PP=1 under megatron-core's schedule, and one line
    saying how to see the dynamic schedule; asking for it anyway is refused by name."""
    result = run_script("run_single_gpt.sh", script_env(
        tmp_path, GPUS_PER_NODE=1, TRAIN_ITERS=2, LOG_INTERVAL=1, DATA_PATH="mock"))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "needs two or more stages" in result.stderr
    command = (tmp_path / "command.txt").read_text()
    assert "--pipeline-model-parallel-size 1" in command and "--use-dpp" not in command
    assert len(logged_losses((tmp_path / "train.log").read_text())) == 2
    refused = run_script("run_single_gpt.sh", script_env(
        tmp_path, GPUS_PER_NODE=1, USE_DPP=1, DATA_PATH="mock"))
    assert refused.returncode == 2 and "USE_DPP=1 needs PP >= 2" in refused.stderr


@pytest.mark.slow
@pytest.mark.skipif(not torch_cuda_available(), reason="the one-GPU path needs a CUDA GPU")
@pytest.mark.long
def test_single_gpt_script_trains_on_one_gpu(tmp_path):
    env = script_env(tmp_path, TRAIN_ITERS=3, LOG_INTERVAL=1, GPUS_PER_NODE=1,
                     MODEL_SIZE="tiny", CUDA_VISIBLE_DEVICES="0")
    result = run_script("run_single_gpt.sh", env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "processes on GPUs" in result.stderr and "tokens/s" in result.stdout
    assert len(logged_losses((tmp_path / "train.log").read_text())) == 3


def _namespace_problem() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    for tool, package in (("ip", "iproute2"), ("unshare", "util-linux")):
        if shutil.which(tool) is None:
            return f"needs `{tool}` ({package}; apt-get install -y {package})"
    return None


class VethPair:
    """Two network namespaces joined by a veth pair: two "nodes" on one machine."""

    def __init__(self, tag: str):
        self.names = [f"dppt{tag}a", f"dppt{tag}b"]
        subnet = 10 + int(tag) % 200
        self.ips = [f"10.254.{subnet}.1", f"10.254.{subnet}.2"]

    def __enter__(self):
        try:
            a, b = self.names
            for name in self.names:
                self._ip("netns", "add", name)
            self._ip("link", "add", a, "type", "veth", "peer", "name", b)
            for name, ip in zip(self.names, self.ips, strict=True):
                self._ip("link", "set", name, "netns", name)
                self._ip("-n", name, "addr", "add", f"{ip}/24", "dev", name)
                self._ip("-n", name, "link", "set", name, "up")
                self._ip("-n", name, "link", "set", "lo", "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc):
        # deleting a namespace also deletes the veth end inside it
        for name in self.names:
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)

    @staticmethod
    def _ip(*args):
        subprocess.run(["ip", *args], check=True, capture_output=True, text=True)

    def command(self, node: int, script: str) -> list[str]:
        # own hostnames, as on two machines, so the DPP transport sees a cross-host edge
        return ["ip", "netns", "exec", self.names[node], "unshare", "--uts", "sh", "-c",
                f"hostname dpp-node{node} && exec bash {REPO / script}"]


@pytest.mark.slow
@pytest.mark.skipif(_namespace_problem() is not None, reason=str(_namespace_problem()))
def test_two_node_master_worker_match_single_node(single_gpt_run, tmp_path):
    single, single_dir = single_gpt_run
    assert single.returncode == 0, single.stderr[-3000:]
    reference = logged_losses((single_dir / "train.log").read_text())
    with VethPair(str(os.getpid() % 10000)) as nodes:
        settings = dict(NODE_IPS=" ".join(nodes.ips), MASTER_PORT=launch.free_port(),
                        TRAIN_ITERS=TWO_NODE_ITERS, LOG_INTERVAL=1, RDZV_TIMEOUT=120)
        runs = []
        try:
            for node, script in enumerate(("run_master_gpt.sh", "run_worker_gpt.sh")):
                run_dir = tmp_path / f"node{node}"
                runs.append((run_dir, subprocess.Popen(
                    nodes.command(node, script), env=script_env(run_dir, **settings),
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                    start_new_session=True)))
            outputs = [process.communicate(timeout=RUN_TIMEOUT)[0] for _, process in runs]
        finally:
            for _, process in runs:
                if process.poll() is None:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
    master_out, worker_out = outputs
    assert runs[0][1].returncode == 0, master_out[-4000:]
    assert runs[1][1].returncode == 0, worker_out[-4000:]
    assert f"NODE_RANK=1 MASTER_PORT={settings['MASTER_PORT']}" in master_out
    command = (tmp_path / "node1" / "command.txt").read_text()
    assert f"--use-dpp --dpp-transport auto --multi-node --node-ips {' '.join(nodes.ips)}" \
        in command
    worker_log = (tmp_path / "node1" / "train.log").read_text()
    for edge in ("0->1:A", "1->0:G"):
        assert f"DPP transport torch for edge {edge} (across pods" in worker_log
    # the last pipeline stage, on the worker, logs the losses
    assert logged_losses(worker_log) == pytest.approx(reference, rel=1e-6)
    assert len(reference) == TWO_NODE_ITERS
