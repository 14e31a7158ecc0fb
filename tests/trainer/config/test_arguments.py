"""Flag validation: every inconsistent value stops with one message naming the flags and
values; a Megatron-LM user's GPT flag set is accepted and trains."""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys

import pytest
import torch

from megatron.trainer.config.args_common import add_flags
from megatron.trainer.config.arguments import ArgumentError, parse_args
from tests import REPO
from tests.distributed import run_ranks
from tests.trainer_runs import TINY, train_run, with_flags

BASE = with_flags(TINY, train_iters=2)


def _error(flags, world_size=1) -> str:
    with pytest.raises(ArgumentError) as caught:
        parse_args(flags, world_size=world_size)
    return str(caught.value)


BAD_VALUES = {
    # name: (flag overrides, world size, fragments the message must contain)
    "layers_vs_pp": (dict(num_layers=5, pipeline_model_parallel_size=2), 2,
                     ["--num-layers 5", "--pipeline-model-parallel-size 2"]),
    "layers_vs_pp_x_vpp": (
        dict(num_layers=6, pipeline_model_parallel_size=2,
             virtual_pipeline_model_parallel_size=2, global_batch_size=4), 2,
        ["--num-layers 6", "--pipeline-model-parallel-size 2",
         "--virtual-pipeline-model-parallel-size 2"]),
    "layers_vs_pp_x_layers_per_chunk": (
        dict(num_layers=6, pipeline_model_parallel_size=2,
             num_layers_per_virtual_pipeline_stage=2, global_batch_size=4), 2,
        ["--num-layers 6", "--num-layers-per-virtual-pipeline-stage 2"]),
    "global_batch_vs_micro_x_dp": (dict(global_batch_size=6, micro_batch_size=2), 2,
                                   ["--global-batch-size 6", "--micro-batch-size 2",
                                    "data-parallel size 2"]),
    "tp_vs_heads": (dict(tensor_model_parallel_size=3, num_attention_heads=4,
                         hidden_size=48), 3,
                    ["--tensor-model-parallel-size 3", "--num-attention-heads 4"]),
    "world_vs_model_parallel": (dict(pipeline_model_parallel_size=2), 3,
                                ["world size 3", "--pipeline-model-parallel-size 2"]),
    "null_tokenizer_without_vocab_size": (dict(vocab_size=None), 1,
                                          ["NullTokenizer", "--vocab-size"]),
    "no_data": (dict(mock_data=None), 1, ["--data-path", "--mock-data"]),
    "bad_node_ip": (dict(node_ips="10.0.0.300"), 1, ["--node-ips", "10.0.0.300"]),
    "workload_retired": (dict(workload=4), 1, ["--workload 4", "--dpp-transport"]),
    "num_gpus_retired": (dict(num_gpus=8), 1, ["--num-gpus 8", "--nproc_per_node"]),
    "dpp_without_pipeline": (dict(use_dpp=True), 1,
                             ["--use-dpp", "--pipeline-model-parallel-size"]),
    "save_interval_without_save": (dict(save_interval=5), 1, ["--save-interval 5", "--save"]),
    "dpp_with_param_gather_overlap": (
        dict(use_dpp=True, pipeline_model_parallel_size=2, overlap_param_gather=True), 2,
        ["--overlap-param-gather", "--use-dpp"]),
    # uneven pipeline split (megatron-core's rules for num_layers_in_first/last_pipeline_stage)
    "uneven_rest_not_divisible": (
        dict(num_layers=5, pipeline_model_parallel_size=3, decoder_first_pipeline_num_layers=2),
        3, ["--num-layers 5 minus --decoder-first-pipeline-num-layers 2 leaves 3 layers for the "
            "2 remaining stages of --pipeline-model-parallel-size 3", "divide evenly"]),
    "uneven_leaves_a_stage_empty": (
        dict(pipeline_model_parallel_size=2, decoder_first_pipeline_num_layers=4), 2,
        ["--decoder-first-pipeline-num-layers 4 leaves 0 layers", "at least one layer each"]),
    "uneven_more_than_num_layers": (
        dict(pipeline_model_parallel_size=3, decoder_first_pipeline_num_layers=3,
             decoder_last_pipeline_num_layers=2), 3,
        ["minus --decoder-last-pipeline-num-layers 2 leaves -1 layers"]),
    "uneven_first_and_last_must_add_up": (
        dict(num_layers=5, pipeline_model_parallel_size=2, decoder_first_pipeline_num_layers=2,
             decoder_last_pipeline_num_layers=2), 2,
        ["--decoder-first-pipeline-num-layers 2 and --decoder-last-pipeline-num-layers 2 must "
         "add up to --num-layers 5"]),
    "uneven_zero_layers": (
        dict(pipeline_model_parallel_size=2, decoder_last_pipeline_num_layers=0), 2,
        ["--decoder-last-pipeline-num-layers 0 must be >= 1"]),
    "uneven_without_pipeline": (
        dict(decoder_first_pipeline_num_layers=4), 1,
        ["--decoder-first-pipeline-num-layers 4", "--pipeline-model-parallel-size > 1"]),
    "uneven_with_accounting": (
        dict(pipeline_model_parallel_size=2, decoder_first_pipeline_num_layers=3,
             account_for_loss_in_pipeline_split=True), 2,
        ["--decoder-first-pipeline-num-layers 3 and --account-for-loss-in-pipeline-split are "
         "mutually exclusive"]),
    "uneven_first_vs_vpp": (
        dict(num_layers=6, pipeline_model_parallel_size=2, decoder_first_pipeline_num_layers=3,
             virtual_pipeline_model_parallel_size=2, global_batch_size=4), 2,
        ["--decoder-first-pipeline-num-layers 3 is not divisible by "
         "--virtual-pipeline-model-parallel-size 2",
         "3 per stage is not divisible by --virtual-pipeline-model-parallel-size 2"]),
    "uneven_rest_per_stage_vs_vpp": (
        dict(num_layers=8, pipeline_model_parallel_size=3, decoder_first_pipeline_num_layers=2,
             virtual_pipeline_model_parallel_size=2, global_batch_size=6), 3,
        ["leaves 6 layers for the 2 remaining stages", "3 per stage is not divisible by "
         "--virtual-pipeline-model-parallel-size 2"]),
    "uneven_first_and_last_with_vpp_on_two_stages": (
        dict(num_layers=8, pipeline_model_parallel_size=2, decoder_first_pipeline_num_layers=4,
             decoder_last_pipeline_num_layers=4, virtual_pipeline_model_parallel_size=2,
             global_batch_size=4), 2,
        ["--decoder-first-pipeline-num-layers 4 and --decoder-last-pipeline-num-layers 4 with "
         "--virtual-pipeline-model-parallel-size 2 and --pipeline-model-parallel-size 2",
         "give only one"]),
    "uneven_with_layers_per_chunk": (
        dict(num_layers=6, pipeline_model_parallel_size=2, decoder_first_pipeline_num_layers=4,
             num_layers_per_virtual_pipeline_stage=1, global_batch_size=4), 2,
        ["--num-layers-per-virtual-pipeline-stage 1 cannot be combined with "
         "--decoder-first-pipeline-num-layers", "--virtual-pipeline-model-parallel-size"]),
    "embedding_in_split_vs_pp": (
        dict(pipeline_model_parallel_size=2, account_for_embedding_in_pipeline_split=True), 2,
        ["--num-layers 4 + 1 (--account-for-embedding-in-pipeline-split) is not divisible by "
         "--pipeline-model-parallel-size 2"]),
    "embedding_and_loss_in_split_vs_pp_x_vpp": (
        dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
             account_for_embedding_in_pipeline_split=True,
             account_for_loss_in_pipeline_split=True, global_batch_size=4), 2,
        ["--num-layers 4 + 1 (--account-for-embedding-in-pipeline-split) + 1 "
         "(--account-for-loss-in-pipeline-split) is not divisible by "
         "--pipeline-model-parallel-size 2 x --virtual-pipeline-model-parallel-size 2"]),
    # numbers out of range, all named before anything divides by them
    "ranges": (dict(train_iters=0, micro_batch_size=0, lr=-0.01, dpp_timeout=0,
                    global_batch_size=0, eval_iters=-1, hidden_dropout=1.0, adam_beta2=1.5,
                    distributed_timeout_minutes=0, log_interval=0), 1,
               ["--train-iters 0 must be >= 1", "--micro-batch-size 0 must be >= 1",
                "--lr -0.01 must be >= 0", "--dpp-timeout 0.0 must be > 0",
                "--global-batch-size 0 must be >= 1", "--eval-iters -1 must be >= 0",
                "--hidden-dropout 1.0 must be in [0, 1)", "--adam-beta2 1.5 must be in [0, 1)",
                "--distributed-timeout-minutes 0.0 must be > 0",
                "--log-interval 0 must be >= 1"]),
    "virtual_stages_without_pipeline": (dict(virtual_pipeline_model_parallel_size=2), 1,
                                        ["--virtual-pipeline-model-parallel-size 2 needs "
                                         "--pipeline-model-parallel-size > 1"]),
    "seed_beyond_numpy": (dict(seed=2**32 - 150, pipeline_model_parallel_size=2), 2,
                          [f"--seed {2**32 - 150} must be below {2**32 - 200}"]),
    "train_samples_below_one_batch": (dict(train_iters=None, train_samples=4,
                                           global_batch_size=8), 1,
                                      ["--train-samples 4 is less than one global batch"]),
    # virtual stages: megatron-core's interleaved schedule and DPP's policy run the
    # microbatches in groups of the pipeline size
    "vpp_microbatches_not_multiple_of_pp": (
        dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
             global_batch_size=14), 2,
        ["--global-batch-size 14 gives 7 microbatches", "--use-dpp both need a multiple of "
         "--pipeline-model-parallel-size 2"]),
    "vpp_microbatches_under_dpp": (
        dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
             global_batch_size=2, use_dpp=True), 2,
        ["--global-batch-size 2 gives 1 microbatches"]),
    "rampup_sizes_not_divisible": (
        dict(rampup_batch_size=[2, 1, 40], global_batch_size=8, train_iters=40), 1,
        ["--rampup-batch-size 2 1 40: global batch size 3 (from iteration 5) is not divisible "
         "by --micro-batch-size 2 x data-parallel size 1"]),
    "rampup_sizes_vs_virtual_stages": (
        dict(rampup_batch_size=[4, 2, 24], global_batch_size=8, train_iters=40,
             pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2), 2,
        ["--rampup-batch-size 4 2 24: global batch size 6 (from iteration 4) gives 3 "
         "microbatches"]),
    "rampup_start_not_below_global": (
        dict(rampup_batch_size=[8, 2, 16], global_batch_size=8), 1,
        ["--rampup-batch-size 8 2 16: the start must be below --global-batch-size 8"]),
    "rampup_increment_does_not_reach_global": (
        dict(rampup_batch_size=[2, 4, 16], global_batch_size=8), 1,
        ["--rampup-batch-size 2 4 16: --global-batch-size 8 minus the start is not a "
         "multiple of the increment"]),
    "rampup_zero_samples": (dict(rampup_batch_size=[2, 2, 0], global_batch_size=8), 1,
                            ["--rampup-batch-size 2 2 0: start, increment and samples must "
                             "be >= 1"]),
}


