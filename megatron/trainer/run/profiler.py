"""`--profile`: Megatron-LM's profiling flags over a window of iterations.

With `--use-pytorch-profiler` the listed ranks run torch.profiler over iterations
[--profile-step-start, --profile-step-end) and write, into --profile-dir:
`profile-rank<R>.json` (Chrome trace, opens in Perfetto), `kernels-rank<R>.txt` (the
operators and kernels by GPU time) and `breakdown-rank<R>.json` (GPU time per
category and per profiled iteration: matmul, attention, elementwise, ...; see CATEGORIES).
Without it, the window is marked with cudaProfilerStart/Stop for
`nsys profile --capture-range=cudaProfilerApi`.
"""

from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path

import torch

from megatron.trainer.config.configs import ProfilingConfig

log = logging.getLogger(__name__)

# first match wins: attention kernels also carry "sm90"-style names, so they come first
CATEGORIES = (
    ("attention", re.compile(r"flash|fmha|attention|_efficient_", re.I)),
    ("matmul", re.compile(r"gemm|cutlass|nvjet|xmma|cublas|s\d+_\w*_tn|sm\d\d_xmma", re.I)),
    ("communication", re.compile(r"nccl", re.I)),
    ("copy / memset", re.compile(r"memcpy|memset", re.I)),
    ("normalization", re.compile(r"norm", re.I)),
    ("softmax / cross-entropy", re.compile(r"softmax|cross_entropy|nll_loss|logsumexp", re.I)),
    ("optimizer", re.compile(r"adam|multi_tensor|foreach", re.I)),
    ("reduction", re.compile(r"reduce", re.I)),
    ("elementwise / fused", re.compile(r"elementwise|vectorized|unrolled|triton|index|cat", re.I)),
)


def category_of(kernel_name: str) -> str:
    for name, pattern in CATEGORIES:
        if pattern.search(kernel_name):
            return name
    return "other"


def breakdown(kernel_times_us: dict[str, float], iterations: int, wall_ms: float) -> dict:
    """GPU time per category in ms per iteration, and its share of the wall time."""
    per_category: dict[str, float] = {}
    for name, micros in kernel_times_us.items():
        key = category_of(name)
        per_category[key] = per_category.get(key, 0.0) + micros / 1000.0 / iterations
    busy = sum(per_category.values())
    wall = wall_ms / iterations
    return {
        "iterations": iterations,
        "wall_ms_per_iteration": wall,
        "device_busy_ms_per_iteration": busy,
        # NCCL kernels spin while they wait for the peer: their time is mostly idle
        "compute_ms_per_iteration": busy - per_category.get("communication", 0.0),
        "categories": {
            key: {"ms": ms, "share_of_wall": ms / wall if wall > 0 else 0.0}
            for key, ms in sorted(per_category.items(), key=lambda item: -item[1])
        },
    }


class StepProfiler:
    """Starts and stops the profiler around the configured iterations on this rank."""

    def __init__(self, config: ProfilingConfig, rank: int, tensorboard_dir: str | None = None):
        self.start_step = config.profile_step_start
        self.end_step = config.profile_step_end
        self.enabled = config.profile and rank in config.profile_ranks
        self.pytorch = config.use_pytorch_profiler
        self.rank = rank
        self.directory = Path(config.profile_dir or tensorboard_dir or "profile")
        self._profile = None
        self._window_start = None

    def step_begin(self, iteration: int) -> None:
        """Called before `iteration` (counted from 1) runs."""
        if not self.enabled or iteration != self.start_step:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if self.pytorch:
            # on GPU only the kernels: recording every host-side op slows a
            # launch-bound step by half again
            activities = [torch.profiler.ProfilerActivity.CUDA if torch.cuda.is_available()
                          else torch.profiler.ProfilerActivity.CPU]
            self._profile = torch.profiler.profile(activities=activities)
            self._profile.__enter__()
        elif torch.cuda.is_available():
            torch.cuda.profiler.start()
        self._window_start = _now_ms()

    def step_end(self, iteration: int) -> None:
        """Called after `iteration` ran; the window closes before --profile-step-end."""
        if not self.enabled or self._window_start is None or iteration != self.end_step - 1:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall_ms = _now_ms() - self._window_start
        self._window_start = None
        if not self.pytorch:
            if torch.cuda.is_available():
                torch.cuda.profiler.stop()
            return
        self._profile.__exit__(None, None, None)
        self._write(self._profile, wall_ms, self.end_step - self.start_step)
        self._profile = None

    def _write(self, profile, wall_ms: float, iterations: int) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        profile.export_chrome_trace(str(self.directory / f"profile-rank{self.rank}.json"))
        averages = profile.key_averages()
        sort_key = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        table = averages.table(sort_by=sort_key, row_limit=80, max_name_column_width=100)
        (self.directory / f"kernels-rank{self.rank}.txt").write_text(table + "\n")
        totals: dict[str, float] = {}
        for event in profile.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                totals[event.name] = totals.get(event.name, 0.0) + event.device_time_total
        summary = breakdown(totals, iterations, wall_ms)
        path = self.directory / f"breakdown-rank{self.rank}.json"
        path.write_text(json.dumps(summary, indent=1) + "\n")
        log.info("profile of iterations %d-%d written to %s (device computes %.1f of %.1f ms "
                 "per iteration)", self.start_step, self.end_step - 1, self.directory,
                 summary["compute_ms_per_iteration"], summary["wall_ms_per_iteration"])


def _now_ms() -> float:
    return time.perf_counter() * 1000.0
