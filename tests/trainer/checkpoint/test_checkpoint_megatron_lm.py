"""torch_dist checkpoints interchange with Megatron-LM's own trainer (megatron.training, as
megatron-core 0.19.2 ships it; docs/megatron_lm.md, "Checkpoints"), at the same layout.

* A checkpoint laid out as Megatron-LM writes it (its generate_state_dict: `args` an
  argparse.Namespace, `checkpoint_version` 3.0, `iteration`, its RNG layout and content
  metadata, written here with megatron.core.dist_checkpointing from the model's and
  optimizer's sharded state) resumes in our trainer: the losses after it equal an
  uninterrupted run's, and the counters and RNG states are Megatron-LM's.
* Our checkpoint holds what Megatron-LM's load_checkpoint reads, and a request built as
  Megatron-LM builds it (model, optimizer, RNG in its layout) loads it with every key found.
* A checkpoint in our layout before this (`args` a dict, `checkpoint_version` 1, each
  rank's RNG states at (pipeline, tensor, data) coordinates) still resumes exactly.
* A pickled class in `args` other than the allowed ones is refused by name.
* Where megatron.training is importable (megatron-core >= 0.17), its own
  check_checkpoint_args accepts our checkpoint's flags.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import random

import numpy as np
import pytest
import torch

from megatron.trainer.checkpoint import (
    checkpoint_load,
    checkpoint_state,
    checkpoint_trust,
    checkpointing,
    megatron_lm_format,
)
from megatron.trainer.checkpoint.checkpoint_publish import POINTER, CheckpointError
from tests import trainer_runs
from tests.distributed import run_ranks
from tests.trainer_runs import TINY, with_flags

ITERS, SAVE_AT, BATCH = 4, 2, 8
BASE = with_flags(TINY, global_batch_size=BATCH, train_iters=ITERS)
# a FLOP count and a Python RNG state that only the Megatron-LM checkpoint holds
MEGATRON_LM_FLOPS = 1.5e12
MEGATRON_LM_RANDOM = random.Random(99).getstate()
BEFORE_RANDOM = random.Random(98).getstate()  # in our checkpoint of the earlier layout
# what Megatron-LM's load_checkpoint and check_checkpoint_args read from `args`
# (megatron/training/checkpointing.py of megatron-core 0.19.2; padded_vocab_size only for
# checkpoints other than torch_dist)
ARGS_READ = ("num_layers", "hidden_size", "num_attention_heads", "max_position_embeddings",
             "make_vocab_size_divisible_by", "tokenizer_type",
             "tensor_model_parallel_size", "pipeline_model_parallel_size", "world_size",
             "data_parallel_size", "consumed_train_samples", "skipped_train_samples",
             "consumed_valid_samples", "global_batch_size", "no_save_optim")
# what its OptimizerParamScheduler.load_state_dict reads
SCHEDULER_KEYS = {"max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style",
                  "num_steps", "start_wd", "end_wd", "wd_incr_steps", "wd_incr_style"}
RNG_KEYS = {"random_rng_state", "np_rng_state", "torch_rng_state", "cuda_rng_state",
            "rng_tracker_states"}


def _losses(run):
    return [step["lm loss"] for step in run["losses"]]


def _megatron_lm_content_metadata(distributed_optimizer: bool) -> dict:
    """Megatron-LM's _build_sharded_state_dict_metadata, less its process group."""
    metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if distributed_optimizer:
        metadata["distrib_optim_sharding_type"] = "dp_reshardable"
    return metadata