@pytest.mark.parametrize("case", list(BAD_VALUES))
def test_bad_value_names_flags_and_values(case):
    overrides, world, fragments = BAD_VALUES[case]
    message = _error(with_flags(BASE, **overrides), world)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in: {message}"


# the configuration errors a user met at run time before these checks, as the entry point
# reports them: one message naming the flag, argparse's exit status, no traceback
AT_START = {
    "train_iters_zero": (dict(train_iters=0), 1, "--train-iters 0 must be >= 1"),
    "micro_batch_size_zero": (dict(micro_batch_size=0), 1, "--micro-batch-size 0 must be >= 1"),
    "negative_lr": (dict(lr=-0.01), 1, "--lr -0.01 must be >= 0"),
    "dpp_timeout_zero": (dict(dpp_timeout=0, use_dpp=True, pipeline_model_parallel_size=2), 2,
                         "--dpp-timeout 0.0 must be > 0"),
    "seven_microbatches_with_virtual_stages": (
        dict(global_batch_size=14, pipeline_model_parallel_size=2,
             num_layers_per_virtual_pipeline_stage=1), 2,
        "--global-batch-size 14 gives 7 microbatches (--micro-batch-size 2 x data-parallel "
        "size 1); with virtual pipeline stages megatron-core's interleaved schedule and "
        "--use-dpp both need a multiple of --pipeline-model-parallel-size 2"),
    "rampup_size_breaks_late": (
        dict(rampup_batch_size=[2, 1, 40], micro_batch_size=1, global_batch_size=8,
             train_iters=40, pipeline_model_parallel_size=2,
             num_layers_per_virtual_pipeline_stage=1), 2,
        "--rampup-batch-size 2 1 40: global batch size 3 (from iteration 5) gives 3 "
        "microbatches"),
}


