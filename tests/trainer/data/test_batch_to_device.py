"""data.batch_to_device: the batch's tensors on the device, other entries dropped; on a GPU
through pinned memory (an asynchronous copy that does not wait for the queued work)."""

from __future__ import annotations

import pytest
import torch

from megatron.trainer.data.data import batch_to_device


def _batch():
    return {"tokens": torch.arange(8).view(2, 4), "loss_mask": torch.ones(2, 4),
            "name": "not a tensor"}


def test_tensors_arrive_equal_and_the_rest_is_dropped():
    moved = batch_to_device(_batch(), "cpu")
    assert set(moved) == {"tokens", "loss_mask"}
    assert torch.equal(moved["tokens"], _batch()["tokens"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the pinned path needs a CUDA GPU")
def test_on_a_gpu_the_copy_does_not_wait_for_queued_work():
    """A long matmul queued first: the copy's call returns before it ends."""
    big = torch.randn(8192, 8192, device="cuda")
    torch.cuda.synchronize()
    busy = torch.cuda.Event()
    for _ in range(20):
        big = big @ big / 8192
    busy.record()
    moved = batch_to_device(_batch(), "cuda")
    assert not busy.query(), "the host waited for the queued matmuls"
    assert torch.equal(moved["tokens"].cpu(), _batch()["tokens"])
