"""Megatron-LM's checkpoint flags, each shown by its effect: a checkpoint in either format
saves, loads and resumes with identical losses; --async-save trains on while it writes and
the next save waits for it; fully parallel save spreads the writes and fully parallel load
the reads over the data-parallel ranks; the strictness names the mismatched key; the lr
schedule comes from the flags or the checkpoint as asked; --save-retain-interval and
non-persistent saves keep exactly the iterations Megatron-LM keeps."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import time

import pytest

from megatron.trainer.checkpoint import checkpoint_state, checkpointing
from megatron.trainer.config.arguments import ArgumentError, parse_args
from tests.distributed import run_ranks
from tests.trainer.checkpoint.test_checkpointing import BASE, SAVE_AT, _check_resumed
from tests.trainer_runs import TINY, train_runs, with_flags

POINTER = checkpointing.POINTER
WRITE_DELAY_S = 1.5  # each asynchronous write, so that training visibly goes on meanwhile


def _formats_and_parallel_io(rank, runs, world_size):
    """train_runs with slow asynchronous writers, counting the tensors each torch_dist load
    reads on this rank."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        FileSystemWriterAsync,
    )
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    # each bucket's write (megatron-core 0.16: in a process of the writer's own, >= 0.17: in
    # the writer's process or threads)
    write, rank_process = FileSystemWriterAsync.write_preloaded_data, os.getpid()

    @functools.wraps(write)  # the trainer checks its signature
    def slow_write(*args, **kwargs):
        if os.getpid() != rank_process:  # the background process of an asynchronous save
            time.sleep(WRITE_DELAY_S)
        return write(*args, **kwargs)

    FileSystemWriterAsync.write_preloaded_data = staticmethod(slow_write)
    load, reads = TorchDistLoadShardedStrategy.load, []

    def counting_load(self, sharded_state_dict, *args, **kwargs):  # >= 0.17: async_strategy
        reads.append(sum(isinstance(v, ShardedTensor) for v in nested_values(sharded_state_dict)))
        return load(self, sharded_state_dict, *args, **kwargs)

    TorchDistLoadShardedStrategy.load = counting_load
    results = train_runs(rank, runs, world_size)
    return results, reads


def _messages(run):
    return [message for _, message in run["logs"]]


def _first(messages, text):
    return next(index for index, message in enumerate(messages) if text in message)