@pytest.mark.parametrize("case", list(AT_START))
def test_entry_point_reports_configuration_errors_in_one_message(case, capsys, monkeypatch):
    from megatron.trainer.run.training import pretrain
    from megatron.trainer.tasks.gpt import GPT_TASK

    overrides, world, message = AT_START[case]
    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(SystemExit) as exited:
        pretrain(GPT_TASK, with_flags(BASE, **overrides))
    assert exited.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()  # one line, however many problems
    assert message in line, line


def test_entry_point_script_exits_without_traceback():
    """The real script, as torchrun starts it: the message on stderr and nothing else."""
    flags = with_flags(BASE, train_iters=0)
    done = subprocess.run([sys.executable, "pretrain_gpt.py", *flags], cwd=REPO,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "WORLD_SIZE": "1"})
    assert done.returncode == 2
    # megatron-core >= 0.19 imports torch.utils.cpp_extension, which warns on a machine that has
    # a CUDA toolkit but no GPU (this one): torch's line, not the trainer's
    stderr = "".join(line for line in done.stderr.splitlines(keepends=True)
                     if "torch/utils/cpp_extension.py" not in line)
    assert stderr == "pretrain_gpt.py: --train-iters 0 must be >= 1\n"
    assert done.stdout == ""


def test_flag_table_keys_give_type_choices_and_default():
    parser = argparse.ArgumentParser()
    add_flags(parser, {
        "--window float = 1000": None, "--level int {0,1,2} = 0": "timers", "--on": None,
        "--impl {a,b}": None, "--split str = 9,1": None, "--no-x": dict(
            dest="x", action="store_false"),
    })
    args = parser.parse_args([])
    assert vars(args) == dict(window=1000, level=0, on=False, impl=None, split="9,1", x=True)
    assert type(args.window) is int  # the default as written, argparse's type for values
    args = parser.parse_args(["--window", "2", "--level", "2", "--on", "--impl", "b", "--no-x"])
    assert vars(args) == dict(window=2.0, level=2, on=True, impl="b", split="9,1", x=False)
    with pytest.raises(SystemExit):
        parser.parse_args(["--level", "3"])
    with pytest.raises(ValueError, match="'integer' is neither a type nor choices"):
        add_flags(parser, {"--bad integer": None})


