"""The common state and RNG layout of torch_dist checkpoints that Megatron-LM's own trainer
(`megatron.training`, megatron-core 0.19) reads and writes, so that a checkpoint of either
trainer resumes in the other at the same parallel layout.

The sharded part is the same on both sides: each model chunk's `sharded_state_dict()`
under `model` (or `model0`, `model1`, ...), the optimizer's under `optimizer`, each
trainer loading with the content metadata the checkpoint holds (Megatron-LM's adds
`singleton_local_shards` False and `chained_optim_avoid_prefix` True; ours has neither,
so several chained optimizers' keys carry prefixes in ours and not in Megatron-LM's, and
each request follows the checkpoint it reads). What differs, as
read in Megatron-LM's checkpointing.py (generate_state_dict, save_checkpoint,
load_checkpoint, check_checkpoint_args, get_rng_state):

* Megatron-LM's common state holds `args` (its flags, an argparse.Namespace, with the data
  position in `consumed_train_samples`), `checkpoint_version` 3.0, `iteration`,
  `num_floating_point_operations_so_far` and `opt_param_scheduler`. Ours holds the same
  (`common_entries`; the Namespace holds only plain values) and, for itself, the counters
  under `training_state` (our checkpoints before this had `args` as a dict and
  `checkpoint_version` 1; they still load).
* The RNG states are one ShardedObject `rng_state` of global shape (PP, TP) at each rank's
  (pipeline, tensor) coordinates, written by data-parallel rank 0 and holding the list of
  every data-parallel rank's states (Megatron-LM gathers them only with
  --data-parallel-random-init, else the list has rank 0's alone), each a dict keyed as
  `RNG_KEYS` says. Ours writes that layout; our earlier checkpoints hold one dict per rank
  at (pipeline, tensor, data) coordinates of shape (PP, TP, DP), still read.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject

from megatron.trainer.checkpoint.checkpoint_files import RNG_KEY
from megatron.trainer.checkpoint.checkpoint_publish import CheckpointError

CHECKPOINT_VERSION = 3.0  # Megatron-LM's since its query/key/value layout of 2020
# our RNG state's names -> Megatron-LM's (its get_rng_state)
RNG_KEYS = {"random": "random_rng_state", "numpy": "np_rng_state", "torch": "torch_rng_state",
            "cuda": "cuda_rng_state", "tracker": "rng_tracker_states"}


def common_entries(iteration: int, consumed_samples: int, floating_point_operations: float,
                   run_args: dict | None) -> dict:
    """What Megatron-LM's load_checkpoint reads from the common state, beside the
    scheduler's state: the flags, version, iteration and FLOP count."""
    entries = {"checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration,
               "num_floating_point_operations_so_far": float(floating_point_operations)}
    if run_args is not None:
        entries["args"] = saved_args(run_args, iteration, consumed_samples)
    return entries


def saved_args(run_args: dict, iteration: int, consumed_samples: int) -> argparse.Namespace:
    """Our flags (plain values) as Megatron-LM saves its own: a Namespace with the data
    position its trainer resumes from (validation: what Megatron-LM's evaluations at
    every --eval-interval have consumed by `iteration`)."""
    values = dict(run_args)
    interval, eval_iters = values.get("eval_interval"), values.get("eval_iters") or 0
    eval_batch = values.get("eval_global_batch_size") or values.get("global_batch_size") or 0
    evaluations = iteration // interval if interval else 0
    values.update(consumed_train_samples=consumed_samples, skipped_train_samples=0,
                  consumed_valid_samples=evaluations * eval_iters * eval_batch)
    return argparse.Namespace(**values)


def written_by_megatron_lm(common: dict) -> bool:
    """Whether a torch_dist checkpoint's common state is Megatron-LM's (ours always has
    `training_state`)."""
    return "training_state" not in common and "iteration" in common


def check_version(common: dict, path: str) -> None:
    """Refuse a Megatron-LM checkpoint older than its torch_dist ones."""
    version = common.get("checkpoint_version")
    if not isinstance(version, int | float) or version < CHECKPOINT_VERSION:
        raise CheckpointError(
            f"{path} was written by Megatron-LM with checkpoint_version {version!r}; only "
            f"{CHECKPOINT_VERSION} (Megatron-LM's torch_dist checkpoints) is read: older "
            "versions order the attention's query/key/value weights differently")


def training_state(common: dict, path: str) -> dict:
    """The counters of a Megatron-LM checkpoint, as our TrainingState's fields."""
    check_version(common, path)
    args = common.get("args")
    return {"iteration": int(common["iteration"]),
            "consumed_samples": int(getattr(args, "consumed_train_samples", 0) or 0),
            "skipped_iterations": 0,
            "floating_point_operations": float(
                common.get("num_floating_point_operations_so_far", 0) or 0)}


def saved_data_parallel_size(common: dict) -> int | None:
    """The data-parallel size the checkpoint was saved at, from its flags."""
    args = common.get("args")
    size = args.get("data_parallel_size") if isinstance(args, dict) else getattr(
        args, "data_parallel_size", None)
    return size if isinstance(size, int) else None


def rng_sharded_object(state: dict | None) -> ShardedObject:
    """The RNG states in Megatron-LM's layout. Saving (`state` this rank's, our keys): every
    data-parallel rank's states gathered into the list; loading (`state` None): the request."""
    tensor_rank = parallel_state.get_tensor_model_parallel_rank()
    pipeline_rank = parallel_state.get_pipeline_model_parallel_rank()
    shape = (parallel_state.get_pipeline_model_parallel_world_size(),
             parallel_state.get_tensor_model_parallel_world_size())
    states = None
    if state is not None:
        states = [{RNG_KEYS[key]: value for key, value in state.items()}]
        group = parallel_state.get_data_parallel_group()
        if dist.get_world_size(group) > 1:
            states = [None] * dist.get_world_size(group)
            dist.all_gather_object(states, {RNG_KEYS[key]: value for key, value in state.items()},
                                   group=group)
    return ShardedObject(RNG_KEY, states, shape, (pipeline_rank, tensor_rank),
                         replica_id=parallel_state.get_data_parallel_rank(
                             with_context_parallel=True))


def rng_of_this_rank(loaded) -> dict:
    """Our RNG dict from a loaded `rng_state`: Megatron-LM's layout (a list over the
    data-parallel ranks, or of rank 0's alone) or ours before it (this rank's dict)."""
    if isinstance(loaded, dict):
        return loaded
    rank = parallel_state.get_data_parallel_rank()
    entry = loaded[rank] if len(loaded) > 1 else loaded[0]
    state = {ours: entry[theirs] for ours, theirs in RNG_KEYS.items()}
    state["tracker"] = _tracker_states(state["tracker"])
    return state


def _tracker_states(states: dict) -> dict:
    """megatron-core >= 0.17 may keep a tracker's states as CUDA-graph-safe generators;
    each saved state is converted to what this run's tracker holds."""
    convert = getattr(tensor_parallel, "convert_cuda_rng_state", None)
    graph_safe = getattr(tensor_parallel, "is_graph_safe_cuda_rng_tracker", None)
    if convert is None or graph_safe is None or not torch.cuda.is_available():
        return states
    graphable = graph_safe(tensor_parallel.get_cuda_rng_tracker())
    return {name: convert(state, to_graphable=graphable) for name, state in states.items()}