@pytest.mark.slow
@pytest.mark.long
def test_formats_async_and_parallel_io_resume_exactly(tmp_path):
    pp2 = with_flags(BASE, pipeline_model_parallel_size=2)
    flag_sets = {
        "torch_pp2": pp2 + ["--ckpt-format", "torch"],
        "torch_distopt_dp2": BASE + ["--ckpt-format", "torch", "--use-distributed-optimizer"],
        "async_dp2": BASE + ["--async-save", "--use-distributed-optimizer"],
        "serial_save_parallel_load_dp2": BASE + [
            "--no-ckpt-fully-parallel-save", "--ckpt-fully-parallel-load",
            "--use-distributed-optimizer"],
    }
    runs = []
    for name, flags in flag_sets.items():
        whole, parts = tmp_path / name / "whole", tmp_path / name / "parts"
        runs += [with_flags(flags, save=whole, load=whole),
                 with_flags(flags, save=parts, exit_interval=SAVE_AT),
                 with_flags(flags, save=parts, load=parts)]
    per_rank = run_ranks(2, _formats_and_parallel_io, runs, 2)
    results = [rank_results for rank_results, _ in per_rank]
    for index, name in enumerate(flag_sets):
        _check_resumed([rank[3 * index: 3 * index + 3] for rank in results],
                       str(tmp_path / name / "whole"), str(tmp_path / name / "parts"))

    # --ckpt-format torch: Megatron-LM's layout, one file per model-parallel rank
    checkpoint = tmp_path / "torch_pp2" / "whole" / "iter_0000004"
    assert sorted(os.listdir(checkpoint)) == ["mp_rank_00_000", "mp_rank_00_001"]
    assert os.listdir(checkpoint / "mp_rank_00_000") == ["model_optim_rng.pt"]
    checkpoint = tmp_path / "torch_distopt_dp2" / "whole" / "iter_0000004" / "mp_rank_00"
    assert sorted(os.listdir(checkpoint)) == ["distrib_optim.pt", "model_optim_rng.pt"]
    # torch_dist (the default)
    assert "metadata.json" in os.listdir(tmp_path / "async_dp2" / "whole" / "iter_0000004")

    # --async-save: iteration 3 trained while iteration 2 was written; the save at
    # iteration 4 first waited for it to be published
    messages = _messages(results[1][3 * list(flag_sets).index("async_dp2")])
    background = _first(messages, "saving checkpoint at iteration 2")
    trained = _first(messages, " iteration        3/")
    published = _first(messages, "saved checkpoint at iteration 2 ")
    assert background < trained < published < _first(messages, "saving checkpoint at iteration 4")

    # fully parallel save (the default) splits the replicated model between the two
    # data-parallel ranks; --no-ckpt-fully-parallel-save leaves it to rank 0 (each rank
    # writes its own distributed-optimizer shard either way)
    def shard_bytes(name):
        path = tmp_path / name / "whole" / "iter_0000004"
        return [os.path.getsize(path / f"__{rank}_0.distcp") for rank in (0, 1)]

    parallel, serial = shard_bytes("async_dp2"), shard_bytes("serial_save_parallel_load_dp2")
    model_bytes = serial[0] - serial[1]
    assert abs(sum(parallel) - sum(serial)) < 0.05 * sum(serial), (parallel, serial)
    assert model_bytes > 0.15 * sum(serial), serial
    assert abs(parallel[0] - parallel[1]) < 0.25 * model_bytes, (parallel, serial)

    # --ckpt-fully-parallel-load: the replicated model tensors are read once, each by one
    # data-parallel rank, and exchanged; without it every rank reads all of them (the two
    # loads read the same checkpoint layout: distributed optimizer, dp_reshardable)
    plain = [reads[0] for _, reads in per_rank]
    parallel_load = [reads[-1] for _, reads in per_rank]
    assert all(p < q for p, q in zip(parallel_load, plain, strict=True)), (parallel_load, plain)
    assert min(parallel_load) > 0, parallel_load
    # the distributed optimizer's layout is stored with the checkpoint (and read on load)
    from megatron.core import dist_checkpointing

    metadata = dist_checkpointing.load_content_metadata(
        str(tmp_path / "serial_save_parallel_load_dp2" / "whole" / "iter_0000004"))
    assert metadata == {"distrib_optim_sharding_type": "dp_reshardable"}


