"""The training loop on CPU gloo ranks: the loss falls for GPT and BERT with PP=2, every
pipeline layout starts from the same loss, VPP=2 runs with megatron-core's schedule and
with DPP, bf16 runs, and the iteration log line and TensorBoard carry what Megatron's do."""

from __future__ import annotations

import glob
import math
import re

import pytest

from megatron.trainer.launch import read_iterations
from megatron.trainer.run.metrics import IterationStats
from tests.distributed import run_ranks
from tests.trainer_runs import TINY, train_run, train_runs, with_flags

BATCH = 8
# eight iterations of Adam at a high constant lr on one repeated global batch
BASE = with_flags(TINY, global_batch_size=BATCH, train_iters=8, lr=1e-2,
                  lr_decay_style="constant")
PP2 = with_flags(BASE, pipeline_model_parallel_size=2)
MARGIN = 0.5


def _losses(results, name="lm loss"):
    return [step[name] for step in results[-1]["losses"]]


def _iteration_lines(results):
    return [m for _, m in results[-1]["logs"] if m.lstrip().startswith("iteration")]


@pytest.fixture(scope="module")
def gpt_pp2(tmp_path_factory):
    board = tmp_path_factory.mktemp("tensorboard")
    flags = with_flags(PP2, log_throughput=True, tensorboard_dir=str(board))
    return run_ranks(2, train_run, flags, 2, "gpt", BATCH), str(board)


@pytest.fixture(scope="module")
def pp1_first_loss():
    (result,) = run_ranks(1, train_run, with_flags(BASE, exit_interval=1), 1, "gpt", BATCH)
    return result["losses"][0]["lm loss"]


@pytest.mark.slow
def test_gpt_pp2_loss_falls(gpt_pp2):
    losses = _losses(gpt_pp2[0])
    assert len(losses) == 8 and all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0] - MARGIN, losses
    assert gpt_pp2[0][0]["losses"] == [{}] * 8, "the first stage holds no losses"


@pytest.mark.slow
def test_bert_pp2_loss_falls():
    results = run_ranks(2, train_run, PP2, 2, "bert", BATCH)
    losses = _losses(results)
    assert len(losses) == 8 and all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0] - MARGIN, losses
    assert all(math.isfinite(v) for v in _losses(results, "sop loss"))


@pytest.mark.slow
def test_pp1_and_pp2_same_first_loss(gpt_pp2, pp1_first_loss):
    assert _losses(gpt_pp2[0])[0] == pytest.approx(pp1_first_loss, abs=1e-6)


@pytest.mark.slow
def test_vpp2_with_core_schedule_and_dpp(pp1_first_loss):
    vpp = with_flags(PP2, virtual_pipeline_model_parallel_size=2, exit_interval=2)
    core = vpp  # as a user runs it: the trainer picks unbatched p2p itself
    dpp = vpp + ["--use-dpp", "--dpp-transport", "torch"]
    split = dpp + ["--dpp-split-backward"]  # the trainer hands DPP its WeightGradStore
    core_run, dpp_run, split_run = run_ranks(2, train_runs, [core, dpp, split], 2)[-1]
    assert sum("unbatched p2p" in m for _, m in core_run["logs"]) == 1
    assert not any("unbatched p2p" in m for _, m in dpp_run["logs"])
    core_losses = [step["lm loss"] for step in core_run["losses"]]
    assert len(core_losses) == 2 and core_run["state"]["iteration"] == 2
    assert core_losses[0] == pytest.approx(pp1_first_loss, abs=1e-6)
    for run in (dpp_run, split_run):
        assert [step["lm loss"] for step in run["losses"]] == pytest.approx(core_losses,
                                                                             abs=1e-6)
    assert any("schedule DPP" in m for _, m in dpp_run["logs"])
    assert any("schedule DPP, each backward split into B and W" in m
               for _, m in split_run["logs"])
    # without --log-throughput the line has no throughput fields
    lines = [m for _, m in core_run["logs"] if m.lstrip().startswith("iteration")]
    assert len(lines) == 2 and all("tokens/s" not in line for line in lines)


def _field(line: str, name: str) -> float:
    found = re.search(re.escape(name) + r":\s*([-+0-9.eE%]+)", line)
    assert found, f"{name!r} missing from: {line}"
    return float(found.group(1).rstrip("%"))


