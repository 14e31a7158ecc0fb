"""torch_dist checkpoints whose common state lies in the shard files, as megatron.core >= 0.19
writes them (no common.pt; one object under `common_state/shard_0_1`): the file check accepts
them, the common state reads back (argparse.Namespace included, as Megatron-LM stores its
flags), a crafted object there is refused by name without running, and a checkpoint with
neither form is named. megatron.core 0.16.1 (CI) still writes common.pt, so the layout is
written here with torch.distributed.checkpoint as megatron.core 0.19 writes it."""

from __future__ import annotations

import argparse
import io
import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from megatron.trainer.checkpoint.checkpoint_files import (
    CONFIG_FILE,
    EMBEDDED_COMMON_KEY,
    torch_dist_problem,
)
from megatron.trainer.checkpoint.checkpoint_trust import CommonStateRefused, load_common_state


class Payload:
    """Unpickled, it creates the directory `marker`."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


class BytesAsTheyAre(DefaultSavePlanner):
    """Stores a BytesIO's bytes without torch's extra torch.save around them, as
    megatron.core's save planner does."""

    def transform_object(self, write_item, object):
        return object


def _write(path, common, planner=None) -> str:
    """A torch_dist checkpoint of one tensor with `common` stored in its shard files (None:
    no common state at all), by megatron.core's planner unless another is given."""
    state = {"decoder.weight": torch.arange(6.0).reshape(2, 3)}
    if common is not None:
        packed = io.BytesIO()
        torch.save([common], packed)  # megatron.core's form: a list of the one object
        state[EMBEDDED_COMMON_KEY] = packed
    dcp.save(state, checkpoint_id=str(path), no_dist=True,
             planner=planner or BytesAsTheyAre(flatten_state_dict=False))
    (path / CONFIG_FILE).write_text(json.dumps({"sharded_backend": "torch_dist",
                                                "sharded_backend_version": 1}))
    return str(path)


@pytest.mark.parametrize("planner", [None, DefaultSavePlanner()],
                         ids=["megatron-core", "torch-default"])
def test_embedded_common_state_reads_back(tmp_path, planner):
    flags = argparse.Namespace(num_layers=2, hidden_size=64, lr=1e-4)
    common = {"args": flags, "iteration": 3, "checkpoint_version": 3.0,
              "num_floating_point_operations_so_far": 1.5e12}
    path = _write(tmp_path / "iter_0000003", common, planner)
    assert not os.path.exists(os.path.join(path, "common.pt"))
    assert torch_dist_problem(path) is None
    loaded = load_common_state(path)
    assert loaded["iteration"] == 3
    assert loaded["num_floating_point_operations_so_far"] == 1.5e12
    assert vars(loaded["args"]) == vars(flags)


def test_a_crafted_embedded_common_state_is_refused_without_running(tmp_path):
    marker = tmp_path / "payload_ran"
    path = _write(tmp_path / "iter_0000001", {"args": Payload(marker), "iteration": 1})
    with pytest.raises(CommonStateRefused, match=r"holds posix\.mkdir|holds os\.mkdir"):
        load_common_state(path)
    assert not marker.exists()


def test_a_checkpoint_without_common_state_is_named(tmp_path):
    path = _write(tmp_path / "iter_0000001", None)
    problem = torch_dist_problem(path)
    assert problem is not None and "common.pt is missing" in problem
    assert "names no common state" in problem
