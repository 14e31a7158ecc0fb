"""`--ckpt-format torch`: Megatron-LM's legacy checkpoint layout, written and read.

`iter_N/mp_rank_TT/model_optim_rng.pt` (`mp_rank_TT_PPP` with pipeline stages), one file per
model-parallel rank written by its data-parallel rank 0: model chunks (`model`, or `model0`,
`model1`, ... with virtual stages), optimizer, lr scheduler, every data-parallel rank's RNG
state (`rng_state`, indexed by data-parallel rank) and the iteration. With the distributed
optimizer its state is gathered to data-parallel rank 0 into `distrib_optim.pt` beside it.
The layout cannot change the tensor or pipeline split on load (torch_dist can).
"""

from __future__ import annotations

import os
import traceback

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from torch.distributed.checkpoint.api import CheckpointException

from megatron.trainer.checkpoint.checkpoint_trust import load_legacy_file

MODEL_FILE = "model_optim_rng.pt"
DISTRIBUTED_OPTIMIZER_FILE = "distrib_optim.pt"
CHECKPOINT_VERSION = 3.0


def is_torch_format(path: str) -> bool:
    return any(name.startswith("mp_rank_") for name in os.listdir(path))


def rank_directory(path: str) -> str:
    tp = parallel_state.get_tensor_model_parallel_rank()
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return os.path.join(path, f"mp_rank_{tp:02d}")
    pp = parallel_state.get_pipeline_model_parallel_rank()
    return os.path.join(path, f"mp_rank_{tp:02d}_{pp:03d}")


def save(path: str, chunks: dict, optimizer, scheduler, rng_state: dict, training_state: dict,
         distributed_optimizer: bool, run_args: dict | None = None) -> None:
    """Write this rank's part of the checkpoint under `path` (with the run's flags,
    `run_args`, under "args"). Every rank calls it; a write that fails on any rank raises a
    CheckpointException (one entry per failed rank) on all."""
    data_parallel = parallel_state.get_data_parallel_group()
    rng_states = [None] * dist.get_world_size(data_parallel)
    dist.all_gather_object(rng_states, rng_state, group=data_parallel)
    writes = parallel_state.get_data_parallel_rank() == 0
    directory = rank_directory(path)
    failure = None
    try:
        if writes:
            os.makedirs(directory)
            state = {"checkpoint_version": CHECKPOINT_VERSION,
                     "iteration": training_state["iteration"],
                     "training_state": training_state, "rng_state": rng_states, **chunks}
            if optimizer is not None:
                state["optimizer"] = optimizer.state_dict()
            if scheduler is not None:
                state["opt_param_scheduler"] = scheduler.state_dict()
            if run_args is not None:
                state["args"] = run_args
            _write(state, os.path.join(directory, MODEL_FILE))
    except Exception as error:  # reported on every rank below
        failure = error
    _raise_on_every_rank(failure)
    if optimizer is not None and distributed_optimizer:
        # a collective over the data-parallel ranks (gloo); rank 0 of each writes the file
        try:
            optimizer.save_parameter_state(os.path.join(directory, DISTRIBUTED_OPTIMIZER_FILE))
        except Exception as error:
            failure = error
        _raise_on_every_rank(failure)


def _write(state: dict, filename: str) -> None:
    with open(filename, "wb") as handle:
        torch.save(state, handle)
        handle.flush()
        os.fsync(handle.fileno())


def _raise_on_every_rank(failure: Exception | None) -> None:
    failures = [None] * dist.get_world_size()
    dist.all_gather_object(failures, failure)
    failed = {rank: (error, traceback.StackSummary()) for rank, error in enumerate(failures)
              if error is not None}
    if failed:
        raise CheckpointException("writing a torch-format checkpoint failed", failed)


def load(path: str, trusted: bool = False) -> dict:
    """This rank's file of the checkpoint at `path`; FileNotFoundError naming it when the
    checkpoint was saved with another tensor / pipeline split. Unless `trusted`, read with
    weights_only (checkpoint_trust.load_legacy_file)."""
    filename = os.path.join(rank_directory(path), MODEL_FILE)
    if not os.path.exists(filename):
        raise FileNotFoundError(
            f"{filename} is missing: a --ckpt-format torch checkpoint loads only at the tensor "
            "and pipeline sizes it was saved with (torch_dist reshards)")
    return load_legacy_file(filename, trusted)


def load_first_rank_file(path: str, trusted: bool = False) -> dict:
    """The file of tensor and pipeline rank 0, read before any process group exists (what
    --use-checkpoint-args needs from it is not a tensor: memory-mapped, nothing else is read)."""
    for name in ("mp_rank_00", "mp_rank_00_000"):
        filename = os.path.join(path, name, MODEL_FILE)
        if os.path.exists(filename):
            return load_legacy_file(filename, trusted, mmap=True)
    raise FileNotFoundError(f"{path} has neither mp_rank_00/{MODEL_FILE} nor "
                            f"mp_rank_00_000/{MODEL_FILE}")


def rng_state_of_this_rank(state: dict) -> dict:
    states = state["rng_state"]
    rank = parallel_state.get_data_parallel_rank()
    return states[rank] if rank < len(states) else states[0]


def load_distributed_optimizer(path: str, optimizer) -> None:
    optimizer.load_parameter_state(os.path.join(rank_directory(path), DISTRIBUTED_OPTIMIZER_FILE))
