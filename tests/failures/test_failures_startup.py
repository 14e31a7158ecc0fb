"""Every known mistake that stops a run before training (a flag, the tokenizer's flags or
files, the data and its split) is one line naming it, with argparse's status 2 for flags and
1 otherwise, and no traceback. Run in this process: each stops before torch.distributed
starts, as every rank of a job would."""

from __future__ import annotations

import pytest
import torch

from megatron.trainer.run.training import pretrain
from megatron.trainer.tasks.gpt import GPT_TASK
from tests.failures.test_failures_data import make_dataset
from tests.job import TINY_GPT
from tests.trainer_runs import with_flags

PROGRAM = "pretrain_gpt.py"


def with_data(prefix: str, split: str = "90,5,5", **overrides) -> list[str]:
    return with_flags(TINY_GPT, mock_data=None, data_path=prefix, split=split, train_iters=2,
                      **overrides)


def cases(tmp_path):
    """(flags, exit status, the one line) of each mistake."""
    # 200 documents: the default --split 969,30,1 leaves the test split empty, 90,5,5 not
    documents = make_dataset(tmp_path / "documents", [[list(range(1, 21))]] * 200)
    missing = str(tmp_path / "missing")
    return {
        "unknown flag": (with_flags(TINY_GPT, train_iters=2, bogus=True), 2,
                         f"{PROGRAM}: unknown flags: --bogus"),
        "tokenizer flag": (with_data(documents, tokenizer_type="GPT2BPETokenizer", vocab_size=None),
                           2, f"{PROGRAM}: GPT2BPETokenizer needs --vocab-file"),
        "tokenizer file": (with_data(documents, tokenizer_type="GPT2BPETokenizer", vocab_size=None,
                                     vocab_file=missing + ".json", merge_file=missing + ".txt"),
                           1, f"tokenizer: vocab file {missing}.json: no such file"),
        "data path": (with_data(missing), 1, f"bad training data: --data-path {missing}: "
                      f"{missing}.bin and {missing}.idx not found"),
        "empty split": (with_data(documents, split="969,30,1"), 1, "bad training data: the "
                        f"test split of --data-path {documents} (--split 969,30,1) gets 0 "
                        "documents, 0 tokens: it is empty"),
        "split flag": (with_data(documents, split="90,x"), 2,
                       f"{PROGRAM}: --split '90,x': expected up to 3 numbers such as 969,30,1"),
        "backend": (with_flags(TINY_GPT, train_iters=2, distributed_backend="nccl"), 2,
                    f"{PROGRAM}: --distributed-backend nccl needs a GPU; use gloo on CPU"),
    }


CASE_NAMES = ["unknown flag", "tokenizer flag", "tokenizer file", "data path", "empty split",
              "split flag", "backend"]


@pytest.mark.parametrize("case", CASE_NAMES)
def test_each_mistake_before_training_is_one_line(tmp_path, monkeypatch, capsys, case):
    if case == "backend" and torch.cuda.is_available():
        pytest.skip("--distributed-backend nccl is valid with a GPU")
    monkeypatch.setattr("sys.argv", [PROGRAM])
    for name in ("RANK", "WORLD_SIZE", "MEGATRON_LOG_LEVEL"):
        monkeypatch.delenv(name, raising=False)
    flags, status, expected = cases(tmp_path)[case]
    with pytest.raises(SystemExit) as caught:
        pretrain(GPT_TASK, flags)
    assert caught.value.code == status
    captured = capsys.readouterr()
    lines = [line for line in (captured.out + captured.err).splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert expected in lines[0], lines[0]
    assert "Traceback" not in captured.out + captured.err
