"""The trainer runs on the shipped sample datasets, tokenized by tools/preprocess_data.py,
with the shipped vocabularies (GPT-2 byte-level BPE; BERT WordPiece)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests import REPO as ROOT
from tests.distributed import run_ranks
from tests.trainer_runs import train_run

SMALL = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "2",
    "--lr", "1e-3", "--eval-iters", "0", "--log-interval", "1",
    "--pipeline-model-parallel-size", "2", "--use-dpp", "--split", "98,1,1",
]

DATASETS = {
    "gpt": (
        ["--input", "datasets_gpt/dataset.json", "--tokenizer-type", "GPT2BPETokenizer",
         "--vocab-file", "datasets_gpt/vocab.json", "--merge-file", "datasets_gpt/merges.txt",
         "--append-eod"],
        "text_document",
        ["--seq-length", "64", "--max-position-embeddings", "64",
         "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "datasets_gpt/vocab.json",
         "--merge-file", "datasets_gpt/merges.txt"],
    ),
    "bert": (
        ["--input", "datasets_bert/dataset.json", "--tokenizer-type", "BertWordPieceLowerCase",
         "--vocab-file", "datasets_bert/vocab.txt", "--split-sentences"],
        "text_sentence",
        ["--seq-length", "64", "--max-position-embeddings", "64",
         "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", "datasets_bert/vocab.txt"],
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("model", list(DATASETS))
def test_trains_two_iterations_on_the_sample_data(model, tmp_path):
    preprocess, suffix, train_flags = DATASETS[model]
    prefix = tmp_path / model
    subprocess.run(
        [sys.executable, "tools/preprocess_data.py", *preprocess,
         "--output-prefix", str(prefix), "--workers", "1"],
        cwd=ROOT, check=True, capture_output=True,
    )
    data_path = f"{prefix}_{suffix}"
    flags = SMALL + train_flags + ["--data-path", data_path,
                                   "--data-cache-path", str(tmp_path / "cache")]
    flags = [str(ROOT / f) if f.startswith("datasets_") else f for f in flags]
    results = run_ranks(2, train_run, flags, 2, model)
    losses = [loss for result in results for loss in result["losses"] if loss]
    assert len(losses) == 2, f"expected 2 logged iterations, got {losses}"
    assert all(0 < value < 20 for loss in losses for value in loss.values())