def _single_rank_flags(rank, root, world_size):
    """One process: --save-retain-interval, non-persistent saves, then loads of one
    checkpoint under each strictness and scheduler choice. Returns what each showed."""
    import torch
    import torch.distributed as dist
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from megatron.trainer.checkpoint.checkpoint_config import CheckpointConfig
    from megatron.trainer.run import initialize, training
    from tests.trainer_runs import _destroy_model_parallel_only, _Records, task_by_name

    flags = with_flags(TINY, global_batch_size=2)
    initialize._shutdown = _destroy_model_parallel_only  # one process group for every run
    task = task_by_name("gpt")

    def train(run_flags):
        handler = _Records()
        logging.getLogger("megatron.trainer").addHandler(handler)
        try:
            with contextlib.ExitStack() as stack:
                training.train(training.setup(task, parse_args(run_flags, world_size=1), stack))
        finally:
            logging.getLogger("megatron.trainer").removeHandler(handler)
        return handler.entries

    seen = {"retain_logs": train(with_flags(flags, train_iters=10, save_interval=2,
                                            save_retain_interval=4, save=f"{root}/retain"))}
    train(with_flags(flags, train_iters=6, save_interval=4, save=f"{root}/transient",
                     non_persistent_save_interval=1, non_persistent_ckpt_type="global"))

    # the checkpoint that the loads below read holds one tensor the model lacks
    sharded_state = checkpoint_state.sharded_state

    def with_extra_key(model, optimizer, scheduler, state, metadata, loading, **options):
        sharded = sharded_state(model, optimizer, scheduler, state, metadata, loading, **options)
        sharded["extra"] = ShardedTensor.from_rank_offsets("extra.weight", torch.zeros(3))
        return sharded

    saved = f"{root}/strict"
    checkpoint_state.sharded_state = with_extra_key
    train(with_flags(flags, train_iters=2, save=saved))
    checkpoint_state.sharded_state = sharded_state

    def load(extra_flags, asked_for=None, checkpoint=saved):
        args = parse_args(with_flags(flags, train_iters=2, load=checkpoint) + extra_flags,
                          world_size=world_size)
        if asked_for is not None:
            def asking(model, optimizer, scheduler, state, metadata, loading, **options):
                sharded = sharded_state(model, optimizer, scheduler, state, metadata, loading,
                                        **options)
                sharded["probe"] = ShardedTensor.from_rank_offsets(asked_for, torch.zeros(3))
                return sharded
            checkpoint_state.sharded_state = asking
        try:
            with contextlib.ExitStack() as stack:
                trainer = training.setup(task, args, stack)
                # the scheduler computes each param group's lr from the group's own bounds
                group_lrs = {group["max_lr"] for group in trainer.optimizer.param_groups}
                return trainer.state.iteration, trainer.scheduler.max_lr, group_lrs
        except checkpointing.CheckpointError as error:
            return str(error)
        finally:
            checkpoint_state.sharded_state = sharded_state

    seen["default"] = load([])
    seen["raise_all"] = load(["--dist-ckpt-strictness", "raise_all"])
    seen["raise_unexpected"] = load(["--dist-ckpt-strictness", "raise_unexpected"])
    seen["raise_unexpected_asked"] = load(["--dist-ckpt-strictness", "raise_unexpected"],
                                          asked_for="probe.weight")
    seen["lr_differs"] = load(["--lr", "2e-3"])
    seen["lr_from_checkpoint"] = load(["--lr", "2e-3", "--use-checkpoint-opt_param-scheduler"])
    seen["lr_from_flags"] = load(["--lr", "2e-3", "--override-opt_param-scheduler"])
    # the embedding's and output layer's param group has its own lr bounds
    decoupled = f"{root}/decoupled"
    train(with_flags(flags, train_iters=2, save=decoupled, decoupled_lr=3e-3))
    seen["decoupled_differs"] = load(["--decoupled-lr", "4e-3"], checkpoint=decoupled)
    seen["decoupled_from_checkpoint"] = load(
        ["--decoupled-lr", "4e-3", "--use-checkpoint-opt_param-scheduler"], checkpoint=decoupled)
    seen["decoupled_from_flags"] = load(
        ["--decoupled-lr", "4e-3", "--override-opt_param-scheduler"], checkpoint=decoupled)

    # non-persistent: --load takes the newer of the two series
    transient_root = f"{root}/transient"
    with open(os.path.join(transient_root, POINTER), "w") as pointer:
        pointer.write("4\n")
    config = CheckpointConfig(load=transient_root,
                              non_persistent_dir=f"{transient_root}/non_persistent")
    with contextlib.ExitStack() as stack:
        args = parse_args(with_flags(flags, train_iters=6), world_size=world_size)
        trainer = training.setup(task, args, stack)
        seen["non_persistent_load"] = checkpointing.Checkpointer(config, use_gpu=False).load(
            trainer.model, trainer.optimizer, trainer.scheduler).iteration
    dist.destroy_process_group()
    return seen


