"""The typed configurations (megatron/trainer/config/configs.py): each topic is built from the
validated flags, holds the Namespace's values under the flags' names, is frozen, and its
rules refuse a bad combination with a message naming the flags, also when it is built
without the parser."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from megatron.trainer.checkpoint.checkpoint_config import CheckpointConfig
from megatron.trainer.config.arguments import ArgumentError, parse_args
from megatron.trainer.config.configs import (
    DataConfig,
    FastPathConfig,
    LayerConfig,
    LoggingConfig,
    ModelConfig,
    ParallelConfig,
    PipelineConfig,
    PrecisionConfig,
    ProcessConfig,
    ProfilingConfig,
    ScheduleConfig,
    TrainerConfigs,
)
from megatron.trainer.config.optimizer_config import OptimizerConfig
from tests import REPO

TOPICS = (ModelConfig, LayerConfig, ParallelConfig, PipelineConfig, DataConfig, ScheduleConfig,
          PrecisionConfig, FastPathConfig, OptimizerConfig, LoggingConfig, ProcessConfig,
          ProfilingConfig)

# what validation needs; every other flag at its default
DEFAULT = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
           "--seq-length", "32", "--lr", "1e-4", "--train-iters", "1", "--mock-data",
           "--vocab-size", "128"]


def _gpt(tmp_path) -> list[str]:
    """A GPT run as Megatron-LM's examples write it, on 8 ranks: TP 2 x PP 2 x DP 2, bf16,
    the distributed optimizer, DPP, checkpoints and TensorBoard."""
    return [
        "--num-layers", "8", "--hidden-size", "256", "--num-attention-heads", "8",
        "--seq-length", "128", "--max-position-embeddings", "128", "--micro-batch-size", "2",
        "--global-batch-size", "32", "--train-iters", "100", "--lr", "3e-4", "--min-lr",
        "3e-5", "--lr-decay-style", "cosine", "--lr-warmup-iters", "10", "--weight-decay",
        "0.1", "--clip-grad", "1.0", "--bf16", "--tensor-model-parallel-size", "2",
        "--pipeline-model-parallel-size", "2", "--sequence-parallel",
        "--use-distributed-optimizer", "--overlap-grad-reduce", "--use-dpp",
        "--dpp-max-inflight", "1", "--mock-data",
        "--vocab-file", os.path.join(REPO, "datasets_gpt", "vocab.json"),
        "--merge-file", os.path.join(REPO, "datasets_gpt", "merges.txt"),
        "--save", str(tmp_path / "ckpt"), "--save-interval", "50",
        "--tensorboard-dir", str(tmp_path / "tb"), "--log-interval", "10",
        "--eval-interval", "50", "--eval-iters", "5", "--wandb-project", "p",
        "--wandb-exp-name", "gpt",
    ]


@pytest.fixture(params=["default", "gpt"])
def args(request, tmp_path):
    if request.param == "default":
        return parse_args(DEFAULT, world_size=1)
    return parse_args(_gpt(tmp_path), world_size=8)


def test_each_topic_holds_the_flags_values_under_their_names(args):
    configs = TrainerConfigs.from_args(args)
    for topic in TOPICS:
        config = next(c for c in vars(configs).values() if isinstance(c, topic))
        assert config == topic.from_args(args)
        for field in dataclasses.fields(config):
            if field.name in getattr(topic, "DERIVED", ()):
                continue  # no flag: derived when the configuration is built (below)
            value = getattr(args, field.name)
            expected = tuple(value) if isinstance(value, list) else value
            if topic is LoggingConfig and field.name == "wandb_save_dir":
                continue  # from_args fills Megatron-LM's default (below)
            assert getattr(config, field.name) == expected, (topic.__name__, field.name)
    assert configs.checkpoint == CheckpointConfig.from_args(args)


def test_the_gpt_command_line_reads_as_its_topics(tmp_path):
    configs = TrainerConfigs.from_args(parse_args(_gpt(tmp_path), world_size=8))
    assert (configs.parallel.tensor_model_parallel_size, configs.parallel.data_parallel_size,
            configs.parallel.model_parallel_size) == (2, 2, 4)
    assert configs.model.ffn_hidden_size == 4 * 256 and configs.model.kv_channels == 32
    assert (configs.schedule.use_dpp, configs.schedule.num_microbatches,
            configs.schedule.dpp_max_inflight) == (True, 8, 1)
    assert configs.precision.params_dtype == torch.bfloat16
    assert configs.precision.accumulate_allreduce_grads_in_fp32  # implied by --bf16
    assert configs.data.tokenizer_type == "GPT2BPETokenizer"  # from the vocab and merges
    assert configs.checkpoint.save == str(tmp_path / "ckpt")
    assert configs.checkpoint.save_interval == 50
    assert configs.logging.wandb.save_dir == str(tmp_path / "ckpt" / "wandb")
    assert configs.logging.writes_scalars


def test_the_default_flags_read_as_megatron_lm_defaults():
    configs = TrainerConfigs.from_args(parse_args(DEFAULT, world_size=1))
    assert configs.model.position_embedding_type == "learned_absolute"
    assert configs.model.max_position_embeddings == 32  # the sequence length
    assert configs.parallel.world_size == configs.parallel.data_parallel_size == 1
    assert configs.schedule.global_batch_size == configs.schedule.micro_batch_size == 1
    assert configs.precision.params_dtype == torch.float32
    assert configs.data.tokenizer_type == "NullTokenizer"
    assert configs.logging.wandb is None and not configs.logging.writes_scalars
    assert configs.checkpoint.save is None


def test_configs_are_frozen(args):
    configs = TrainerConfigs.from_args(args)
    for config in (configs, *vars(configs).values()):
        if not dataclasses.is_dataclass(config):
            continue  # the flags' mapping, read-only (below)
        name = dataclasses.fields(config)[0].name
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(config, name, None)
    with pytest.raises(TypeError):
        configs.flags["seed"] = 0


def test_the_model_vocabulary_is_the_tokenizers_padded_once(args):
    """--make-vocab-size-divisible-by (128) x TP: the tokenizer's vocabulary rounded up."""
    tp = args.tensor_model_parallel_size
    configs = TrainerConfigs.from_args(args, vocab_size=50257)
    assert configs.model.padded_vocab_size == -(-50257 // (128 * tp)) * 128 * tp
    assert TrainerConfigs.from_args(args).model.padded_vocab_size is None
    assert not hasattr(args, "padded_vocab_size")  # the Namespace stays as parsed


BAD = {
    # topic: (changed fields, fragments of the message)
    ModelConfig: (dict(squared_relu=True, swiglu=True), ["--squared-relu", "--swiglu"]),
    ParallelConfig: (dict(world_size=6, tensor_model_parallel_size=4),
                     ["world size 6", "--tensor-model-parallel-size 4"]),
    DataConfig: (dict(mock_data=True, data_path=("corpus_text_document",)),
                 ["--mock-data and --data-path are mutually exclusive"]),
    ScheduleConfig: (dict(use_dpp=False, dpp_static=True), ["--dpp-static needs --use-dpp"]),
    PrecisionConfig: (dict(fp16=True, bf16=True), ["--fp16 and --bf16"]),
    FastPathConfig: (dict(cuda_graph_memory_limit=-1.0),
                     ["--cuda-graph-memory-limit -1.0 must be >= 0"]),
    LoggingConfig: (dict(tensorboard_dir=None, wandb_project=None, wandb_exp_name=None,
                         log_memory_to_tensorboard=True),
                    ["--log-memory-to-tensorboard need --tensorboard-dir"]),
}


@pytest.mark.parametrize("topic", list(BAD), ids=lambda topic: topic.__name__)
def test_a_bad_combination_is_refused_naming_the_flags(topic, tmp_path):
    config = topic.from_args(parse_args(_gpt(tmp_path), world_size=8))
    changes, fragments = BAD[topic]
    with pytest.raises(ArgumentError) as caught:
        dataclasses.replace(config, **changes)
    assert all(fragment in str(caught.value) for fragment in fragments), caught.value


def test_validation_runs_the_topics_rules_with_every_other_check():
    with pytest.raises(ArgumentError) as caught:
        parse_args([*DEFAULT, "--fp16", "--bf16", "--squared-relu", "--swiglu",
                    "--dpp-static"], world_size=1)
    message = str(caught.value)
    for rule in ("--fp16 and --bf16", "--squared-relu and --swiglu",
                 "--dpp-static needs --use-dpp"):
        assert rule in message, message