def _write(saved: dict, root: str, iteration: int, metadata: dict | None) -> None:
    """`saved` as iteration `iteration`'s torch_dist checkpoint under `root`, published."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    path = checkpointing.checkpoint_dir(root, iteration)
    if dist.get_rank() == 0:
        os.makedirs(path)
    dist.barrier()
    dist_checkpointing.save(saved, path, TorchDistSaveShardedStrategy("torch_dist", 1),
                            content_metadata=metadata)
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(root, POINTER), "w") as pointer:
            pointer.write(f"{iteration}\n")
    dist.barrier()


def _save_as_megatron_lm(trainer, root: str) -> None:
    """The trainer's state as Megatron-LM 0.19's save_checkpoint writes it (torch_dist)."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.utils import unwrap_model

    from megatron.trainer.checkpoint.checkpoint_config import plain_args

    args, state = trainer.args, trainer.state
    metadata = _megatron_lm_content_metadata(args.use_distributed_optimizer)
    flags = argparse.Namespace(**plain_args(args), params_dtype=torch.float32,
                               consumed_train_samples=state.consumed_samples,
                               skipped_train_samples=0, consumed_valid_samples=0)
    saved = {"args": flags, "checkpoint_version": 3.0, "iteration": state.iteration}
    chunks = unwrap_model(trainer.model)
    for index, chunk in enumerate(chunks):
        saved["model" if len(chunks) == 1 else f"model{index}"] = chunk.sharded_state_dict(
            metadata=metadata)
    saved["optimizer"] = trainer.optimizer.sharded_state_dict(saved, metadata=metadata)
    saved["opt_param_scheduler"] = trainer.scheduler.state_dict()
    rng = {"random_rng_state": MEGATRON_LM_RANDOM, "np_rng_state": np.random.get_state(),
           "torch_rng_state": torch.get_rng_state(),
           "cuda_rng_state": torch.get_rng_state(),  # no CUDA here: a tensor of its kind
           "rng_tracker_states": {}}
    saved["rng_state"] = ShardedObject(
        "rng_state", [rng], (parallel_state.get_pipeline_model_parallel_world_size(),
                             parallel_state.get_tensor_model_parallel_world_size()),
        (parallel_state.get_pipeline_model_parallel_rank(),
         parallel_state.get_tensor_model_parallel_rank()),
        replica_id=parallel_state.get_data_parallel_rank(with_context_parallel=True))
    saved["num_floating_point_operations_so_far"] = MEGATRON_LM_FLOPS
    _write(saved, root, state.iteration, metadata)


