"""Inputs a job finds unusable stop it in one line naming the cause, without a traceback:
an empty --vocab-file, and data whose token ids are beyond the model's vocabulary (GPT-2
data with --vocab-size 128), stopped before the embedding would fail on them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.job import TINY_GPT, Job
from tests.trainer_runs import with_flags


def _one_error(job: Job, rank: int) -> str:
    log = job.log(rank)
    assert "Traceback" not in log, log[-3000:]
    errors = job.lines(rank, " ERROR ")
    assert len(errors) == 1, log[-3000:]
    return errors[0]


@pytest.mark.slow
def test_an_empty_vocab_file_is_one_line(tmp_path):
    vocab, merges = tmp_path / "vocab.json", tmp_path / "merges.txt"
    vocab.write_text("")
    merges.write_text("")
    flags = with_flags(TINY_GPT, tokenizer_type="GPT2BPETokenizer", vocab_size=None,
                       vocab_file=vocab, merge_file=merges, train_iters=1)
    with Job("pretrain_gpt.py", flags, 1, tmp_path / "job") as job:
        status = job.wait(0, 60)
    assert status == 1, job.log(0)[-3000:]
    error = _one_error(job, 0)
    assert f"tokenizer: vocab file {vocab}: not a JSON vocabulary" in error, error


@pytest.mark.slow
def test_token_ids_beyond_the_vocabulary_are_one_line(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path / "gpt2_ids")
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.int32)
    rng = np.random.default_rng(0)
    for _ in range(20):  # GPT-2's ids: up to 50256
        builder.add_document(torch.from_numpy(rng.integers(0, 50257, 64, dtype=np.int32)), [64])
    builder.finalize(f"{prefix}.idx")
    flags = with_flags(TINY_GPT, mock_data=None, data_path=prefix, split="100,0,0",
                       train_iters=2)
    with Job("pretrain_gpt.py", flags, 1, tmp_path / "job") as job:
        status = job.wait(0, 60)
    assert status == 1, job.log(0)[-3000:]
    error = _one_error(job, 0)
    assert "bad training data: the micro-batch at sample 0 holds token id " in error, error
    assert "beyond the model's vocabulary of 128" in error, error
    assert not job.lines(0, " iteration "), "trained on the bad ids"
