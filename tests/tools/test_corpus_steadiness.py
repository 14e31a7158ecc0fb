"""profiling/corpus_steadiness.py: the simulator's time per real token per iteration on a
corpus. Documents of one length make every iteration the same (no deviation under any
schedule); documents of many lengths make the iterations differ, and a token budget varies
the number of microbatches."""

from __future__ import annotations

import numpy as np
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

from megatron.trainer.data.documents import DocumentDataConfig, build_document_datasets
from megatron.trainer.data.microbatches import BatchLayout
from profiling.corpus_steadiness import (
    SCHEDULES,
    fit_to_run,
    iteration_costs,
    per_real_token,
    steadiness,
)


def _dataset(folder, lengths):
    folder.mkdir()
    prefix = folder / "corpus"
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.int32)
    for length in lengths:
        builder.add_document(np.arange(length, dtype=np.int32) % 50, [length])
    builder.finalize(f"{prefix}.idx")
    train, _, _ = build_document_datasets(
        DocumentDataConfig([str(prefix)], None, "100,0,0", seq_length=64, seed=1),
        (10 * 16, 0, 0))
    return train


def test_one_length_is_steady_and_many_lengths_are_not(tmp_path):
    rows = BatchLayout(2, 16, group_by_length=True, pad_to_multiple=8)
    budget = BatchLayout(2, 16, group_by_length=True, pad_to_multiple=8, microbatch_tokens=128)
    uniform = _dataset(tmp_path / "uniform", [41] * 200)  # samples of 40 tokens
    for layout in (rows, budget):
        row = steadiness(uniform, layout, pp_size=4, hidden_size=64, iterations=10, warmup=2)
        assert all(row[name] == 0 for name in SCHEDULES), row
        # the split backward's W fills 1F1B's drain; ZB-H1 defers W further, at more memory
        speedup = row["dpp_speedup"]
        assert speedup["dpp"] == 1 and speedup["1f1b ordered"] > 1.01, speedup
        assert speedup["zb-h1 ordered"] <= 1, speedup
        headroom = row["headroom"]
        assert headroom["1f1b ordered"] == pytest.approx(
            speedup["1f1b ordered"] * headroom["dpp"]), headroom
        if layout is rows:  # 8 equal microbatches: ZB-H1 reaches the lower bound
            assert headroom["zb-h1 ordered"] == pytest.approx(1), headroom
        assert min(headroom.values()) >= 1, headroom
    # 16 samples a batch in rows of 3 (3 x 40 <= 128): 6 microbatches
    assert steadiness(uniform, budget, 4, 64, 10, 2)["microbatches"] == (6, 6)

    varied = _dataset(tmp_path / "varied",
                      np.random.default_rng(0).integers(3, 66, size=200).tolist())
    row = steadiness(varied, rows, 4, 64, 10, 2)
    assert all(row[name] > 0 for name in SCHEDULES), row
    assert all(value >= 1 for value in row["headroom"].values()), row
    low, high = steadiness(varied, budget, 4, 64, 10, 2)["microbatches"]
    assert low < high


def test_a_runs_times_fit_the_plans_makespan_microbatches_and_a_fixed_cost(tmp_path):
    """A log whose iteration k took 2 ms per unit of DPP's simulated makespan of the batch at
    (k - 1) x 16 samples, 3 ms per microbatch and 10 ms fixed: the fit recovers the three
    costs exactly, and its deviation per real token is the log's. With the times of the next
    iteration's batch the fit is worse: it reads each iteration's own plan."""
    varied = _dataset(tmp_path / "varied",
                      np.random.default_rng(0).integers(3, 66, size=200).tolist())
    budget = BatchLayout(2, 16, group_by_length=True, pad_to_multiple=8, microbatch_tokens=128)

    def ms(index):
        costs, real = iteration_costs(varied, budget, index, 64)
        return 2 * per_real_token(costs, real, 4)["dpp"] * real + 3 * len(costs) + 10

    def log(times):
        return [f" iteration {k:8d}/{len(times):8d} | elapsed time per iteration (ms): {t:.6f} |"
                for k, t in enumerate(times, start=1)]

    fit = fit_to_run(varied, budget, 4, 64, log([ms(k) for k in range(9)]), warmup=2)
    assert fit["iterations"] == (3, 9)
    assert (fit["per_makespan"], fit["per_microbatch_ms"], fit["fixed_ms"]) == pytest.approx(
        (2, 3, 10), abs=1e-4)
    assert fit["r2"] == pytest.approx(1) and fit["measured"] == pytest.approx(fit["fitted"])
    assert fit["measured"] > 0
    shifted = fit_to_run(varied, budget, 4, 64, log([ms(k + 1) for k in range(9)]), warmup=2)
    assert shifted["r2"] < 0.99
    with pytest.raises(SystemExit, match="too few"):
        fit_to_run(varied, budget, 4, 64, log([ms(k) for k in range(4)]), warmup=2)


def test_drawn_lengths_instead_of_a_corpus(capsys):
    """--seq-length-cv plans from the trainer's drawn lengths: the budget row's microbatch
    counts are those of plan_global_batch over the same draws, and the draws vary the
    iterations."""
    from megatron.trainer.data.data import DrawnLengthSamples
    from megatron.trainer.data.microbatches import plan_global_batch
    from profiling.corpus_steadiness import main

    main(["--seq-length-cv", "0.5", "--seq-length", "256", "--hidden-size", "64",
          "--pad-to-multiple", "16", "--global-batch-size", "16", "--microbatch-tokens", "512",
          "--iterations", "10", "--warmup", "2", "--seed", "7"])
    out = capsys.readouterr().out.splitlines()
    budget_row = next(line for line in out if line.startswith("token budget"))
    # and DPP's speed over each schedule on the same plans, DPP's own 1.000x
    speeds = next(line for line in out[out.index(budget_row) + 1:]
                  if line.startswith("token budget"))
    assert speeds.split()[-1] == "1.000x" and len(speeds.split()) == 10
    # and the most any schedule could gain over each: at least 1x
    headroom = next(line for line in out[out.index(speeds) + 1:]
                    if line.startswith("token budget")).split()[6:]
    assert all(float(value.rstrip("x")) >= 1 for value in headroom), headroom
    layout = BatchLayout(2, 16, group_by_length=True, pad_to_multiple=16, microbatch_tokens=512)
    drawn = DrawnLengthSamples(None, 256, 0.5, seed=7)
    counts = [len(plan_global_batch(drawn, k * 16, layout).samples[0]) for k in range(10)]
    assert budget_row.split()[:5] == ["token", "budget", "512,", "grouped", "by"]
    assert budget_row.split()[6] == f"{min(counts)}-{max(counts)}"
    assert min(counts) < max(counts)
    assert all(float(value.rstrip("%")) > 0 for value in budget_row.split()[7:])
