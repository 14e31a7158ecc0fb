"""Bad training data stops the job at start-up with one line per rank naming the
--data-path prefix and what is wrong (missing or extension-suffixed prefix, truncated .bin,
corrupted .idx, empty dataset), no traceback unless MEGATRON_LOG_LEVEL=DEBUG; and
preprocess_data refuses an input without documents."""

from __future__ import annotations

import json
import logging
import os
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megatron.trainer.data.data import DataError, check_data_paths, prefix_problem
from megatron.trainer.run import failures
from tests import REPO
from tests.job import TINY_GPT, Job

sys.path.insert(0, str(REPO))

from tools.preprocess_data import main as preprocess_main  # noqa: E402

HEADER_BYTES = 34  # magic, version, dtype code, sequence and document counts


def make_dataset(prefix, documents: list[list[list[int]]]) -> str:
    """A megatron.core dataset at `prefix`: documents of sequences of token ids."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.int32)
    for sequences in documents:
        tokens = torch.tensor([t for sequence in sequences for t in sequence], dtype=torch.int32)
        builder.add_document(tokens, [len(sequence) for sequence in sequences])
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


GOOD = [[[1, 2, 3], [4, 5]], [[6, 7, 8, 9]], [[10]]]


def _cut(path, keep_bytes: int) -> None:
    with open(path, "r+b") as handle:
        handle.truncate(keep_bytes)


def _overwrite(path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as handle:
        handle.seek(offset)
        handle.write(data)


# each case: how to damage a good dataset, and what the message must say
CASES = {
    "missing": (lambda p: (os.remove(p + ".bin"), os.remove(p + ".idx")),
                "{p}.bin and {p}.idx not found"),
    "missing .bin": (lambda p: os.remove(p + ".bin"), "{p}.bin not found"),
    "truncated .bin": (lambda p: _cut(p + ".bin", 20),
                       "{p}.bin has 20 bytes, but {p}.idx describes 40: the .bin is truncated"),
    "bin of another dataset": (lambda p: open(p + ".bin", "ab").write(b"\0" * 8),
                               "{p}.bin has 48 bytes, but {p}.idx describes 40: the .bin is "
                               "not the data of this index"),
    "bad magic": (lambda p: _overwrite(p + ".idx", 0, b"NOTANIDX"),
                  "{p}.idx is not a megatron.core index (bad magic or version)"),
    "truncated .idx": (lambda p: _cut(p + ".idx", os.path.getsize(p + ".idx") - 8),
                       "the index is truncated or corrupted"),
    "corrupted offsets": (lambda p: _overwrite(p + ".idx", HEADER_BYTES + 4 * 5 + 8,
                                               np.int64(999).tobytes()),
                          "{p}.idx has corrupted sequence offsets"),
    "corrupted document index": (lambda p: _overwrite(p + ".idx", HEADER_BYTES + 12 * 5 + 8,
                                                      np.int64(7).tobytes()),
                                 "{p}.idx has a corrupted document index"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_problem_is_named(tmp_path, case):
    prefix = make_dataset(tmp_path / "corpus", GOOD)
    assert prefix_problem(prefix) is None
    damage, expected = CASES[case]
    damage(prefix)
    problem = prefix_problem(prefix)
    assert problem is not None and expected.format(p=prefix) in problem, problem


def test_an_empty_dataset_is_refused(tmp_path):
    prefix = make_dataset(tmp_path / "empty", [])
    assert prefix_problem(prefix) == f"no documents in {prefix}.idx (an empty dataset)"


@pytest.mark.parametrize("extension", [".bin", ".idx"])
def test_a_prefix_with_its_extension_is_told_to_drop_it(tmp_path, extension):
    prefix = make_dataset(tmp_path / "corpus", GOOD)
    assert prefix_problem(prefix + extension) == (
        f"give the prefix without the {extension} extension: --data-path {prefix}")


def test_one_error_names_every_bad_prefix_of_a_blend(tmp_path):
    good = make_dataset(tmp_path / "good", GOOD)
    empty = make_dataset(tmp_path / "empty", [])
    args = SimpleNamespace(mock_data=False, data_path=["0.5", good, "0.5", empty + ".bin"],
                           data_blend=([good, empty + ".bin"], [0.5, 0.5]))
    with pytest.raises(DataError) as caught:
        check_data_paths(args)
    assert str(caught.value) == (
        f"--data-path {empty}.bin: give the prefix without the .bin extension: "
        f"--data-path {empty}")


@pytest.mark.slow
def test_bad_data_ends_every_rank_with_one_line_before_the_job_starts(tmp_path):
    prefix = make_dataset(tmp_path / "corpus", GOOD)
    _cut(prefix + ".bin", 20)
    flags = [f for f in TINY_GPT if f != "--mock-data"] + [
        "--data-path", prefix, "--train-iters", "2", "--pipeline-model-parallel-size", "2"]
    with Job("pretrain_gpt.py", flags, 2, tmp_path / "job") as job:
        statuses = [job.wait(rank, 120) for rank in (0, 1)]
    for rank in (0, 1):
        log = job.log(rank)
        assert statuses[rank] == 1, log[-3000:]
        (error,) = job.lines(rank, " ERROR ")
        assert error.endswith(
            f"megatron.trainer.run.failures: bad training data: --data-path {prefix}: "
            f"{prefix}.bin has 20 bytes, but {prefix}.idx describes 40: the .bin is truncated")
        assert "Traceback" not in log


def test_the_traceback_is_logged_at_debug(monkeypatch, caplog):
    monkeypatch.setenv("MEGATRON_LOG_LEVEL", "DEBUG")
    with caplog.at_level(logging.DEBUG, logger="megatron.trainer.run.failures"):
        with pytest.raises(SystemExit) as caught:
            with failures.exit_on_known_failures("pretrain_gpt.py"):
                raise DataError("--data-path corpus: corpus.bin not found")
    assert caught.value.code == failures.EXIT_FAILED
    debug, error = caplog.records[-2:]
    assert debug.levelno == logging.DEBUG and debug.exc_info[0] is DataError
    assert error.levelno == logging.ERROR
    assert error.getMessage() == "bad training data: --data-path corpus: corpus.bin not found"


def test_preprocess_data_refuses_an_input_without_documents(tmp_path, caplog):
    source = tmp_path / "in.json"
    source.write_text("\n" + json.dumps({"text": ""}) + "\n")
    flags = ["--input", str(source), "--output-prefix", str(tmp_path / "out"),
             "--tokenizer-type", "NullTokenizer", "--vocab-size", "128"]
    with caplog.at_level(logging.ERROR, logger="preprocess_data"):
        assert preprocess_main(flags) == 1
    assert f"--input {source}: no documents" in caplog.text
    assert sorted(os.listdir(tmp_path)) == ["in.json"], "nothing written, not even partially"
