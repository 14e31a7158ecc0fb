"""Megatron-LM flags of the second batch, each by its effect: the step batch-size
schedule followed by the training loop, megatron-core settings that reach the core config
and change what the schedule or DDP does, and the refusals that name what cannot be
honoured. All training runs share one pair of processes (`train_runs`)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from tests.distributed import run_ranks
from tests.trainer_runs import TINY, train_runs, with_flags

DP2 = with_flags(TINY, global_batch_size=8, train_iters=2, lr=1e-2, lr_decay_style="constant")
PP2 = with_flags(DP2, pipeline_model_parallel_size=2)
# 64 tokens = 4 samples of --seq-length 16; 4 per step (micro-batch 2 x 2 replicas), then 8
STEPS = with_flags(DP2, global_batch_size=None, train_iters=None, train_samples=28,
                   step_batch_size_schedule="0:4 128:8")


HASHED = with_flags(DP2, check_weight_hash_across_dp_replicas_interval=1)
# the distributed optimizer's all-gather, deferred to the next forward, is completed before
# hashing (else each replica would show only its own shard updated)
HASHED_LAZY = HASHED + ["--use-distributed-optimizer", "--overlap-param-gather",
                        "--disable-gloo-process-groups"]
INSTANCES = DP2 + ["--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2"]
# 2 stages x 2 virtual stages, 4 microbatches (one replica: the gather is megatron-core's
# code path all the same)
INTERLEAVED = with_flags(PP2, num_layers_per_virtual_pipeline_stage=1) + [
    "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
GATHER_IN_STEP = INTERLEAVED + ["--overlap-param-gather-with-optimizer-step"]
QK = DP2 + ["--qk-layernorm"]
# 5 microbatches over 2 stages x 2 virtual stages: megatron-core's default groups of 2 leave
# a last group of 1 (refused); groups of 5, or of 3 then 2, are its valid orders
FIVE = with_flags(PP2, num_layers_per_virtual_pipeline_stage=1, global_batch_size=10)
TWO_GPUS = torch.cuda.device_count() >= 2
SHARDED = DP2 + ["--use-distributed-optimizer"]


def _probe(rank, flags, world_size, nudge: str | None) -> dict:
    """Set up and train `flags` (on rank 1 the first weight whose name contains `nudge`
    nudged first); what the run built and the replica check it raised."""
    from megatron.core import parallel_state

    from megatron.trainer.config.arguments import parse_args
    from megatron.trainer.run import training
    from megatron.trainer.run.replica_check import ReplicaMismatch
    from megatron.trainer.tasks.gpt import GPT_TASK

    with contextlib.ExitStack() as stack:
        trainer = training.setup(GPT_TASK, parse_args(flags, world_size=world_size), stack)
        optimizer = getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer])[0]
        sharded_over = getattr(optimizer, "data_parallel_group", None)  # distributed optimizer
        facts = {"gloo_groups": parallel_state._DATA_PARALLEL_GROUP_GLOO is not None,
                 "optimizer_shards": sharded_over and sharded_over.size(), "caught": None,
                 "optimizers": len(getattr(trainer.optimizer, "chained_optimizers", [None])),
                 "gathers_in_step": [chunk.overlap_param_gather_with_optimizer_step
                                     for chunk in trainer.model]}
        names = [name for chunk in trainer.model for name, _ in chunk.named_parameters()]
        facts["qk_norms"] = sum("q_layernorm" in name or "k_layernorm" in name for name in names)
        if nudge and rank == 1:
            with torch.no_grad():
                next(p for name, p in trainer.model[0].named_parameters()
                     if nudge in name).view(-1)[0] += 1e-3
        try:
            training.train(trainer)
        except ReplicaMismatch as error:
            facts["caught"] = (str(error), trainer.state.iteration)
        except AssertionError as error:  # megatron-core's --test-mode checks
            facts["caught"] = (str(error), trainer.state.iteration)
        saver = trainer.checkpointer and trainer.checkpointer._save_strategy
        saver = getattr(saver, "base_strategy", saver)  # inside the fully parallel wrapper
        facts["plan_reused"] = bool(saver and saver.validated_cache_reuse)
    return facts


def _probes_then_runs(rank, probes, runs, world_size):
    from megatron.trainer.run import initialize
    from tests import trainer_runs

    initialize._shutdown = trainer_runs._destroy_model_parallel_only
    facts = {name: _probe(rank, flags, world_size, nudge) for name, (flags, nudge)
             in probes.items()}
    return {"probes": facts, "runs": train_runs(rank, runs, world_size)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return str(tmp_path_factory.mktemp("constant_structure"))


def _constant(save_dir):
    return with_flags(DP2, train_iters=4, exit_interval=3, save=save_dir, save_interval=1) + [
        "--ckpt-assume-constant-structure", "--verify-integrity"]


@pytest.fixture(scope="module")
def ranks(saved):
    probes = {"constant": (_constant(saved), None),
              "test_mode": (QK + ["--test-mode"], "q_layernorm.weight"),"nudged": (HASHED, "word_embeddings"), "lazy_gather": (HASHED_LAZY, None),
              "sharded": (SHARDED, None), "gather_in_step": (GATHER_IN_STEP, None)}
    configs = {
        "steps": STEPS,
        "hashed": HASHED,
        "sharded": SHARDED,
        "interleaved": INTERLEAVED,
        "gather_in_step": GATHER_IN_STEP,
        "resumed": with_flags(DP2, train_iters=4, load=saved) + ["--verify-integrity"],
        "continuous": with_flags(DP2, train_iters=4),
        "qk": QK,
        "group5": with_flags(FIVE, microbatch_group_size_per_virtual_pipeline_stage=5),
        "group3": with_flags(FIVE, microbatch_group_size_per_virtual_pipeline_stage=3),
        "qk_test_mode": QK + ["--test-mode"],
    }
    results = run_ranks(2, _probes_then_runs, probes, list(configs.values()), 2)
    return [{"probes": r["probes"], "runs": dict(zip(configs, r["runs"], strict=True))}
            for r in results]


@pytest.fixture(scope="module")
def runs(ranks):
    return ranks[-1]["runs"]


def _parse_error(argv, world_size=2, model="gpt", **overrides) -> str:
    from megatron.trainer.config.arguments import ArgumentError, parse_args

    with pytest.raises(ArgumentError) as error:
        parse_args(with_flags(argv, **overrides), world_size=world_size, model=model)
    return str(error.value)


def test_step_batch_size_schedule_sets_each_steps_global_batch(runs):
    from megatron.trainer.config.arguments import parse_args

    args = parse_args(STEPS, world_size=2)
    # the steps through the schedule until --train-samples are consumed (as Megatron-LM)
    assert (args.global_batch_size, args.train_iters) == (8, 5)
    assert runs["steps"]["batches"] == [4, 4, 8, 8, 8]
    assert runs["steps"]["state"]["consumed_samples"] == 32
    # the final size may be repeated in --global-batch-size, nothing else
    assert parse_args(with_flags(STEPS, global_batch_size=8), world_size=2).train_iters == 5
    assert "differs from the final size 8" in _parse_error(STEPS, global_batch_size=16)
    assert "exclude each other" in _parse_error(STEPS, rampup_batch_size=[4, 4, 8])
    assert "global batch size 6 (from iteration 1) is not divisible by --micro-batch-size 2 x " \
        "data-parallel size 2" in _parse_error(STEPS, step_batch_size_schedule="0:6 128:8")
    assert "the first threshold must be 0" in _parse_error(STEPS,
                                                           step_batch_size_schedule="64:4")


@pytest.mark.slow
def test_weight_hash_check_stops_replicas_that_differ(ranks, runs):
    for rank in ranks:
        message, iteration = rank["probes"]["nudged"]["caught"]
        assert iteration == 1  # the first check
        assert "after iteration 1 the data-parallel replicas (global ranks [0, 1]) hold " \
            "different weights" in message
        assert "chunk 0 module.embedding.word_embeddings.weight: ranks [0] vs ranks [1]" \
            in message
        assert rank["probes"]["lazy_gather"]["caught"] is None
    # unperturbed replicas pass every check and train on
    assert len(runs["hashed"]["losses"]) == 2
    assert "must be >= 1" in _parse_error(DP2, check_weight_hash_across_dp_replicas_interval=0)


@pytest.mark.slow
def test_disable_gloo_process_groups_reaches_megatron_core(ranks):
    probes = ranks[0]["probes"]
    assert probes["sharded"]["gloo_groups"] and not probes["lazy_gather"]["gloo_groups"]
    assert probes["sharded"]["optimizer_shards"] == 2
    assert "cannot save or load --ckpt-format torch" in _parse_error(
        SHARDED, disable_gloo_process_groups=True, ckpt_format="torch", save="/tmp/x")


@pytest.mark.slow
@pytest.mark.skipif(not TWO_GPUS, reason="megatron-core reduces between distributed-optimizer "
                    "instances on a CUDA stream: needs 2 GPUs")
def test_optimizer_instances_each_keep_the_whole_state():
    probes = [r["probes"] for r in run_ranks(2, _probes_then_runs, {
        "instances": (INSTANCES, None), "sharded": (SHARDED, None)}, [], 2, gpu=True)]
    for rank in probes:
        # two instances of one rank each: every rank keeps the whole optimizer state
        assert (rank["sharded"]["optimizer_shards"], rank["instances"]["optimizer_shards"]) \
            == (2, 1)


def test_optimizer_instances_are_validated(monkeypatch):
    from megatron.trainer.config import fast_path
    from megatron.trainer.config.arguments import ArgumentError, parse_args
    from megatron.trainer.run import training
    from megatron.trainer.tasks.gpt import GPT_TASK

    args = parse_args(INSTANCES, world_size=2)
    assert args.num_distributed_optimizer_instances == 2
    monkeypatch.setattr(fast_path, "on_gpu", lambda *a: False)
    with pytest.raises(ArgumentError, match="--num-distributed-optimizer-instances 2 needs GPUs"):
        training.setup(GPT_TASK, args, contextlib.ExitStack())
    assert "needs --use-distributed-optimizer" in _parse_error(
        DP2, num_distributed_optimizer_instances=2)
    assert "does not divide the data-parallel size 2" in _parse_error(
        SHARDED, num_distributed_optimizer_instances=3)
    assert "cannot save or load --ckpt-format torch" in _parse_error(
        SHARDED, disable_gloo_process_groups=True, ckpt_format="torch", save="/tmp/x")


@pytest.mark.slow
def test_param_gather_with_optimizer_step_trains_as_without(ranks, runs):
    # megatron-core splits the optimizer: the first chunk's own, whose step starts its gather
    facts = ranks[0]["probes"]["gather_in_step"]
    assert (facts["optimizers"], facts["gathers_in_step"]) == (2, [True, False])
    assert ranks[0]["probes"]["sharded"]["gathers_in_step"] == [False]
    assert len(runs["interleaved"]["losses"]) == 2
    assert runs["gather_in_step"]["losses"] == runs["interleaved"]["losses"]
    message = _parse_error(with_flags(GATHER_IN_STEP, num_layers_per_virtual_pipeline_stage=None))
    assert "--overlap-param-gather-with-optimizer-step needs virtual pipeline stages" in message
    assert "--ckpt-format torch" in _parse_error(GATHER_IN_STEP, save="/tmp/x")
    assert "not --use-dpp" in _parse_error(GATHER_IN_STEP, use_dpp=True)


@pytest.mark.slow
def test_constant_structure_saves_reuse_the_plan_and_load(ranks, runs):
    # three saves: the second validates the first's plan, the third reuses it
    assert all(rank["probes"]["constant"]["plan_reused"] for rank in ranks)
    assert not ranks[0]["probes"]["sharded"]["plan_reused"]
    assert runs["resumed"]["losses"] == runs["continuous"]["losses"][3:]
    assert "--ckpt-format torch has none" in _parse_error(
        DP2, ckpt_assume_constant_structure=True, ckpt_format="torch")
    assert "--async-strategy nvrx: only mcore" in _parse_error(DP2, async_strategy="nvrx")


@pytest.mark.slow
def test_qk_layernorm_normalizes_queries_and_keys_and_test_mode_checks_them(ranks, runs):
    probes = ranks[0]["probes"]
    # a q and a k norm (weight and bias each) in each of the 4 layers
    assert (probes["sharded"]["qk_norms"], probes["test_mode"]["qk_norms"]) == (0, 16)
    assert runs["qk"]["losses"][0] != runs["continuous"]["losses"][0]
    # the checks change nothing when the replicas agree, and stop a replica that drifted
    assert runs["qk_test_mode"]["losses"] == runs["qk"]["losses"]
    message, iteration = probes["test_mode"]["caught"]
    assert iteration == 0 and "Discrepancy between q_w in DP ranks" in message
    assert "megatron-core's BERT layer specs" in _parse_error(QK, model="bert")
    assert "--test-mode: it checks only the q/k norms" in _parse_error(DP2, test_mode=True)
    assert "not --use-dpp" in _parse_error(with_flags(QK, use_dpp=True), test_mode=True)


def test_microbatch_groups_reorder_the_interleaved_schedule_with_the_same_losses(runs):
    assert len(runs["group5"]["losses"]) == 2
    for five, three in zip(runs["group5"]["losses"], runs["group3"]["losses"], strict=True):
        assert three["lm loss"] == pytest.approx(five["lm loss"], rel=1e-6)
    assert "gives 5 microbatches" in _parse_error(FIVE)  # the default groups of 2
    assert "need at least --microbatch-group-size-per-virtual-pipeline-stage 6" in \
        _parse_error(FIVE, microbatch_group_size_per_virtual_pipeline_stage=6)
    assert "--use-dpp runs the microbatches of a virtual stage in groups" in _parse_error(
        FIVE, microbatch_group_size_per_virtual_pipeline_stage=5, use_dpp=True)


def test_warmup_flush_overlap_reaches_the_interleaved_schedule():
    from megatron.trainer.config.arguments import parse_args
    from megatron.trainer.config.configs import TrainerConfigs
    from megatron.trainer.model.models import transformer_config

    flags = with_flags(DP2, pipeline_model_parallel_size=4, num_layers=8,
                       num_layers_per_virtual_pipeline_stage=1) + [
        "--overlap-p2p-communication-warmup-flush"]
    config = transformer_config(TrainerConfigs.from_args(parse_args(flags, world_size=4)))
    # megatron-core accepts the warm-up/flush overlap only on overlapped, unbatched p2p
    assert (config.overlap_p2p_comm_warmup_flush, config.overlap_p2p_comm,
            config.batch_p2p_comm) == (True, True, False)
    assert "the one neighbour would match activations and gradients" in _parse_error(
        with_flags(FIVE, overlap_p2p_communication_warmup_flush=True))
    assert "needs virtual pipeline stages and not --use-dpp" in _parse_error(
        DP2, overlap_p2p_communication_warmup_flush=True)


def test_verify_integrity_manifest_is_written_checked_and_catches_a_changed_file(
        runs, saved, tmp_path):
    import os
    import shutil

    from megatron.trainer.checkpoint.checkpoint_publish import (
        INTEGRITY_MANIFEST,
        integrity_problem,
    )

    # every save of the run wrote one; the resumed run loaded iteration 3 through the check
    for iteration in (1, 2, 3):
        saved_dir = os.path.join(saved, f"iter_{iteration:07d}")
        assert os.path.isfile(os.path.join(saved_dir, INTEGRITY_MANIFEST))
    assert any("every file matches its SHA-256" in m for _, m in runs["resumed"]["logs"])
    copy = shutil.copytree(saved_dir, tmp_path / "copy")
    assert integrity_problem(str(copy)) is None
    victim = sorted(p for p in copy.rglob("*") if p.is_file() and p.name != INTEGRITY_MANIFEST)[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 1
    victim.write_bytes(bytes(data))
    problem = integrity_problem(str(copy))
    assert f"{victim.relative_to(copy)}: SHA-256 differs from the manifest" in problem
    os.remove(copy / INTEGRITY_MANIFEST)
    assert "saved without --verify-integrity" in integrity_problem(str(copy))
    assert "--verify-integrity needs --save or --load" in _parse_error(DP2, verify_integrity=True)
