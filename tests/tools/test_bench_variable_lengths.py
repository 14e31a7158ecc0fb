"""profiling/bench_gpt.py's variable-length figures, read from the trainer's own iteration
lines (metrics.IterationStats): real tokens/s, padding share, time per real token and its
largest deviation; and the data flags of the corpus configurations."""

from __future__ import annotations

import pytest

from megatron.trainer.run.metrics import IterationStats
from profiling import bench_gpt


def iteration_line(iteration: int, elapsed_ms: float, tokens: int, real: int) -> str:
    return IterationStats(
        iteration=iteration, train_iters=6, consumed_samples=32 * iteration,
        elapsed_ms=elapsed_ms, lr=1e-4, global_batch_size=32, losses={"lm loss": 5.0},
        loss_scale=1.0, grad_norm=1.0, skipped=0, nan=0, tokens=tokens, world_size=4,
        flops=1e12, peak_tflops=989.0, real_tokens=real).line(with_throughput=True)


def test_real_token_figures_from_the_iteration_lines():
    # iterations of 1 s; real tokens 40k, 30k, 30k, 50k, 40k of 64k after two warm-up ones
    reals = [10_000, 10_000, 40_000, 30_000, 30_000, 50_000, 40_000]
    text = "\n".join(iteration_line(i + 1, 1000.0, 65_536, real)
                     for i, real in enumerate(reals))
    rows = [m.groups() for m in bench_gpt.LINE.finditer(text)]
    assert [float(r[4]) for r in rows] == [65_536] * len(reals)  # tokens/s: padding included
    figures = bench_gpt.variable_length_figures(text, rows, warmup=2)
    assert figures["real_tokens_per_s"] == 40_000
    assert figures["us_per_real_token"] == pytest.approx(25.0)
    assert figures["max_deviation_percent"] == pytest.approx(100 * (1e6 / 30_000 - 25) / 25)
    assert figures["padding_percent"] == pytest.approx(100 * (1 - 40_000 / 65_536), abs=0.05)


def test_unpadded_runs_count_every_token_as_real():
    text = "\n".join(iteration_line(i + 1, 500.0, 8192, 8192) for i in range(4))
    assert "padding" not in text
    rows = [m.groups() for m in bench_gpt.LINE.finditer(text)]
    figures = bench_gpt.variable_length_figures(text, rows, warmup=1)
    assert figures["real_tokens_per_s"] == 16_384 and figures["padding_percent"] == 0
    assert figures["max_deviation_percent"] == 0


def test_corpus_configurations_read_the_corpus_not_mock_data():
    flags = bench_gpt.data_flags(bench_gpt.CONFIGS["docs-dpp"], "/data/corpus")
    command = [*bench_gpt.model_flags(flags), *flags]
    assert "--mock-data" not in command and "NullTokenizer" not in command
    assert command[command.index("--data-path") + 1] == "/data/corpus"
    assert "--variable-seq-lengths" in command and bench_gpt.CORPUS_MARK not in command
    synthetic = bench_gpt.CONFIGS["cv-dpp"]
    assert "--mock-data" in bench_gpt.model_flags(bench_gpt.data_flags(synthetic, None))
    with pytest.raises(SystemExit, match="give --corpus"):
        bench_gpt.data_flags(bench_gpt.CONFIGS["docs-packed"], None)


def test_peaks_reached_in_the_first_step_are_marked():
    """The trainer's memory reports are cumulative: rank 0's peak is already in the report
    after iteration 1 (the step that records the CUDA graphs), rank 1's grows later; the
    table marks rank 0's alone and says what the mark means."""
    import torch

    from megatron.dpp import tracing

    cuda = torch.device("cuda")  # the report's wording only; nothing is allocated
    reports = [[11598.5, 6742.3], [11598.5, 6753.0], [11598.5, 6754.0]]
    text = "\n".join(tracing.memory_line([int(mb * 2**20) for mb in report], cuda)
                     for report in reports)
    per_rank, first_step = bench_gpt.peak_memory(text)
    assert per_rank == [11598.5, 6754.0] and first_step == [True, False]
    assert bench_gpt.peak_memory("no report") == (None, None)
    row = {"name": "docs-dpp-tokens-graphs", "real_tokens_per_s": 1.0, "padding_percent": 0.0,
           "us_per_real_token": 1.0, "max_deviation_percent": 0.0,
           "peak_mb_per_rank": per_rank, "peak_in_first_step": first_step}
    lines = bench_gpt.variable_length_lines([row], {})
    assert lines[1].endswith("11598* 6754") and lines[2].startswith("* the rank's peak"), lines
