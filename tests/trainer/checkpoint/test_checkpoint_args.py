"""--use-checkpoint-args, --auto-detect-ckpt-format, --async-ckpt-use-cpu-shm and
--eval-global-batch-size, each by its effect: a run resumed with the checkpoint's arguments
builds the checkpoint's model from another command line and continues the uninterrupted
run's losses; a checkpoint without saved arguments is an error naming it; --ckpt-format
torch loads a torch_dist checkpoint only with --auto-detect-ckpt-format; an asynchronous
save staged in shared memory writes a checkpoint that resumes exactly; evaluation reads
--eval-global-batch-size samples per iteration."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from megatron.trainer.checkpoint import checkpoint_load, checkpointing
from megatron.trainer.checkpoint.checkpoint_config import CheckpointConfig
from megatron.trainer.config.arguments import ArgumentError, parse_args
from tests.distributed import run_ranks
from tests.trainer_runs import TINY, train_runs, with_flags

ITERS, SAVE_AT = 4, 2
# the architecture the checkpoints are saved with: every flag below differs from the
# command line of the resumed run, which gives none of the sizes
SAVED = with_flags(TINY, num_layers=2, hidden_size=48, num_attention_heads=4, swiglu=True,
                   normalization="RMSNorm", untie_embeddings_and_output_weights=True,
                   hidden_dropout=0.1, attention_dropout=0.1, global_batch_size=8,
                   train_iters=ITERS, pipeline_model_parallel_size=2)
OTHER = with_flags(SAVED, num_layers=None, hidden_size=None, num_attention_heads=None,
                   swiglu=None, normalization="LayerNorm",
                   untie_embeddings_and_output_weights=None, attention_dropout=0.0,
                   pipeline_model_parallel_size=1)
FROM_CHECKPOINT = ["--use-checkpoint-args", "--use-mp-args-from-checkpoint-args"]


def _losses(run):
    return [step["lm loss"] for step in run["losses"]]


def _recording_shared_memory_staging(rank, runs, world_size):
    """train_runs, recording what each --async-ckpt-use-cpu-shm staging handed the writer."""
    staged = []
    stage = checkpointing._staged_in_shared_memory

    def recording(request):
        result = stage(request)
        before = [t for _, _, (_, data) in request.async_fn_args[1] for _, t in data]
        after = [t for _, _, (_, data) in result.async_fn_args[1] for _, t in data]
        staged.append({
            "tensors": len(after),
            "shared": all(t.is_shared() for t in after),
            "copies": all(a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
                          for a, b in zip(before, after, strict=True)),
            "equal": all(torch.equal(a.detach().cpu(), b)
                         for a, b in zip(before, after, strict=True)),
            "preload_left": result.preload_fn is not None,
        })
        return result

    checkpointing._staged_in_shared_memory = recording
    return train_runs(rank, runs, world_size), staged


@pytest.fixture(scope="module")
def saved_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoint_args")
    whole, parts, shm = (str(root / name) for name in ("whole", "parts", "shm"))
    torch_format = str(root / "torch_format")
    runs = [
        with_flags(SAVED, save=whole, save_interval=SAVE_AT),
        with_flags(SAVED, save=parts, save_interval=SAVE_AT, exit_interval=SAVE_AT),
        # --ckpt-format torch resumes the torch_dist checkpoint with the detection
        with_flags(SAVED, load=parts, ckpt_format="torch", auto_detect_ckpt_format=True),
        with_flags(OTHER, save=parts, load=parts, save_interval=SAVE_AT) + FROM_CHECKPOINT,
        with_flags(SAVED, save=torch_format, save_interval=SAVE_AT, ckpt_format="torch",
                   exit_interval=SAVE_AT),
        # the torch-format checkpoint resumed with the default format, which detects it
        with_flags(SAVED, load=torch_format),
        with_flags(SAVED, save=shm, save_interval=SAVE_AT, exit_interval=SAVE_AT,
                   async_save=True, async_ckpt_use_cpu_shm=True),
        with_flags(SAVED, load=shm),
    ]
    results, staged = run_ranks(2, _recording_shared_memory_staging, runs, 2)[-1]
    return root, results, staged


@pytest.mark.slow
def test_resumed_with_the_checkpoints_arguments_continues_the_run(saved_runs):
    root, (whole, stopped, _, resumed, *_), _ = saved_runs
    assert len(_losses(whole)) == ITERS
    assert _losses(stopped) == _losses(whole)[:SAVE_AT]
    # the model, the dropout and the pipeline split all came from the checkpoint
    assert _losses(resumed) == _losses(whole)[SAVE_AT:]
    messages = [message for _, message in resumed["logs"]]
    path = f"{root}/parts/iter_{SAVE_AT:07d}"
    for expected in ("--num-layers 2 from", "--hidden-size 48 from",
                     "--normalization RMSNorm from", "--swiglu True from",
                     "--attention-dropout 0.1 from", "--pipeline-model-parallel-size 2 from"):
        assert any(m.startswith(f"--use-checkpoint-args: {expected} {path}") for m in messages), \
            expected
    assert "(command line: was LayerNorm)" in next(m for m in messages if "RMSNorm" in m)


@pytest.mark.slow
def test_checkpoint_arguments_fill_in_replace_or_yield_to_the_command_line(saved_runs, caplog):
    root, _, _ = saved_runs
    for checkpoint in ("parts", "torch_format"):  # torch_dist and torch
        flags = with_flags(OTHER, load=root / checkpoint, seq_length=8,
                           tokenizer_type="GPT2BPETokenizer", vocab_size=None)
        with caplog.at_level(logging.INFO, logger="megatron.trainer"):
            args = parse_args(flags + ["--use-checkpoint-args"], world_size=2)
        assert (args.num_layers, args.hidden_size, args.ffn_hidden_size) == (2, 48, 128)
        assert (args.normalization, args.swiglu, args.untie_embeddings_and_output_weights) == (
            "RMSNorm", True, True)
        # the tokenizer and its vocabulary size come from the checkpoint too
        assert (args.tokenizer_type, args.vocab_size) == ("NullTokenizer", 128)
        # a size given on the command line stays (as in Megatron-LM), with a warning
        assert args.seq_length == 8
        assert any("--seq-length 8 on the command line differs from 16" in r.getMessage()
                   for r in caplog.records if r.levelno == logging.WARNING)
        # the parallel sizes only with --use-mp-args-from-checkpoint-args
        assert args.pipeline_model_parallel_size == 1
        caplog.clear()


@pytest.mark.slow
def test_checkpoint_without_saved_arguments_is_an_error_naming_it(saved_runs, tmp_path, caplog):
    root, _, _ = saved_runs
    path = f"{root}/torch_format/iter_{SAVE_AT:07d}"
    filename = f"{path}/mp_rank_00_000/model_optim_rng.pt"
    state = torch.load(filename, weights_only=False)
    original = dict(state)
    del state["args"]
    torch.save(state, filename)
    try:
        with pytest.raises(checkpointing.CheckpointError,
                           match=f"--use-checkpoint-args: {path} holds no saved arguments"):
            parse_args(with_flags(OTHER, load=f"{root}/torch_format") + FROM_CHECKPOINT,
                       world_size=2)
    finally:
        torch.save(original, filename)
    # no checkpoint at all: the command line's arguments, with a warning (as Megatron-LM)
    with caplog.at_level(logging.WARNING, logger="megatron.trainer"):
        args = parse_args(with_flags(SAVED, load=tmp_path) + FROM_CHECKPOINT, world_size=2)
    assert args.num_layers == 2
    assert f"--use-checkpoint-args: no checkpoint under {tmp_path}" in caplog.text
    # and without one the sizes must be on the command line
    with pytest.raises(ArgumentError, match="required: --num-layers, --hidden-size"):
        parse_args(with_flags(OTHER, load=tmp_path) + FROM_CHECKPOINT, world_size=2)


@pytest.mark.slow
def test_checkpoint_format_is_detected_only_where_megatron_lm_detects_it(saved_runs):
    root, (whole, _, auto_detected, _, _, torch_resumed, *_), _ = saved_runs
    assert _losses(auto_detected) == _losses(whole)[SAVE_AT:]
    assert _losses(torch_resumed) == _losses(whole)[SAVE_AT:]
    torch_dist = f"{root}/parts/iter_{SAVE_AT:07d}"
    torch_format = f"{root}/torch_format/iter_{SAVE_AT:07d}"
    assert sorted(os.listdir(torch_format)) == ["mp_rank_00_000", "mp_rank_00_001"]
    assert checkpoint_load.checkpoint_format(torch_format, CheckpointConfig()) == "torch"
    assert checkpoint_load.checkpoint_format(
        torch_dist, CheckpointConfig(format="torch", auto_detect_format=True)) == "torch_dist"
    with pytest.raises(checkpointing.CheckpointError,
                       match=f"{torch_dist} is a torch_dist checkpoint but --ckpt-format torch "
                             "reads only torch-format ones: give --auto-detect-ckpt-format"):
        checkpoint_load.checkpoint_format(torch_dist, CheckpointConfig(format="torch"))


@pytest.mark.slow
def test_async_save_staged_in_shared_memory_resumes_exactly(saved_runs):
    _, results, staged = saved_runs
    whole, resumed = results[0], results[-1]
    assert _losses(resumed) == _losses(whole)[SAVE_AT:]
    # one staging per save on this rank (at SAVE_AT only): every tensor the writer gets is
    # a copy in shared memory, equal to the one it replaces, and nothing is left to stage
    assert len(staged) == 1 and staged[0]["tensors"] > 0, staged
    assert staged[0] == {"tensors": staged[0]["tensors"], "shared": True, "copies": True,
                         "equal": True, "preload_left": False}


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="megatron-core's persistent "
                    "checkpoint worker selects a CUDA device when it starts")
@pytest.mark.long
def test_persistent_worker_writes_shared_memory_copies_that_resume_exactly(tmp_path):
    # the case the flag is for: without it the worker process receives the GPU tensors
    # through CUDA IPC and copies them to the host itself
    flags = with_flags(TINY, global_batch_size=4, train_iters=ITERS, save_interval=SAVE_AT,
                       async_save=True, use_persistent_ckpt_worker=True,
                       async_ckpt_use_cpu_shm=True)
    whole, parts = str(tmp_path / "whole"), str(tmp_path / "parts")
    runs = [with_flags(flags, save=whole), with_flags(flags, save=parts, exit_interval=SAVE_AT),
            with_flags(flags, save=parts, load=parts)]
    results, staged = run_ranks(1, _recording_shared_memory_staging, runs, 1, gpu=True)[0]
    uninterrupted, stopped, resumed = results
    assert _losses(stopped) == _losses(uninterrupted)[:SAVE_AT]
    assert _losses(resumed) == _losses(uninterrupted)[SAVE_AT:]
    # saves at 2 and 4, at 2, at 4
    assert len(staged) == 4, staged
    assert all(s["shared"] and s["copies"] and s["equal"] and not s["preload_left"]
               for s in staged), staged


@pytest.mark.parametrize("flags, message", [
    (["--use-checkpoint-args"], "--use-checkpoint-args needs --load DIR"),
    (["--use-mp-args-from-checkpoint-args"],
     "--use-mp-args-from-checkpoint-args needs --use-checkpoint-args"),
    (["--async-ckpt-use-cpu-shm", "--save", "d"], "--async-ckpt-use-cpu-shm stages the "
                                                  "tensors of --async-save"),
    (["--eval-global-batch-size", "3"], "--eval-global-batch-size 3 is not a multiple of "
                                        "--micro-batch-size 2"),
])
def test_flags_without_what_they_need_are_refused(flags, message):
    with pytest.raises(ArgumentError, match=message.replace("-", r"\-")):
        parse_args(with_flags(TINY, train_iters=2) + flags, world_size=1)


def _validation_losses(run):
    return [m for _, m in run["logs"] if m.startswith("validation at iteration")]


def test_eval_global_batch_size_sets_the_samples_of_each_evaluation_iteration():
    # 2 evaluation iterations of 4 samples read the same 8 samples as 1 iteration of 8 (the
    # training batch), and give the same loss; 1 iteration of 4 reads half of them
    flags = with_flags(TINY, global_batch_size=8, train_iters=2, eval_interval=2)
    runs = [with_flags(flags, eval_iters=2, eval_global_batch_size=4),
            with_flags(flags, eval_iters=1),
            with_flags(flags, eval_iters=1, eval_global_batch_size=4)]
    four_twice, eight_once, four_once = run_ranks(1, train_runs, runs, 1)[0]
    value = [float(_validation_losses(run)[0].split("lm loss value: ")[1].split(" ")[0])
             for run in (four_twice, eight_once, four_once)]
    assert value[0] == pytest.approx(value[1], rel=1e-6)
    assert value[2] != pytest.approx(value[1], rel=1e-4)
    assert _losses(four_twice) == _losses(eight_once) == _losses(four_once)
