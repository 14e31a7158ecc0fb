"""Flag validation: every inconsistent value stops with one message naming the flags and
values; a Megatron-LM user's GPT flag set is accepted and trains."""

from __future__ import annotations

import math
import os

import pytest

from megatron.training.arguments import ArgumentError, parse_args
from tests.distributed import run_ranks
from tests.trainer_runs import TINY, train_run, with_flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
    "dpp_over_rdma_not_wired": (
        dict(use_dpp=True, pipeline_model_parallel_size=2, dpp_transport="rdma"), 2,
        ["--dpp-transport rdma", "not wired"]),
}


@pytest.mark.parametrize("case", list(BAD_VALUES))
def test_bad_value_names_flags_and_values(case):
    overrides, world, fragments = BAD_VALUES[case]
    message = _error(with_flags(BASE, **overrides), world)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in: {message}"


def test_unknown_flag_is_named():
    message = _error(BASE + ["--num-layer", "4", "--no-such-flag"])
    assert "--num-layer" in message and "--no-such-flag" in message


def test_fp16_with_bf16():
    assert "--fp16 and --bf16" in _error(BASE + ["--fp16", "--bf16"])


def test_node_ips_count_must_match_nodes(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    flags = with_flags(BASE, pipeline_model_parallel_size=2)
    message = _error(with_flags(flags, node_ips=["10.0.0.1", "10.0.0.2"]), world_size=2)
    assert "--node-ips lists 2 addresses" in message and "1 nodes" in message
    args = parse_args(with_flags(flags, node_ips=["10.0.0.1"]), world_size=2)
    assert args.node_ips == ["10.0.0.1"]


def test_all_problems_in_one_message():
    message = _error(with_flags(BASE, num_layers=5, pipeline_model_parallel_size=2,
                                global_batch_size=3), world_size=2)
    assert "--num-layers 5" in message and "--global-batch-size 3" in message


def test_derived_values():
    args = parse_args(with_flags(BASE, pipeline_model_parallel_size=2, global_batch_size=16,
                                 num_layers=8, num_layers_per_virtual_pipeline_stage=2),
                      world_size=4)
    assert args.data_parallel_size == 2
    assert args.num_microbatches == 4
    assert args.virtual_pipeline_model_parallel_size == 2
    assert args.ffn_hidden_size == 4 * 32 and args.kv_channels == 8


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
    args = parse_args(_megatron_lm_gpt_flags(tmp_path), world_size=2)
    assert args.tokenizer_type == "GPT2BPETokenizer"
    assert args.rampup_batch_size == [4, 4, 4]
    assert args.num_microbatches == 8


def test_megatron_lm_gpt_flags_train(tmp_path):
    """PP=2 on 2 ranks: two iterations, the batch ramps up from 4 to 8 samples, the empty
    --load directory starts a fresh run, the final save lands. Megatron's default initial
    fp16 loss scale (2^32) overflows and skips the first ~30 steps by design while the scaler
    backs off; a smaller start lets these two steps update the model."""
    flags = _megatron_lm_gpt_flags(tmp_path) + ["--initial-loss-scale", "1024"]
    results = run_ranks(2, train_run, flags, 2)
    last = results[-1]
    assert last["batches"] == [4, 8]
    assert last["state"] == {"iteration": 2, "consumed_samples": 12, "skipped_iterations": 0}
    assert all(math.isfinite(norm) and norm > 0 for norm in last["grad_norms"])
    losses = [step["lm loss"] for step in last["losses"]]
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses)
    # GPT-2's vocabulary: an untrained model's loss is near ln(50257)
    assert abs(losses[0] - math.log(50257)) < 1.0
    warnings = [m for level, m in results[0]["logs"] if level == "WARNING"]
    assert any("no checkpoint under" in m for m in warnings)
    pointer = tmp_path / "checkpoints" / "latest_checkpointed_iteration.txt"
    assert pointer.read_text().strip() == "2"