@pytest.mark.slow
def test_log_throughput_line(gpt_pp2):
    results = gpt_pp2[0]
    lines = _iteration_lines(results)
    assert len(lines) == 8, "--log-interval 1 logs every iteration"
    losses = _losses(results)
    for number, line in enumerate(lines, start=1):
        assert re.match(rf"\s*iteration\s+{number}/\s+8 \|", line), line
        assert _field(line, "consumed samples") == number * BATCH
        assert _field(line, "elapsed time per iteration (ms)") > 0
        assert _field(line, "learning rate") == pytest.approx(1e-2)
        assert _field(line, "global batch size") == BATCH
        assert _field(line, "lm loss") == pytest.approx(losses[number - 1], rel=1e-6)
        assert _field(line, "loss scale") == 1.0
        assert _field(line, "grad norm") == pytest.approx(
            results[-1]["grad_norms"][number - 1], abs=1e-3)
        assert _field(line, "tokens/s") > 0
        # CPU ranks: no GPU peak, so no TFLOP/s or MFU column
        assert "TFLOP/s" not in line and "MFU" not in line
        assert re.search(r"\| time left: \d+:\d\d:\d\d \|", line), line
        assert _field(line, "number of skipped iterations") == 0


@pytest.mark.slow
def test_tensorboard_event_file(gpt_pp2):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    results, board = gpt_pp2
    files = glob.glob(f"{board}/events.out.tfevents.*")
    assert len(files) == 1, f"expected one event file (last rank only), found {files}"
    events = EventAccumulator(board)
    events.Reload()
    scalars = events.Scalars("train/lm loss")
    assert [s.step for s in scalars] == list(range(1, 9))
    assert [s.value for s in scalars] == pytest.approx(_losses(results), rel=1e-6)
    assert "train/lr" in events.Tags()["scalars"]


@pytest.mark.slow
def test_bf16_two_iterations(gpt_pp2):
    results = run_ranks(2, train_run, with_flags(PP2, bf16=True, train_iters=2), 2,
                        "gpt", BATCH)
    losses = _losses(results)
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses)
    assert results[-1]["state"]["skipped_iterations"] == 0
    # bf16 weights and activations, fp32 loss: close to the fp32 run, not identical
    fp32_first = _losses(gpt_pp2[0])[0]
    assert losses[0] == pytest.approx(fp32_first, abs=2e-2)
    assert losses[0] != fp32_first


@pytest.mark.slow
def test_dpp_with_distributed_optimizer_overlapped_reduce_and_rampup():
    """DP=2 x PP=2 with the distributed optimizer, overlapped gradient reduction (DPP
    starts each chunk's reduction after its last backward) and a batch ramping up from 8 to
    16 samples: DPP trains exactly as megatron-core's schedule does."""
    flags = with_flags(PP2, global_batch_size=16, rampup_batch_size=[8, 8, 16], train_iters=3,
                       use_distributed_optimizer=True, overlap_grad_reduce=True)
    core, dpp = run_ranks(4, train_runs, [flags, flags + ["--use-dpp", "--dpp-transport",
                                                           "torch"]], 4, "gpt", BATCH)[-1]
    assert core["batches"] == dpp["batches"] == [8, 8, 16]
    core_losses = [step["lm loss"] for step in core["losses"]]
    assert [step["lm loss"] for step in dpp["losses"]] == pytest.approx(core_losses, abs=1e-6)
    assert dpp["grad_norms"] == pytest.approx(core["grad_norms"], rel=1e-6)
    assert core_losses[-1] < core_losses[0]  # the optimizer steps reached the parameters
    assert any("schedule DPP" in m for _, m in dpp["logs"])


def iteration_line(iteration: int, elapsed_ms: float, peak_tflops: float | None) -> str:
    return IterationStats(
        iteration=iteration, train_iters=1000, consumed_samples=8 * iteration,
        elapsed_ms=elapsed_ms, lr=1e-3, global_batch_size=8, losses={"lm loss": 9.0},
        loss_scale=1.0, grad_norm=0.5, skipped=0, nan=0, tokens=4096, world_size=2,
        flops=4e12, peak_tflops=peak_tflops).line(with_throughput=True)


def test_the_iteration_line_tells_the_time_left_and_flops_only_against_a_peak():
    # 990 iterations left at 250 ms: 247.5 s; 1 left at 4000 ms
    cpu = iteration_line(10, 250.0, None)
    assert "| time left: 0:04:08 |" in cpu
    assert "TFLOP/s" not in cpu and "MFU" not in cpu and "| tokens/s: 16384 |" in cpu
    assert "| time left: 1:06:00 |" in iteration_line(10, 4000.0, None)
    # 4 TFLOP per iteration over 2 GPUs in 1 s: 2 TFLOP/s per GPU, 2/989 of an H100's peak
    gpu = iteration_line(999, 1000.0, 989.0)
    assert "| time left: 0:00:01 |" in gpu
    assert "| throughput per GPU (TFLOP/s/GPU): 2.0 | MFU: 0.2% |" in gpu
    assert read_iterations([cpu])[0]["tokens/s"] == 16384