def _save_as_before(trainer, root: str) -> None:
    """The trainer's state in our torch_dist layout before megatron_lm_format.py."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.utils import unwrap_model

    from megatron.trainer.checkpoint.checkpoint_config import CheckpointConfig

    config = CheckpointConfig.from_args(trainer.args)
    metadata = checkpoint_state.optimizer_metadata(config)
    chunks = unwrap_model(trainer.model)
    keys = ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]
    saved = {key: chunk.sharded_state_dict() for key, chunk in zip(keys, chunks, strict=True)}
    saved["optimizer"] = trainer.optimizer.sharded_state_dict(dict(saved), metadata=metadata)
    saved["opt_param_scheduler"] = trainer.scheduler.state_dict()
    rng = {**checkpoint_state.rng_state(), "random": BEFORE_RANDOM}
    saved["rng_state"] = ShardedObject(
        "rng_state", rng, checkpoint_state.rng_layout(),
        (parallel_state.get_pipeline_model_parallel_rank(),
         parallel_state.get_tensor_model_parallel_rank(),
         parallel_state.get_data_parallel_rank(with_context_parallel=True)), replica_id=0)
    state = trainer.state
    saved["training_state"] = {"iteration": state.iteration,
                               "consumed_samples": state.consumed_samples,
                               "skipped_iterations": state.skipped_iterations}
    saved["checkpoint_version"] = 1
    saved["args"] = config.run_args
    _write(saved, root, state.iteration, metadata or None)


def _load_as_megatron_lm(trainer, path: str) -> dict:
    """Load our checkpoint at `path` with the request Megatron-LM 0.19's load_checkpoint
    builds (generate_state_dict with the checkpoint's content metadata, its RNG layout),
    every requested key required and none left over; what came back, in brief."""
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy
    from megatron.core.utils import unwrap_model

    common = checkpoint_trust.load_common_state(path)
    metadata = dist_checkpointing.load_content_metadata(preloaded_state_dict=common) or {}
    chunks = unwrap_model(trainer.model)
    keys = ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]
    request = {key: chunk.sharded_state_dict(metadata=metadata)
               for key, chunk in zip(keys, chunks, strict=True)}
    request["optimizer"] = trainer.optimizer.sharded_state_dict(request, is_loading=True,
                                                                metadata=metadata)
    request["rng_state"] = ShardedObject(
        "rng_state", None, (parallel_state.get_pipeline_model_parallel_world_size(),
                            parallel_state.get_tensor_model_parallel_world_size()),
        (parallel_state.get_pipeline_model_parallel_rank(),
         parallel_state.get_tensor_model_parallel_rank()),
        replica_id=parallel_state.get_data_parallel_rank(with_context_parallel=True))
    loaded = dist_checkpointing.load(request, path, TorchDistLoadShardedStrategy(),
                                     strict="raise_all")
    pairs = [(loaded[key][name], tensor) for key, chunk in zip(keys, chunks, strict=True)
             for name, tensor in chunk.state_dict().items()
             if name in loaded[key] and isinstance(tensor, torch.Tensor)]
    return {"parameters_equal": len(pairs) > 4 and all(torch.equal(*pair) for pair in pairs),
            "rng_entries": len(loaded["rng_state"]),
            "rng_keys": sorted(loaded["rng_state"][0]), "iteration": loaded["iteration"],
            "args_type": type(loaded["args"]).__name__}


def _interchange(rank, flags, world_size, ours: str, theirs: str, before: str):
    """Rank function: ours trains to SAVE_AT saving its checkpoint (`ours`), writes the
    same state as Megatron-LM would (`theirs`) and as ours did before (`before`), and loads
    its own checkpoint as Megatron-LM would; then an uninterrupted run, and runs resumed
    from `theirs` and from `before`."""
    from megatron.trainer.config.arguments import parse_args
    from megatron.trainer.run import initialize, training
    from megatron.trainer.tasks.gpt import GPT_TASK

    initialize._shutdown = trainer_runs._destroy_model_parallel_only
    saving = with_flags(flags, save=ours, save_interval=SAVE_AT, exit_interval=SAVE_AT)
    with contextlib.ExitStack() as stack:
        trainer = training.setup(GPT_TASK, parse_args(saving, world_size=world_size), stack)
        training.train(trainer)
        _save_as_megatron_lm(trainer, theirs)
        _save_as_before(trainer, before)
        read_back = _load_as_megatron_lm(trainer, checkpointing.checkpoint_dir(ours, SAVE_AT))
    restored = []
    original = checkpoint_load._restore_rng
    checkpoint_load._restore_rng = lambda state: (restored.append(state["random"]),
                                                original(state))
    try:
        runs = trainer_runs.train_runs(rank, [flags, with_flags(flags, load=theirs),
                                              with_flags(flags, load=before)], world_size)
    finally:
        checkpoint_load._restore_rng = original
    return {"runs": runs, "read_back": read_back, "restored_random": restored}


@pytest.mark.parametrize("layout", [["--pipeline-model-parallel-size", "2"],
                                    ["--use-distributed-optimizer"]], ids=["pp2", "dp2-distopt"])
def test_checkpoints_interchange_with_megatron_lm(tmp_path, layout):
    ours, theirs, before = (str(tmp_path / name) for name in ("ours", "theirs", "before"))
    results = run_ranks(2, _interchange, BASE + layout, 2, ours, theirs, before)
    uninterrupted, resumed, resumed_before = results[-1]["runs"]
    # (a) Megatron-LM's checkpoint resumes in ours: the same losses as without a stop
    assert len(_losses(uninterrupted)) == ITERS
    assert _losses(resumed) == _losses(uninterrupted)[SAVE_AT:]
    assert resumed["grad_norms"] == uninterrupted["grad_norms"][SAVE_AT:]
    state = resumed["state"]
    assert (state["iteration"], state["consumed_samples"]) == (ITERS, ITERS * BATCH)
    saving_flops = uninterrupted["state"]["floating_point_operations"] / ITERS * SAVE_AT
    assert state["floating_point_operations"] == pytest.approx(MEGATRON_LM_FLOPS + saving_flops)
    for rank in results:  # the RNG states of each checkpoint, restored
        assert rank["restored_random"] == [MEGATRON_LM_RANDOM, BEFORE_RANDOM]
    logs = [message for _, message in results[0]["runs"][1]["logs"]]
    assert any(f"{theirs}/iter_0000002 was written by Megatron-LM's trainer" in message
               for message in logs), logs
    # (b) ours loads with Megatron-LM's request: every key found, the same parameters
    for rank in results:
        assert rank["read_back"] == {
            "parameters_equal": True, "rng_keys": sorted(RNG_KEYS), "iteration": SAVE_AT,
            "args_type": "Namespace",
            "rng_entries": 2 if "--use-distributed-optimizer" in layout else 1}
    _check_common_state(checkpointing.checkpoint_dir(ours, SAVE_AT), layout)
    # our checkpoints of the earlier layout still resume exactly
    assert _losses(resumed_before) == _losses(uninterrupted)[SAVE_AT:]
    assert resumed_before["grad_norms"] == uninterrupted["grad_norms"][SAVE_AT:]
    assert resumed_before["state"]["consumed_samples"] == ITERS * BATCH


def _check_common_state(path: str, layout: list[str]) -> None:
    """(b) Our common state has the keys and types Megatron-LM's load_checkpoint reads."""
    common = checkpoint_trust.load_common_state(path)
    assert common["checkpoint_version"] == 3.0  # >= 3.0: no QKV reordering, no TP check
    assert isinstance(common["iteration"], int) and common["iteration"] == SAVE_AT
    assert isinstance(common["num_floating_point_operations_so_far"], float)
    assert common["num_floating_point_operations_so_far"] > 0
    assert SCHEDULER_KEYS <= set(common["opt_param_scheduler"])
    args = common["args"]
    assert type(args) is argparse.Namespace
    missing = [name for name in ARGS_READ if not hasattr(args, name)]
    assert not missing, missing
    assert all(value is None or isinstance(value, bool | int | float | str | list | tuple)
               for value in vars(args).values())
    assert args.consumed_train_samples == SAVE_AT * BATCH
    assert (args.skipped_train_samples, args.consumed_valid_samples) == (0, 0)
    pipeline = 2 if "--pipeline-model-parallel-size" in layout else 1
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (1, pipeline)
    assert args.data_parallel_size == 2 // pipeline


class Unexpected:
    """A class no checkpoint's flags hold."""


def _common_state_checkpoint(root, args) -> str:
    path = root / "iter_0000003"
    path.mkdir(parents=True)
    torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 3},
               path / "common.pt")
    (root / POINTER).write_text("3\n")
    return str(path)


