"""--profile: the window of iterations, the files it writes, the kernel categories."""

from __future__ import annotations

import json

import pytest
import torch

from megatron.trainer.config.arguments import ArgumentError, parse_args
from megatron.trainer.config.configs import ProfilingConfig
from megatron.trainer.run.profiler import StepProfiler, breakdown, category_of
from tests.pipeline_runs import TINY_GPT


@pytest.mark.parametrize("kernel, category", [
    ("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNN", "matmul"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64", "matmul"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128>>", "attention"),
    ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "communication"),
    ("Memcpy DtoD (Device -> Device)", "copy / memset"),
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16>",
     "normalization"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>",
     "elementwise / fused"),
    ("triton_poi_fused_add_mul_0", "elementwise / fused"),
    ("void at::native::(anonymous namespace)::fused_adamw_kernel", "optimizer"),
    ("some_unknown_kernel", "other"),
])
def test_kernel_categories(kernel, category):
    assert category_of(kernel) == category


def test_breakdown_per_iteration():
    summary = breakdown({"nvjet_gemm": 3000.0, "ncclDevKernel_SendRecv": 1000.0,
                         "triton_poi_fused_add": 500.0}, iterations=2, wall_ms=5.0)
    assert summary["wall_ms_per_iteration"] == 2.5
    assert summary["device_busy_ms_per_iteration"] == pytest.approx(2.25)
    assert summary["compute_ms_per_iteration"] == pytest.approx(1.75)
    assert summary["categories"]["matmul"] == {"ms": 1.5, "share_of_wall": 0.6}
    assert list(summary["categories"]) == ["matmul", "communication", "elementwise / fused"]


def _config(tmp_path) -> ProfilingConfig:
    return ProfilingConfig(trace=False, trace_dir=None, trace_iters=None,
                           profile=True, use_pytorch_profiler=True, profile_step_start=2,
                           profile_step_end=4, profile_ranks=(0,), profile_dir=str(tmp_path),
                           record_memory_history=False, memory_snapshot_path="snapshot.pickle")


def test_window_writes_files_on_listed_ranks_only(tmp_path):
    # the profiler records the GPU's kernels where there is one, the CPU's operators elsewhere
    gpu = torch.cuda.is_available()
    weights = torch.randn(64, 64, device="cuda" if gpu else "cpu")
    for rank in (0, 1):
        profiler = StepProfiler(_config(tmp_path), rank)
        for iteration in range(1, 6):
            profiler.step_begin(iteration)
            (weights @ weights).sum()
            profiler.step_end(iteration)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "breakdown-rank0.json", "kernels-rank0.txt", "profile-rank0.json"]
    summary = json.loads((tmp_path / "breakdown-rank0.json").read_text())
    assert summary["iterations"] == 2 and summary["wall_ms_per_iteration"] > 0
    kernels = (tmp_path / "kernels-rank0.txt").read_text()
    if gpu:
        assert "gemm" in kernels.lower()
    else:
        assert "aten::matmul" in kernels


def test_window_must_be_ordered():
    with pytest.raises(ArgumentError, match="--profile-step-start 5 and --profile-step-end 5"):
        parse_args([*TINY_GPT, "--global-batch-size", "4", "--profile",
                    "--profile-step-start", "5", "--profile-step-end", "5"], world_size=1)
