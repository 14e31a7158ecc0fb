"""profiling/corpus_steadiness.py: the simulator's time per real token per iteration on a
corpus. Documents of one length make every iteration the same (no deviation under any
schedule); documents of many lengths make the iterations differ, and a token budget varies
the number of microbatches."""

from __future__ import annotations

import numpy as np
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

from megatron.trainer.data.documents import DocumentDataConfig, build_document_datasets
from megatron.trainer.data.microbatches import BatchLayout
from profiling.corpus_steadiness import SCHEDULES, steadiness


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
    # 16 samples a batch in rows of 3 (3 x 40 <= 128): 6 microbatches
    assert steadiness(uniform, budget, 4, 64, 10, 2)["microbatches"] == (6, 6)

    varied = _dataset(tmp_path / "varied",
                      np.random.default_rng(0).integers(3, 66, size=200).tolist())
    row = steadiness(varied, rows, 4, 64, 10, 2)
    assert all(row[name] > 0 for name in SCHEDULES), row
    low, high = steadiness(varied, budget, 4, 64, 10, 2)["microbatches"]
    assert low < high