def test_unknown_flag_is_named():
    message = _error(BASE + ["--num-layer", "4", "--no-such-flag"])
    assert "--num-layer" in message and "--no-such-flag" in message


def test_fp16_with_bf16():
    assert "--fp16 and --bf16" in _error(BASE + ["--fp16", "--bf16"])


@pytest.mark.parametrize("impl", ["native", "triton"])
@pytest.mark.parametrize("precision", [[], ["--fp16"], ["--bf16"]], ids=["fp32", "fp16", "bf16"])
def test_cross_entropy_fusion_precision(impl, precision):
    """megatron-core's native fusion rounds the gradient to bf16: --bf16 only. The project's
    single pass keeps the logits' dtype: any precision."""
    flags = BASE + precision + ["--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", impl]
    if impl == "native" and precision != ["--bf16"]:
        assert "--cross-entropy-loss-fusion (native) needs --bf16" in _error(flags)
    else:
        parse_args(flags, world_size=1)  # accepted


def test_node_ips_count_must_match_nodes(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    flags = with_flags(BASE, pipeline_model_parallel_size=2)
    message = _error(with_flags(flags, node_ips=["10.0.0.1", "10.0.0.2"]), world_size=2)
    assert "--node-ips lists 2 addresses" in message and "1 nodes" in message
    parse_args(with_flags(flags, node_ips=["10.0.0.1"]), world_size=2)  # one node: accepted


def test_dpp_over_rdma_across_nodes_accepted(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    parse_args(with_flags(BASE, use_dpp=True, pipeline_model_parallel_size=2,
                          dpp_transport="rdma", multi_node=True,
                          node_ips=["10.0.0.1", "10.0.0.2"]), world_size=2)


def test_all_problems_in_one_message():
    message = _error(with_flags(BASE, num_layers=5, pipeline_model_parallel_size=2,
                                global_batch_size=3), world_size=2)
    assert "--num-layers 5" in message and "--global-batch-size 3" in message
    # the microbatch constraints of virtual stages come with the others
    message = _error(with_flags(BASE, pipeline_model_parallel_size=2, global_batch_size=14,
                                virtual_pipeline_model_parallel_size=2, fp16=True, bf16=True),
                     world_size=2)
    assert "--fp16 and --bf16" in message and "gives 7 microbatches" in message


def test_derived_values():
    args = parse_args(with_flags(BASE, pipeline_model_parallel_size=2, global_batch_size=16,
                                 num_layers=8, num_layers_per_virtual_pipeline_stage=2),
                      world_size=4)
    assert args.data_parallel_size == 2
    assert args.num_microbatches == 4
    assert args.virtual_pipeline_model_parallel_size == 2
    assert args.ffn_hidden_size == 4 * 32 and args.kv_channels == 8


def test_variable_lengths_with_virtual_stages_accepted():
    """megatron-core's interleaved schedule at PP=2 too (--seq-length-cv and
    --variable-seq-lengths): it no longer exchanges shapes with the one neighbour
    (core_compat/planned_p2p.py)."""
    for overrides, world in (
        (dict(use_dpp=True, pipeline_model_parallel_size=2, global_batch_size=8), 2),
        (dict(pipeline_model_parallel_size=2, global_batch_size=8), 2),
        (dict(pipeline_model_parallel_size=4, num_layers=8, global_batch_size=16), 4),
    ):
        parse_args(with_flags(BASE, seq_length_cv=0.5, virtual_pipeline_model_parallel_size=2,
                              **overrides), world_size=world)
    parse_args(with_flags(DOCUMENTS, pipeline_model_parallel_size=2,
                          virtual_pipeline_model_parallel_size=2, global_batch_size=8),
               world_size=2)


UNEVEN_ACCEPTED = {
    # name: (flag overrides, world size, virtual pipeline size after validation)
    "first_of_two": (dict(num_layers=3, pipeline_model_parallel_size=2,
                          decoder_first_pipeline_num_layers=2), 2, None),
    "last_of_two": (dict(pipeline_model_parallel_size=2, decoder_last_pipeline_num_layers=1),
                    2, None),
    "first_and_last_of_two": (dict(pipeline_model_parallel_size=2,
                                   decoder_first_pipeline_num_layers=3,
                                   decoder_last_pipeline_num_layers=1), 2, None),
    "first_and_last_of_four": (dict(num_layers=8, pipeline_model_parallel_size=4,
                                    decoder_first_pipeline_num_layers=1,
                                    decoder_last_pipeline_num_layers=1, global_batch_size=8),
                               4, None),
    "first_with_vpp": (dict(num_layers=6, pipeline_model_parallel_size=2,
                            decoder_first_pipeline_num_layers=4,
                            virtual_pipeline_model_parallel_size=2, global_batch_size=4), 2, 2),
    "first_and_last_with_vpp_on_four": (
        dict(num_layers=8, pipeline_model_parallel_size=4, decoder_first_pipeline_num_layers=2,
             decoder_last_pipeline_num_layers=2, virtual_pipeline_model_parallel_size=2,
             global_batch_size=8), 4, 2),
    "embedding_in_split": (dict(num_layers=3, pipeline_model_parallel_size=2,
                                account_for_embedding_in_pipeline_split=True), 2, None),
    "embedding_and_loss_in_split_per_chunk": (
        dict(num_layers=6, pipeline_model_parallel_size=2,
             num_layers_per_virtual_pipeline_stage=2,
             account_for_embedding_in_pipeline_split=True,
             account_for_loss_in_pipeline_split=True, global_batch_size=4), 2, 2),
}


@pytest.mark.parametrize("case", list(UNEVEN_ACCEPTED))
def test_uneven_pipeline_split_accepted(case):
    """Accepted combinations also pass megatron-core's TransformerConfig checks, and its
    layer placement gives every layer to exactly one (virtual) stage, in order."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from megatron.trainer.config.configs import TrainerConfigs
    from megatron.trainer.model.models import transformer_config

    overrides, world, vpp = UNEVEN_ACCEPTED[case]
    args = parse_args(with_flags(BASE, **overrides), world_size=world)
    assert args.virtual_pipeline_model_parallel_size == vpp
    config = transformer_config(TrainerConfigs.from_args(args))
    assert config.num_layers_in_first_pipeline_stage == args.decoder_first_pipeline_num_layers
    assert config.num_layers_in_last_pipeline_stage == args.decoder_last_pipeline_num_layers
    assert config.account_for_embedding_in_pipeline_split == \
        args.account_for_embedding_in_pipeline_split
    placed = []
    for vp_stage in range(vpp or 1):
        for pp_rank in range(args.pipeline_model_parallel_size):
            where = dict(vp_stage=vp_stage if vpp else None, pp_rank=pp_rank)
            offset = get_transformer_layer_offset(config, **where)
            placed += range(offset, offset + get_num_layers_to_build(config, **where))
    assert placed == list(range(args.num_layers))
    if args.decoder_first_pipeline_num_layers:
        first = [get_num_layers_to_build(config, vp_stage=v if vpp else None, pp_rank=0)
                 for v in range(vpp or 1)]
        assert sum(first) == args.decoder_first_pipeline_num_layers


# Megatron-LM's examples/gpt3/train_gpt3_175b_distributed.sh, sizes scaled down, TP 8 -> 1,
# PP 16 -> 2, --data-path replaced by --mock-data (vocab and merge files kept).
def _megatron_lm_gpt_flags(tmp_path):
    checkpoints = str(tmp_path / "checkpoints")
    return [
        "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32", "--attention-backend", "auto",
        "--micro-batch-size", "1", "--global-batch-size", "8",
        "--rampup-batch-size", "4", "4", "4", "--train-iters", "2",
        "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
        "--init-method-std", "0.006", "--clip-grad", "1.0", "--fp16",
        "--lr", "6.0e-5", "--lr-decay-style", "cosine", "--min-lr", "6.0e-6",
        "--lr-warmup-fraction", ".001", "--lr-decay-iters", "430000",
        "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2",
        "--mock-data", "--vocab-file", os.path.join(REPO, "datasets_gpt", "vocab.json"),
        "--merge-file", os.path.join(REPO, "datasets_gpt", "merges.txt"),
        "--split", "949,50,1",
        "--log-interval", "1", "--save-interval", "10000", "--eval-interval", "1000",
        "--save", checkpoints, "--load", checkpoints, "--eval-iters", "10",
        "--tensorboard-dir", str(tmp_path / "tensorboard"),
    ]


def test_megatron_lm_gpt_flags_accepted(tmp_path):
    from megatron.trainer.config.args_training import _global_batch_sizes

    args = parse_args(_megatron_lm_gpt_flags(tmp_path), world_size=2)
    assert args.tokenizer_type == "GPT2BPETokenizer"  # from --vocab-file and --merge-file
    assert args.num_microbatches == 8
    # the ramp-up: 4 samples at iteration 1, the full batch once 4 samples are consumed
    assert _global_batch_sizes(args) == {4: 1, 8: 2}


@pytest.mark.slow
def test_megatron_lm_gpt_flags_train(tmp_path):
    """PP=2 on 2 ranks: two iterations, the batch ramps up from 4 to 8 samples, the empty
    --load directory starts a fresh run, the final save lands. Megatron's default initial
    fp16 loss scale (2^32) overflows and skips the first ~30 steps by design while the scaler
    backs off; a smaller start lets these two steps update the model."""
    flags = _megatron_lm_gpt_flags(tmp_path) + ["--initial-loss-scale", "1024"]
    results = run_ranks(2, train_run, flags, 2)
    last = results[-1]
    assert last["batches"] == [4, 8]
    state = dict(last["state"])
    assert state.pop("floating_point_operations") > 0  # the model's FLOPs of both iterations
    assert state == {"iteration": 2, "consumed_samples": 12, "skipped_iterations": 0}
    assert all(math.isfinite(norm) and norm > 0 for norm in last["grad_norms"])
    losses = [step["lm loss"] for step in last["losses"]]
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses)
    # GPT-2's vocabulary: an untrained model's loss is near ln(50257)
    assert abs(losses[0] - math.log(50257)) < 1.0
    warnings = [m for level, m in results[0]["logs"] if level == "WARNING"]
    assert any("no checkpoint under" in m for m in warnings)
    pointer = tmp_path / "checkpoints" / "latest_checkpointed_iteration.txt"
    assert pointer.read_text().strip() == "2"


DOCUMENTS = with_flags(BASE, mock_data=None, data_path="corpus_text_document",
                       variable_seq_lengths=True)
DRAWN_BUDGET = with_flags(BASE, seq_length_cv=0.5, microbatch_tokens=64)
VARIABLE_LENGTH_REFUSALS = {
    # name: (flags, world size, the one-line reason)
    "mock_data": (with_flags(DOCUMENTS, data_path=None, mock_data=True), 1,
                  "--variable-seq-lengths needs --data-path"),
    "seq_length_cv": (with_flags(DOCUMENTS, seq_length_cv=0.5), 1,
                      "--variable-seq-lengths and --seq-length-cv are two sources of lengths"),
    "rampup": (with_flags(DOCUMENTS, rampup_batch_size=[2, 2, 8], global_batch_size=8), 1,
               "--variable-seq-lengths with --rampup-batch-size"),
    "reset_position_ids": (with_flags(DOCUMENTS, reset_position_ids=True), 1,
                           "--variable-seq-lengths with --reset-position-ids"),
    "grouping_without_documents": (with_flags(BASE, group_by_length=True), 1,
                                   "--group-by-length needs --variable-seq-lengths"),
    "cost_order_with_fixed_lengths": (with_flags(BASE, microbatch_order="cost"), 1,
                                      "--microbatch-order cost needs --variable-seq-lengths"),
    "padding_with_fixed_lengths": (with_flags(BASE, pad_to_multiple=64), 1,
                                   "--pad-to-multiple needs --variable-seq-lengths or "
                                   "--seq-length-cv"),
    "token_budget_with_fixed_lengths": (with_flags(BASE, microbatch_tokens=4096), 1,
                                        "--microbatch-tokens needs --variable-seq-lengths or "
                                        "--seq-length-cv"),
    "grouping_drawn_microbatches": (with_flags(BASE, seq_length_cv=0.5, group_by_length=True),
                                    1, "--group-by-length needs --variable-seq-lengths, or "
                                    "--seq-length-cv with --microbatch-tokens"),
    "drawn_budget_rampup": (with_flags(DRAWN_BUDGET, rampup_batch_size=[2, 2, 8],
                                       global_batch_size=8), 1,
                            "--seq-length-cv with --microbatch-tokens with --rampup-batch-size"),
    "drawn_budget_reset_position_ids": (with_flags(DRAWN_BUDGET, reset_position_ids=True), 1,
                                        "--seq-length-cv with --microbatch-tokens with "
                                        "--reset-position-ids"),
    "drawn_budget_eval_batch": (with_flags(DRAWN_BUDGET, eval_global_batch_size=4), 1,
                                "--seq-length-cv with --microbatch-tokens with "
                                "--eval-global-batch-size"),
    "documents_eval_batch": (with_flags(DOCUMENTS, eval_global_batch_size=4), 1,
                             "--variable-seq-lengths with --eval-global-batch-size"),
    "token_budget_below_a_sample": (with_flags(DOCUMENTS, microbatch_tokens=8), 1,
                                    "--microbatch-tokens 8 is less than --seq-length"),
    "token_budget_interleaved": (
        with_flags(DOCUMENTS, microbatch_tokens=4096, pipeline_model_parallel_size=2,
                   virtual_pipeline_model_parallel_size=2, global_batch_size=8, use_dpp=True),
        2, "--microbatch-tokens with virtual pipeline stages"),
}


@pytest.mark.parametrize("case", list(VARIABLE_LENGTH_REFUSALS))
def test_variable_lengths_refuse_what_they_cannot_do(case):
    flags, world, reason = VARIABLE_LENGTH_REFUSALS[case]
    assert reason in _error(flags, world)


def test_variable_length_defaults():
    """The order: cost with --use-dpp, natural otherwise (a plain run stays Megatron's);
    padding: 1 on CPU, 128 on a GPU (few shapes: each new one compiles, plans and records
    graphs there), also under --seq-length-cv, and a multiple of TP under sequence
    parallelism."""
    plain = parse_args(DOCUMENTS, world_size=1)
    padding = 128 if torch.cuda.is_available() else 1
    assert (plain.microbatch_order, plain.pad_to_multiple) == ("natural", padding)
    synthetic = parse_args(with_flags(BASE, seq_length_cv=0.5), world_size=1)
    assert synthetic.pad_to_multiple == padding
    assert parse_args(with_flags(BASE, seq_length_cv=0.5, pad_to_multiple=32),
                      world_size=1).pad_to_multiple == 32
    dpp = parse_args(with_flags(DOCUMENTS, use_dpp=True, pipeline_model_parallel_size=2),
                     world_size=2)
    assert dpp.microbatch_order == "cost"
    sp = parse_args(with_flags(DOCUMENTS, tensor_model_parallel_size=2, sequence_parallel=True,
                               pad_to_multiple=3), world_size=2)
    assert sp.pad_to_multiple == 6


def test_bert_refuses_variable_seq_lengths():
    from megatron.trainer.run.training import setup
    from megatron.trainer.tasks.bert import BERT_TASK

    args = parse_args(DOCUMENTS, world_size=1)
    with pytest.raises(ArgumentError, match="--variable-seq-lengths is for GPT"):
        setup(BERT_TASK, args, None)
    args = parse_args(DRAWN_BUDGET, world_size=1)
    with pytest.raises(ArgumentError, match="--seq-length-cv with --microbatch-tokens is for "
                                            "GPT"):
        setup(BERT_TASK, args, None)
