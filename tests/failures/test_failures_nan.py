"""A run that diverges (--lr 1e6: NaN from the second iteration) stops by default after the
first non-finite iteration, in one line, without saving; with
--no-check-for-nan-in-loss-and-grad it trains on but no save publishes the non-finite
parameters. Either way the pointer keeps naming the last finite checkpoint, whose every
tensor is finite. PP=2 on two gloo ranks (the loss lives on the last stage only)."""

from __future__ import annotations

import io
import os

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megatron.trainer.checkpoint.checkpoint_publish import POINTER, CheckpointError
from tests.distributed import run_ranks
from tests.job import TINY_GPT, Job
from tests.trainer_runs import TINY, train_runs, with_flags

DIVERGING = dict(lr=1e6, global_batch_size=4, train_iters=4, save_interval=1,
                 pipeline_model_parallel_size=2)


def _tensors(path: str):
    """Every tensor of a torch_dist checkpoint, read from its shard files."""
    metadata = FileSystemReader(path).read_metadata()
    for index, info in metadata.storage_data.items():
        # pickled objects (the RNG states, numpy arrays in them) are not parameters
        if not isinstance(metadata.state_dict_metadata[index.fqn], TensorStorageMetadata):
            continue
        with open(os.path.join(path, info.relative_path), "rb") as handle:
            handle.seek(info.offset)
            data = handle.read(info.length)
        value = torch.load(io.BytesIO(data), weights_only=True)
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            yield value


def _only_the_first_checkpoint(root) -> None:
    assert sorted(os.listdir(root)) == ["iter_0000001", POINTER]
    assert (root / POINTER).read_text() == "1\n"
    tensors = list(_tensors(str(root / "iter_0000001")))
    assert tensors and all(torch.isfinite(t).all() for t in tensors)


@pytest.mark.slow
def test_a_diverging_run_stops_in_one_line_and_keeps_its_last_finite_checkpoint(tmp_path):
    root = tmp_path / "ckpt"
    flags = with_flags(TINY_GPT, save=root, **DIVERGING)
    with Job("pretrain_gpt.py", flags, 2, tmp_path / "job") as job:
        statuses = [job.wait(rank, 60) for rank in (0, 1)]
    assert statuses == [1, 1], job.log(0)[-3000:] + job.log(1)[-3000:]
    for rank in (0, 1):
        log = job.log(rank)
        assert "Traceback" not in log, log[-3000:]
        errors = job.lines(rank, " ERROR ")
        assert len(errors) == 1, log[-3000:]
        # the first stage sees the grad norm, the last one the loss too
        assert "iteration 2: non-finite " in errors[0] and "grad norm nan" in errors[0], errors
        assert "stopped without saving" in errors[0], errors
    assert "lm loss nan" in job.lines(1, " ERROR ")[0]
    _only_the_first_checkpoint(root)


@pytest.mark.slow
def test_without_the_check_no_non_finite_checkpoint_is_published(tmp_path):
    root = tmp_path / "ckpt"
    flags = with_flags(TINY, save=root, no_check_for_nan_in_loss_and_grad=True, **DIVERGING)
    results = run_ranks(2, train_runs, [flags], 2, "gpt", None, (CheckpointError,))
    for rank in results:
        message = rank[0]["stopped"][0]
        assert message.startswith(f"not saving {root / 'iter_0000002'}: "), message
        assert "parameter tensors hold NaN or Inf" in message, message
        assert f"{root / POINTER} still names iteration 1" in message, message
    _only_the_first_checkpoint(root)