def test_unexpected_class_in_args_is_refused_by_name(tmp_path):
    path = _common_state_checkpoint(tmp_path, argparse.Namespace(num_layers=2,
                                                                 hook=Unexpected()))
    name = f"{__name__}.Unexpected"
    with pytest.raises(checkpoint_trust.CommonStateRefused, match=name):
        checkpoint_trust.load_common_state(path)
    with pytest.raises(CheckpointError, match=f"loading {path}: .*holds {name}"):
        checkpoint_load._read_common_state(path)
    from megatron.trainer.config.arguments import parse_args

    with pytest.raises(CheckpointError, match=f"--use-checkpoint-args: .*holds {name}"):
        parse_args(with_flags(BASE, load=str(tmp_path), use_checkpoint_args=True),
                   world_size=1)


def test_use_checkpoint_args_reads_megatron_lm_namespace(tmp_path):
    """Megatron-LM's Namespace with what its flags hold beyond plain values (a dtype, an
    enum megatron.core declares) is read, and the model's flags come from it."""
    from megatron.core.transformer.enums import AttnBackend

    from megatron.trainer.config.arguments import parse_args

    _common_state_checkpoint(tmp_path, argparse.Namespace(
        num_layers=6, hidden_size=48, num_attention_heads=4, params_dtype=torch.float32,
        attention_backend=AttnBackend.auto))
    args = parse_args(with_flags(BASE, load=str(tmp_path), use_checkpoint_args=True,
                                 num_layers=None, hidden_size=None), world_size=1)
    assert (args.num_layers, args.hidden_size) == (6, 48)


def test_megatron_lm_counters_and_old_versions():
    args = argparse.Namespace(consumed_train_samples=24)
    common = {"args": args, "checkpoint_version": 3.0, "iteration": 3,
              "num_floating_point_operations_so_far": 7.0}
    assert megatron_lm_format.written_by_megatron_lm(common)
    assert not megatron_lm_format.written_by_megatron_lm({**common, "training_state": {}})
    assert megatron_lm_format.training_state(common, "ckpt") == {
        "iteration": 3, "consumed_samples": 24, "skipped_iterations": 0,
        "floating_point_operations": 7.0}
    with pytest.raises(CheckpointError, match="checkpoint_version 2.0; only 3.0"):
        megatron_lm_format.training_state({**common, "checkpoint_version": 2.0}, "ckpt")


@pytest.mark.skipif(importlib.util.find_spec("megatron.training") is None,
                    reason="megatron.training is not importable: megatron-core 0.16.1 ships "
                           "none (0.17 and later do, as on the GPU machines)")
def test_megatron_lm_check_checkpoint_args_accepts_ours(tmp_path):
    """Megatron-LM's own check_checkpoint_args, run as its load_checkpoint runs it (its
    global args this run's, the checkpoint's version set), against our saved flags."""
    from megatron.training import checkpointing as megatron_lm
    from megatron.training import global_vars

    results = run_ranks(1, trainer_runs.train_runs,
                        [with_flags(BASE, train_iters=SAVE_AT, save=tmp_path)], 1)
    assert len(_losses(results[0][0])) == SAVE_AT
    common = checkpoint_trust.load_common_state(checkpointing.checkpoint_dir(str(tmp_path),
                                                                             SAVE_AT))
    # this run's flags: the checkpoint's, with what Megatron-LM's validate_args adds
    flags = {**vars(common["args"]), "use_dist_ckpt": True, "vocab_file": None,
             "data_parallel_random_init": False, "phase_transition_iterations": None}
    flags.setdefault("add_position_embedding", True)
    current = argparse.Namespace(**flags)
    global_vars.set_args(current)
    megatron_lm.set_checkpoint_version(common["checkpoint_version"])
    megatron_lm.check_checkpoint_args(common["args"])
    current.num_layers += 1
    with pytest.raises(AssertionError, match="num_layers value from checkpoint"):
        megatron_lm.check_checkpoint_args(common["args"])
