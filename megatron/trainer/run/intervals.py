"""The log interval: what the loop adds up between two log lines (`IntervalCounters`), and
what it reports at each: the iteration line, memory, timers and the TensorBoard / W&B
scalars, and the validation line after an evaluation."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron.dpp import tracing
from megatron.trainer.config.configs import LoggingConfig
from megatron.trainer.run import metrics
from megatron.trainer.run.trainer import Trainer

log = logging.getLogger("megatron.trainer")


@dataclass
class IntervalCounters:
    """The iterations, tokens and FLOPs since the last log line, and when it was written."""

    start: float = field(default_factory=time.perf_counter)
    iterations: int = 0
    tokens: int = 0  # padded: each microbatch's length x rows
    real_tokens: int = 0
    flops: float = 0.0

    def add_microbatch(self, tokens: int, real_tokens: int, flops: float) -> None:
        self.tokens += tokens
        self.real_tokens += real_tokens
        self.flops += flops


def report_interval(trainer: Trainer, interval: IntervalCounters, result: dict,
                    nan_iterations: int, board: metrics.ScalarLog,
                    peak: float | None) -> None:
    """At a log interval's end, on every rank (the memory and parameter-norm gathers are
    collectives); the reporting rank writes the line and the scalars."""
    config, state = trainer.configs.logging, trainer.state
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    iterations = interval.iterations
    elapsed = (time.perf_counter() - interval.start) / iterations
    # per-rank memory: one tiny all-gather per log interval, only when asked for
    peaks = tracing.gather_peak_memory(trainer.device) if config.log_throughput else None
    # collectives of the model-parallel group: every rank takes part
    norm = metrics.params_norm(trainer.model, trainer.device) if config.log_params_norm else None
    timed = {name: 1000.0 * seconds / iterations
             for name, seconds in trainer.timers.take().items()}
    if not trainer.reporting:
        return
    stats = metrics.IterationStats(
        iteration=state.iteration, train_iters=trainer.configs.schedule.train_iters,
        consumed_samples=state.consumed_samples, elapsed_ms=elapsed * 1000.0,
        lr=trainer.scheduler.get_lr(trainer.optimizer.param_groups[0]),
        global_batch_size=result["batch"], losses=result["losses"],
        loss_scale=float(trainer.optimizer.get_loss_scale().item()),
        grad_norm=result["grad_norm"], skipped=state.skipped_iterations,
        nan=nan_iterations, tokens=interval.tokens // iterations,
        world_size=dist.get_world_size(),
        real_tokens=interval.real_tokens // iterations,
        flops=interval.flops / iterations, peak_tflops=peak,
        num_zeros=None if result["num_zeros"] is None else int(result["num_zeros"]),
        params_norm=norm,
    )
    log.info(stats.line(config.log_throughput))
    if peaks is not None:
        log.info(tracing.memory_line(peaks, trainer.device))
    if timed:
        log.info("timers (ms per iteration) | %s |", " | ".join(
            f"{name}: {ms:.2f}" for name, ms in timed.items()))
    board.scalars(state.iteration, interval_scalars(config, stats, timed, trainer.device))


def report_validation(trainer: Trainer, results: dict[str, float],
                      board: metrics.ScalarLog) -> None:
    if trainer.reporting and results:
        log.info("validation at iteration %d | %s", trainer.state.iteration,
                 " | ".join(f"{k} value: {v:.6E} | {k} PPL: {math.exp(min(v, 20)):.6E}"
                            for k, v in results.items()))
        board.scalars(trainer.state.iteration,
                      validation_scalars(trainer.configs.logging, results))


def interval_scalars(config: LoggingConfig, stats: metrics.IterationStats,
                     timed: dict[str, float], device: torch.device) -> dict[str, float]:
    """A log interval's scalars for TensorBoard / W&B, with Megatron-LM's names for the
    ones its --log-* flags add."""
    values = {**{f"train/{k}": v for k, v in stats.losses.items()}, "train/lr": stats.lr,
              "train/ms_per_iter": stats.elapsed_ms}
    if config.log_timers_to_tensorboard:
        values["iteration-time"] = stats.elapsed_ms
        values.update({f"{name}-time": ms for name, ms in timed.items()})
    if config.log_memory_to_tensorboard:
        values.update(metrics.memory_scalars(device))
    if stats.num_zeros is not None:
        values["num-zeros"] = stats.num_zeros
    if stats.params_norm is not None:
        values["params-norm"] = stats.params_norm
    return values


def validation_scalars(config: LoggingConfig, results: dict[str, float]) -> dict[str, float]:
    values = {f"valid/{k}": v for k, v in results.items()}
    if config.log_validation_ppl_to_tensorboard:
        # as the log line: exp of the loss, capped at exp(20)
        values.update({f"valid/{k} ppl": math.exp(min(v, 20.0)) for k, v in results.items()})
    return values
