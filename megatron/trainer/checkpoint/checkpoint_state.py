"""What a checkpoint holds, for saving and loading alike: the sharded state dict of the
model chunks (Megatron-LM's keys), the optimizer, the lr scheduler, the RNG states (in
Megatron-LM's layout, or our earlier per-rank one) and the loop's `TrainingState`."""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.utils import unwrap_model

from megatron.trainer.checkpoint import checkpoint_files, megatron_lm_format
from megatron.trainer.checkpoint.checkpoint_config import CheckpointConfig


@dataclass
class TrainingState:
    iteration: int = 0
    consumed_samples: int = 0
    skipped_iterations: int = 0
    # the model's FLOPs so far (Megatron-LM's num_floating_point_operations_so_far)
    floating_point_operations: float = 0.0


def optimizer_metadata(config: CheckpointConfig) -> dict:
    sharding = config.optimizer_sharding
    return {} if sharding is None else {"distrib_optim_sharding_type": sharding}


def chunk_keys(model) -> list[str]:
    """The checkpoint's key of each model chunk (Megatron-LM's names)."""
    return ["model"] if len(model) == 1 else [f"model{index}" for index in range(len(model))]


# how a torch_dist checkpoint holds its RNG states (megatron_lm_format.py)
RNG_MEGATRON_LM = "megatron-lm"  # Megatron-LM's layout, which ours writes
RNG_PER_RANK = "per-rank"  # ours before: each rank's dict at (pipeline, tensor, data)


def sharded_state(model, optimizer, scheduler, state, metadata: dict, loading: bool,
                  rng: str | None = RNG_MEGATRON_LM) -> dict:
    # the bare models (no DDP / Float16Module wrapper): their keys are what load_state_dict
    # expects and do not change with the precision
    model = unwrap_model(model)
    sharded = {}
    for key, chunk in zip(chunk_keys(model), model, strict=True):
        sharded[key] = chunk.sharded_state_dict()
    if optimizer is not None:
        # the optimizer finds its parameters among the chunks' sharded tensors; each chunk
        # keeps its own dict (their local names repeat: every chunk numbers its layers from 0)
        model_sharded = {key: sharded[key] for key in chunk_keys(model)}
        sharded["optimizer"] = optimizer.sharded_state_dict(
            model_sharded, is_loading=loading, metadata=metadata
        )
    if scheduler is not None:
        sharded["opt_param_scheduler"] = scheduler.state_dict()
    if rng == RNG_MEGATRON_LM:
        sharded["rng_state"] = megatron_lm_format.rng_sharded_object(
            None if loading else rng_state())
    elif rng == RNG_PER_RANK:
        sharded["rng_state"] = rng_per_rank_object()
    sharded["training_state"] = vars(state).copy()
    return sharded


def rng_state() -> dict:
    return {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def rng_layout() -> tuple[int, int, int]:
    """(pipeline, tensor, data)-parallel sizes: the shape the RNG states are saved in."""
    return (parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_data_parallel_world_size(with_context_parallel=True))


def layout_text(layout: tuple[int, ...] | None) -> str:
    if layout is None:
        return "no layout"
    return "PP {} x TP {} x DP {}".format(*("?" if size is None else size for size in layout))


def rng_per_rank_object() -> ShardedObject:
    """The request for our earlier layout: each rank's RNG state at its (pipeline, tensor,
    data) coordinates."""
    coords = (
        parallel_state.get_pipeline_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_data_parallel_rank(with_context_parallel=True),
    )
    return ShardedObject(checkpoint_files.RNG_KEY, None, rng_layout(), coords, replica_id=0)
