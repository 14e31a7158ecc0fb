"""Throughput arithmetic, the iteration log line Megatron users read, the scalars for
TensorBoard and W&B (named as Megatron-LM names them), the parameters' norm and memory."""

from __future__ import annotations

import importlib.util
import logging
import os
import resource
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

from megatron.trainer.config.arguments import ArgumentError
from megatron.trainer.config.configs import LoggingConfig

log = logging.getLogger("megatron.trainer")

# dense bf16/fp16 peak of the GPUs we measure on, for MFU
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}


def flops_per_token(configs, seq_length: int | None = None) -> float:
    """Model FLOPs of one training token: forward + backward = 3 forwards (4 with full
    recomputation). Megatron's dense-GPT count, generalised to GQA and SwiGLU; with h hidden,
    L layers, s sequence, V vocabulary, F ffn width, k = kv channels x query groups:
      forward = L * (2h(h + 2k) + 2h^2 + 2hF * (3 if swiglu else 2) + 4sh) + 2hV,
    which for F = 4h, k = h gives Megatron's 72*L*h^2*(1 + s/6h + V/12hL) per token."""
    model = configs.model
    h, layers, vocab = model.hidden_size, model.num_layers, model.padded_vocab_size
    s = seq_length or model.seq_length
    kv = model.kv_channels * model.num_query_groups
    ffn_matrices = 3 if model.swiglu else 2
    per_layer = 2 * h * (h + 2 * kv) + 2 * h * h + 2 * h * model.ffn_hidden_size * ffn_matrices
    per_layer += 4 * s * h
    forward = layers * per_layer + 2 * h * vocab
    passes = 4 if configs.layers.recompute_granularity == "full" else 3
    return float(passes * forward)


def peak_tflops(device_name: str) -> float | None:
    for key, value in PEAK_TFLOPS.items():
        if key in device_name:
            return value
    return None


@dataclass
class IterationStats:
    iteration: int
    train_iters: int
    consumed_samples: int
    elapsed_ms: float
    lr: float
    global_batch_size: int
    losses: dict[str, float]
    loss_scale: float
    grad_norm: float | None
    skipped: int
    nan: int
    tokens: int
    world_size: int
    flops: float
    peak_tflops: float | None
    num_zeros: int | None = None  # --log-num-zeros-in-grad
    params_norm: float | None = None  # --log-params-norm
    real_tokens: int | None = None  # tokens without padding (variable lengths)

    def line(self, with_throughput: bool) -> str:
        parts = [
            f" iteration {self.iteration:8d}/{self.train_iters:8d}",
            f"consumed samples: {self.consumed_samples:12d}",
            f"elapsed time per iteration (ms): {self.elapsed_ms:.1f}",
            f"time left: {time_left(self.elapsed_ms, self.train_iters - self.iteration)}",
        ]
        seconds = self.elapsed_ms / 1000.0
        tflops = self.flops / seconds / self.world_size / 1e12 if seconds > 0 else 0.0
        # TFLOP/s per GPU and MFU only where there is a GPU peak to set them against
        if with_throughput and self.peak_tflops:
            parts.append(f"throughput per GPU (TFLOP/s/GPU): {tflops:.1f}")
            parts.append(f"MFU: {100.0 * tflops / self.peak_tflops:.1f}%")
        if with_throughput:
            parts.append(f"tokens/s: {self.tokens / seconds if seconds > 0 else 0.0:.0f}")
            if self.real_tokens is not None and self.real_tokens < self.tokens:
                # padded microbatches: what was learnt from, and the share of padding
                parts.append(f"real tokens per second: {self.real_tokens / seconds:.0f}"
                             if seconds > 0 else "real tokens per second: 0")
                parts.append(f"padding: {100.0 * (1 - self.real_tokens / self.tokens):.1f}%")
        parts.append(f"learning rate: {self.lr:.6E}")
        parts.append(f"global batch size: {self.global_batch_size:5d}")
        parts.extend(f"{name}: {value:.6E}" for name, value in self.losses.items())
        parts.append(f"loss scale: {self.loss_scale:.1f}")
        if self.grad_norm is not None:
            parts.append(f"grad norm: {self.grad_norm:.3f}")
        if self.num_zeros is not None:
            parts.append(f"num zeros: {self.num_zeros}")
        if self.params_norm is not None:
            parts.append(f"params norm: {self.params_norm:.3f}")
        parts.append(f"number of skipped iterations: {self.skipped:3d}")
        parts.append(f"number of nan iterations: {self.nan:3d}")
        return " | ".join(parts) + " |"


def time_left(ms_per_iteration: float, iterations: int) -> str:
    """H:MM:SS for `iterations` more at the recent interval's time per iteration."""
    seconds = round(max(0, iterations) * ms_per_iteration / 1000.0)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def require_wandb(config: LoggingConfig) -> None:
    """Start-up check (before the model is built): --wandb-project needs wandb importable."""
    if config.wandb is not None and importlib.util.find_spec("wandb") is None:
        raise ArgumentError(f"--wandb-project {config.wandb.project}: the wandb package is not "
                            "importable here (pip install wandb)")


class ScalarLog:
    """Scalars for TensorBoard (--tensorboard-dir) and W&B (--wandb-project); a no-op on
    the ranks that do not report or with neither configured."""

    def __init__(self, config: LoggingConfig, enabled: bool, run_config: dict | None = None):
        self.writer = self.wandb_run = None
        if not enabled:
            return
        if config.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=config.tensorboard_dir)
        if config.wandb is not None:
            import wandb  # importable: require_wandb checked at start-up

            os.makedirs(config.wandb.save_dir, exist_ok=True)
            self.wandb_run = wandb.init(project=config.wandb.project, name=config.wandb.exp_name,
                                        entity=config.wandb.entity, dir=config.wandb.save_dir,
                                        config=run_config)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if self.writer is not None:
            for name, value in values.items():
                self.writer.add_scalar(name, value, step)
        if self.wandb_run is not None:
            self.wandb_run.log(dict(values), step=step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()


def params_norm(model: list[torch.nn.Module], device: torch.device) -> float:
    """L2 norm of all the model's parameters, each counted once: a tensor-parallel
    duplicate (a norm, a row-parallel bias) on tensor rank 0 only, the output layer's copy
    of a tied embedding not at all. A collective of the model-parallel group."""
    total = torch.zeros((), dtype=torch.float32, device=device)
    for chunk in model:
        for param in chunk.parameters():
            if getattr(param, "shared", False) or not param_is_not_tensor_parallel_duplicate(param):
                continue
            total += param.detach().float().square().sum()
    dist.all_reduce(total, group=parallel_state.get_model_parallel_group())
    return total.sqrt().item()


def memory_scalars(device: torch.device) -> dict[str, float]:
    """This rank's memory: the CUDA allocator's figures on GPU (Megatron-LM's names), the
    process's peak resident set on CPU."""
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        return {"mem-reserved-bytes": stats["reserved_bytes.all.current"],
                "mem-allocated-bytes": stats["allocated_bytes.all.current"],
                "mem-max-allocated-bytes": stats["allocated_bytes.all.peak"],
                "mem-allocated-count": stats["allocation.all.current"]}
    # ru_maxrss is in KiB on Linux
    return {"mem-max-rss-bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