def test_retention_strictness_and_scheduler_flags(tmp_path):
    (tmp_path / "retain").mkdir()
    (tmp_path / "retain" / "notes.txt").write_text("not a checkpoint")
    (tmp_path / "retain" / "iter_0000002_copy").mkdir()
    seen = run_ranks(1, _single_rank_flags, str(tmp_path), 1)[0]

    # retain 4, saves every 2 up to 10: each save deletes the previous one unless it is a
    # multiple of 4; nothing else in the directory is touched
    assert sorted(os.listdir(tmp_path / "retain")) == sorted([
        "iter_0000002_copy", "iter_0000004", "iter_0000008", "iter_0000010", POINTER,
        "notes.txt"])
    deleted = [m for _, m in seen["retain_logs"] if m.startswith("deleted the old checkpoint")]
    assert [m.rsplit("_", 1)[1] for m in deleted] == ["0000002", "0000006"]
    # persistent every 4 and at the end (6), non-persistent at every other iteration and
    # also at 6 (as Megatron-LM): only the latest non-persistent one stays, in
    # SAVE/non_persistent
    transient = tmp_path / "transient"
    assert sorted(os.listdir(transient)) == sorted(["iter_0000004", "iter_0000006",
                                                    "non_persistent", POINTER])
    assert sorted(os.listdir(transient / "non_persistent")) == ["iter_0000006", POINTER]
    # with the persistent pointer at 4, the non-persistent 6 is newer
    assert seen["non_persistent_load"] == 6

    # strictness: megatron.core calls a key in the checkpoint that the model does not ask
    # for "missing", one the model asks for that the checkpoint lacks "unexpected"
    assert seen["default"] == (2, 1e-3, {1e-3})
    assert seen["raise_unexpected"] == (2, 1e-3, {1e-3})
    assert "--dist-ckpt-strictness raise_all" in seen["raise_all"]
    assert "extra.weight" in seen["raise_all"] and "Missing keys" in seen["raise_all"]
    assert "--dist-ckpt-strictness raise_unexpected" in seen["raise_unexpected_asked"]
    assert "probe.weight" in seen["raise_unexpected_asked"]
    assert "extra.weight" not in seen["raise_unexpected_asked"]

    # the lr schedule: must agree by default, else from the checkpoint or from the flags
    assert "--lr 0.002 vs 0.001" in seen["lr_differs"]
    assert "--use-checkpoint-opt_param-scheduler" in seen["lr_differs"]
    assert seen["lr_from_checkpoint"] == (2, 1e-3, {1e-3})
    assert seen["lr_from_flags"] == (2, 2e-3, {2e-3})
    assert "--decoupled-lr/--decoupled-min-lr 0.004/0.0 vs 0.003/0.0" in seen["decoupled_differs"]
    assert seen["decoupled_from_checkpoint"] == (2, 1e-3, {1e-3, 3e-3})
    assert seen["decoupled_from_flags"] == (2, 1e-3, {1e-3, 4e-3})


@pytest.mark.parametrize("flags, message", [
    (["--ckpt-format", "torch_dcp"], "--ckpt-format torch_dcp: only torch_dist and torch"),
    (["--ckpt-format", "torch", "--async-save"], "--async-save needs --ckpt-format torch_dist"),
    (["--use-persistent-ckpt-worker"], "--use-persistent-ckpt-worker needs --async-save"),
    (["--use-checkpoint-opt_param-scheduler", "--override-opt_param-scheduler"],
     "mutually exclusive"),
    (["--save-retain-interval", "4"], "--save-retain-interval 4 needs --save DIR"),
    (["--non-persistent-save-interval", "2", "--save", "d"],
     "--non-persistent-save-interval needs --non-persistent-ckpt-type global"),
    (["--non-persistent-ckpt-type", "local"], "--non-persistent-ckpt-type local: only global"),
])
def test_checkpoint_flags_that_cannot_be_honoured_are_refused(flags, message):
    with pytest.raises(ArgumentError, match=message.replace("-", r"\-")):
        parse_args(with_flags(TINY, train_iters=2) + flags, world_size=1)


def test_persistent_worker_without_a_gpu_is_refused():
    config = dataclasses.replace(checkpointing.CheckpointConfig(), async_save=True,
                                 persistent_worker=True)
    with pytest.raises(checkpointing.CheckpointError, match="needs a CUDA GPU"):
        checkpointing.Checkpointer(config, use_gpu=False)


def test_fully_reshardable_optimizer_state_without_fused_adam_is_refused():
    config = checkpointing.CheckpointConfig(distributed_optimizer=True,
                                            optim_fully_reshardable=True)
    if checkpointing._fused_adam_available():
        pytest.skip("Apex or Transformer Engine is installed: the flag is honoured")
    with pytest.raises(checkpointing.CheckpointError,
                       match="--dist-ckpt-optim-fully-reshardable needs Apex or Transformer"):
        checkpointing.Checkpointer(config, use_gpu=False)
