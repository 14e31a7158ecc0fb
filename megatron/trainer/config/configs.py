"""Typed, frozen configurations of the trainer's topics, built once from the parsed flags
(`from_args`); a component reads its own configuration, not the argparse Namespace, which
stays the surface megatron-core and Megatron-LM's conventions need.

A topic's fields are named as the Namespace's attributes (Megatron-LM's flags with "-" as
"_", and the values validation derives, such as data_parallel_size), so `from_args` reads
each by its name. Each topic states its own rules (`rules`): validation (arguments.py) runs
them on the Namespace with every other check, so that one message names all problems, and
a configuration built any other way is checked by the same rules.

The topics: model, layers, parallelism, pipeline stages, data, schedule (batches,
iterations, DPP), precision, the fast path, logging, emulation (emulated links and
stragglers), the process and its profiling; the optimizer's is optimizer_config.py, the
checkpoint's megatron/trainer/checkpoint/checkpoint_config.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import ClassVar

from megatron.dpp.config import DppOptions, slack_flag_problems
from megatron.dpp.variability import Emulation, LinkProfile, StragglerProfile
from megatron.trainer.checkpoint.checkpoint_config import CheckpointConfig
from megatron.trainer.config.args_common import ArgumentError, one_line
from megatron.trainer.config.fast_path import ModelFastPath
from megatron.trainer.config.optimizer_config import OptimizerConfig
from megatron.trainer.core_compat.reruns import RerunConfig
from megatron.trainer.data.microbatches import lengths_per_sample

log = logging.getLogger(__name__)

Need = Callable[[bool, str], None]  # need(ok, message): records the message unless ok


class FlagConfig:
    """The base of the topics' frozen dataclasses (see the module's docstring)."""

    # fields that are no flag: derived when the configuration is built, not read from args
    DERIVED: ClassVar[tuple[str, ...]] = ()

    @staticmethod
    def rules(values, need: Need) -> None:
        """need(ok, message) for each rule of the topic; `values` is a configuration of the
        topic or the parsed Namespace (the same attribute names). None: no rule."""

    def __post_init__(self):
        problems: list[str] = []
        self.rules(self, lambda ok, message: ok or problems.append(message))
        if problems:
            raise ArgumentError(one_line(problems))

    @classmethod
    def flag_values(cls, args) -> dict:
        """Each field's value in `args`; lists become tuples (the configuration is frozen)."""
        values = {}
        for flag in dataclasses.fields(cls):
            if flag.name in cls.DERIVED:
                continue
            value = getattr(args, flag.name)
            values[flag.name] = tuple(value) if isinstance(value, list) else value
        return values

    @classmethod
    def from_args(cls, args):
        return cls(**cls.flag_values(args))


@dataclass(frozen=True)
class ModelConfig(FlagConfig):
    """The model's shape and layers (the family: `model`, "gpt" or "bert")."""

    model: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    kv_channels: int
    group_query_attention: bool
    num_query_groups: int
    seq_length: int
    max_position_embeddings: int
    position_embedding_type: str
    rotary_percent: float
    rotary_base: int
    rotary_interleaved: bool
    normalization: str
    norm_epsilon: float
    swiglu: bool
    squared_relu: bool
    disable_bias_linear: bool
    untie_embeddings_and_output_weights: bool
    hidden_dropout: float
    attention_dropout: float
    init_method_std: float
    make_vocab_size_divisible_by: int
    multi_latent_attention: bool
    transformer_impl: str
    # the tokenizer's vocabulary padded to a multiple of --make-vocab-size-divisible-by x TP
    # (None: no tokenizer given to from_args)
    padded_vocab_size: int | None = None

    DERIVED: ClassVar[tuple[str, ...]] = ("padded_vocab_size",)

    @classmethod
    def from_args(cls, args, vocab_size: int | None = None) -> ModelConfig:
        values = cls.flag_values(args)
        if vocab_size is not None:
            multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
            values["padded_vocab_size"] = int(math.ceil(vocab_size / multiple) * multiple)
        return cls(**values)

    @staticmethod
    def rules(values, need: Need) -> None:
        heads, hidden = values.num_attention_heads, values.hidden_size
        need(heads >= 1 and hidden % heads == 0,
             f"--num-attention-heads {heads} does not divide --hidden-size {hidden}")
        need(values.position_embedding_type != "learned_absolute"
             or values.seq_length <= values.max_position_embeddings,
             f"--seq-length {values.seq_length} exceeds --max-position-embeddings "
             f"{values.max_position_embeddings}")
        need(not values.rotary_interleaved or values.position_embedding_type == "rope",
             "--rotary-interleaved needs --position-embedding-type rope")
        need(not (values.squared_relu and values.swiglu), "--squared-relu and --swiglu are "
             "mutually exclusive (two MLP activations)")


@dataclass(frozen=True)
class LayerConfig(FlagConfig):
    """How the layers are built beyond the model's shape: megatron-core's TransformerConfig
    switches, the attention kernel, recomputation, multi-latent attention's head sizes and
    BERT's heads."""

    apply_residual_connection_post_layernorm: bool
    attention_softmax_in_fp32: bool
    apply_query_key_layer_scaling: bool
    qk_layernorm: bool
    apply_layernorm_1p: bool
    test_mode: bool
    deterministic_mode: bool
    calculate_per_token_loss: bool
    no_bias_gelu_fusion: bool
    no_bias_dropout_fusion: bool
    no_masked_softmax_fusion: bool
    no_rope_fusion: bool
    use_flash_attn: bool
    attention_backend: str
    recompute_granularity: str | None
    recompute_method: str | None
    recompute_num_layers: int | None
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_head_dim: int
    qk_pos_emb_head_dim: int
    v_head_dim: int
    rope_type: str | None
    rotary_scaling_factor: float | None
    mscale: float | None
    mscale_all_dim: float | None
    num_tokentypes: int
    bert_no_binary_head: bool


@dataclass(frozen=True)
class ParallelConfig(FlagConfig):
    """How the ranks divide the model and the data, and how they reduce gradients."""

    world_size: int
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    virtual_pipeline_model_parallel_size: int | None  # None: one model chunk per stage
    context_parallel_size: int
    data_parallel_size: int
    sequence_parallel: bool
    use_distributed_optimizer: bool
    num_distributed_optimizer_instances: int
    overlap_grad_reduce: bool
    overlap_param_gather: bool
    distributed_backend: str | None  # None until validation picks nccl or gloo
    distributed_timeout_minutes: float

    @property
    def model_parallel_size(self) -> int:
        return (self.tensor_model_parallel_size * self.pipeline_model_parallel_size
                * self.context_parallel_size)

    @staticmethod
    def rules(values, need: Need) -> None:
        tp, pp, cp = (values.tensor_model_parallel_size, values.pipeline_model_parallel_size,
                      values.context_parallel_size)
        need(cp == 1, f"--context-parallel-size {cp}: only 1 is supported")
        need(tp * pp * cp >= 1 and values.world_size % (tp * pp * cp) == 0,
             f"world size {values.world_size} is not divisible by --tensor-model-parallel-size "
             f"{tp} x --pipeline-model-parallel-size {pp}")
        instances, dp = values.num_distributed_optimizer_instances, values.data_parallel_size
        if instances != 1:
            flag = f"--num-distributed-optimizer-instances {instances}"
            need(instances >= 1, f"{flag} must be >= 1")
            need(values.use_distributed_optimizer, f"{flag} needs --use-distributed-optimizer")
            need(instances < 1 or dp % instances == 0,
                 f"{flag} does not divide the data-parallel size {dp}")


@dataclass(frozen=True)
class PipelineConfig(FlagConfig):
    """How megatron-core's schedules split the layers over the stages and exchange between
    them, and which weight gradients wait for the pipeline's flush."""

    account_for_embedding_in_pipeline_split: bool
    account_for_loss_in_pipeline_split: bool
    decoder_first_pipeline_num_layers: int | None
    decoder_last_pipeline_num_layers: int | None
    no_batch_p2p_comm: bool
    batch_p2p_sync: bool
    overlap_p2p_communication_warmup_flush: bool
    microbatch_group_size_per_virtual_pipeline_stage: int | None
    defer_embedding_wgrad_compute: bool
    wgrad_deferral_limit: int | None


@dataclass(frozen=True)
class DataConfig(FlagConfig):
    """Where the samples come from and how their lengths are made."""

    data_path: tuple[str, ...] | None
    mock_data: bool
    split: str
    data_cache_path: str | None
    num_workers: int
    tokenizer_type: str | None  # None until validation picks the model's default
    seq_length_cv: float
    variable_seq_lengths: bool
    group_by_length: bool
    pad_to_multiple: int | None  # None until validation picks the machine's default
    microbatch_tokens: int | None
    reset_position_ids: bool
    reset_attention_mask: bool
    eod_mask_loss: bool
    # --data-path's (prefixes, weights); None with --mock-data
    data_blend: tuple | None = None

    DERIVED: ClassVar[tuple[str, ...]] = ("data_blend",)

    @classmethod
    def from_args(cls, args) -> DataConfig:
        return cls(**cls.flag_values(args), data_blend=getattr(args, "data_blend", None))

    @property
    def lengths_per_sample(self) -> bool:
        return lengths_per_sample(self)

    @staticmethod
    def rules(values, need: Need) -> None:
        need(values.mock_data or values.data_path,
             "no data: give --data-path PREFIX [...] or --mock-data")
        need(not (values.mock_data and values.data_path),
             "--mock-data and --data-path are mutually exclusive")
        cv = values.seq_length_cv
        need(cv >= 0, f"--seq-length-cv {cv} must be >= 0")
        need(values.num_workers == 0 or cv == 0,
             f"--num-workers {values.num_workers} with --seq-length-cv: the microbatches are "
             "cut to their lengths in the training process; use --num-workers 0")
        need(values.variable_seq_lengths or cv > 0 or values.microbatch_tokens is None,
             "--microbatch-tokens needs --variable-seq-lengths or --seq-length-cv")
        need(lengths_per_sample(values) or not values.group_by_length,
             "--group-by-length needs --variable-seq-lengths, or --seq-length-cv with "
             "--microbatch-tokens (each sample its own length)")


@dataclass(frozen=True)
class ScheduleConfig(FlagConfig):
    """The iterations: batch sizes, microbatches and their order, evaluation, and the
    pipeline schedule (megatron-core's, or DPP's with --use-dpp)."""

    micro_batch_size: int
    global_batch_size: int | None  # None until validation derives it
    num_microbatches: int | None  # per iteration at the full global batch size (validation)
    rampup_batch_size: tuple[int, int, int] | None
    step_batch_size_schedule: str | None
    train_iters: int | None  # None until validation derives it from --train-samples
    exit_interval: int | None
    eval_interval: int
    eval_iters: int
    eval_global_batch_size: int | None
    microbatch_order: str | None  # None until validation picks natural or cost
    use_dpp: bool
    dpp_max_inflight: int | None
    dpp_memory_budget: str | None
    dpp_transport: str
    dpp_timeout: float
    dpp_split_backward: bool | None  # None until the fast path decides
    dpp_defer_weights: bool | None  # None: DppOptions' default
    dpp_static: bool | None

    @staticmethod
    def rules(values, need: Need) -> None:
        for problem in slack_flag_problems(values.dpp_max_inflight, values.dpp_memory_budget):
            need(False, problem)
        need(values.dpp_memory_budget is None or values.use_dpp,
             "--dpp-memory-budget needs --use-dpp")
        need(not values.dpp_static or values.use_dpp, "--dpp-static needs --use-dpp")
        need(not values.dpp_defer_weights or (values.use_dpp and values.dpp_split_backward),
             "--dpp-defer-weights places the W tasks of DPP's split backward: it needs "
             "--use-dpp with --dpp-split-backward (the split is on by default with --use-dpp)")


@dataclass(frozen=True)
class PrecisionConfig(FlagConfig):
    """The parameters' dtype and fp16's loss scaling."""

    fp16: bool
    bf16: bool
    params_dtype: object | None  # torch.dtype; None until validation derives it
    loss_scale: float | None  # None: dynamic loss scaling (fp16)
    initial_loss_scale: float
    min_loss_scale: float
    loss_scale_window: float
    hysteresis: int
    accumulate_allreduce_grads_in_fp32: bool
    fp32_residual_connection: bool

    @staticmethod
    def rules(values, need: Need) -> None:
        need(not (values.fp16 and values.bf16), "--fp16 and --bf16 are mutually exclusive")


@dataclass(frozen=True)
class FastPathConfig(FlagConfig):
    """The speed features as the fast path settled them for this machine (fast_path.py)."""

    cuda_graph_impl: str
    cuda_graph_memory_limit: float | None  # GiB; None: no bound
    cross_entropy_loss_fusion: bool | None  # None until the fast path decides
    cross_entropy_fusion_impl: str | None
    gradient_accumulation_fusion: bool
    triton_fusions: bool | None
    gelu_gemm_epilogue: bool | None
    megatron_optimizer_fallbacks: bool
    # the defaults this machine or model turned off, one line each, logged once at start
    fast_path_fallbacks: tuple[str, ...] = ()
    cuda_graphs_by_default: bool = False  # --cuda-graph-impl auto (not given) became block

    @staticmethod
    def rules(values, need: Need) -> None:
        limit = values.cuda_graph_memory_limit
        need(limit is None or limit >= 0, f"--cuda-graph-memory-limit {limit} must be >= 0")


@dataclass(frozen=True)
class WandbConfig:
    project: str
    exp_name: str
    entity: str | None
    save_dir: str


@dataclass(frozen=True)
class LoggingConfig(FlagConfig):
    """What the reporting rank writes at each log interval and after each validation."""

    log_interval: int
    tensorboard_dir: str | None
    log_throughput: bool
    timing_log_level: int  # timers recorded: 0 iteration time, 1 + phases, 2 + per-microbatch
    log_timers_to_tensorboard: bool
    log_memory_to_tensorboard: bool
    log_num_zeros_in_grad: bool
    log_params_norm: bool
    log_validation_ppl_to_tensorboard: bool
    wandb_project: str | None
    wandb_exp_name: str | None
    wandb_entity: str | None
    wandb_save_dir: str | None  # from_args: Megatron-LM's default, --save/wandb else wandb

    @property
    def wandb(self) -> WandbConfig | None:
        if not self.wandb_project:
            return None
        return WandbConfig(self.wandb_project, self.wandb_exp_name, self.wandb_entity,
                           self.wandb_save_dir or "wandb")

    @property
    def writes_scalars(self) -> bool:
        return self.tensorboard_dir is not None or self.wandb is not None

    @classmethod
    def from_args(cls, args) -> LoggingConfig:
        values = cls.flag_values(args)
        if args.wandb_project and args.wandb_save_dir is None and args.save:
            values["wandb_save_dir"] = os.path.join(args.save, "wandb")
        return cls(**values)

    @staticmethod
    def rules(values, need: Need) -> None:
        board_flags = [flag for flag, on in (
            ("--log-timers-to-tensorboard", values.log_timers_to_tensorboard),
            ("--log-memory-to-tensorboard", values.log_memory_to_tensorboard),
            ("--log-validation-ppl-to-tensorboard", values.log_validation_ppl_to_tensorboard),
        ) if on]
        need(not board_flags or values.tensorboard_dir or values.wandb_project,
             f"{' '.join(board_flags)} need --tensorboard-dir DIR (or --wandb-project)")
        wandb_flags = [flag for flag, value in (
            ("--wandb-exp-name", values.wandb_exp_name), ("--wandb-entity", values.wandb_entity),
            ("--wandb-save-dir", values.wandb_save_dir)) if value is not None]
        if values.wandb_project is None:
            need(not wandb_flags, f"{' '.join(wandb_flags)} need --wandb-project")
        else:
            need(bool(values.wandb_exp_name), f"--wandb-project {values.wandb_project} needs "
                 "--wandb-exp-name NAME")


@dataclass(frozen=True)
class ProcessConfig(FlagConfig):
    """This process's place in the job (device, rank order, pod) and what it does between
    steps: replica checks, manual garbage collection, stopping on a signal."""

    local_rank: int | None  # None: torchrun's LOCAL_RANK
    use_tp_pp_dp_mapping: bool
    multi_node: bool
    node_ips: tuple[str, ...] | None
    seed: int
    exit_signal_handler: bool
    check_weight_hash_across_dp_replicas_interval: int | None
    manual_gc: bool
    manual_gc_interval: int
    manual_gc_eval: bool

    @property
    def rank_order(self) -> str:
        """megatron-core's rank order, innermost first. --use-tp-pp-dp-mapping: pipeline
        neighbours on adjacent ranks, data-parallel replicas strided (the default puts the
        pipeline outermost)."""
        return "tp-cp-ep-pp-dp" if self.use_tp_pp_dp_mapping else "tp-cp-ep-dp-pp"


@dataclass(frozen=True)
class ProfilingConfig(FlagConfig):
    """--trace's spans, --profile's window and ranks, and --record-memory-history's
    snapshots."""

    trace: bool
    trace_dir: str | None
    trace_iters: tuple[int, ...] | None
    profile: bool
    profile_step_start: int
    profile_step_end: int
    profile_ranks: tuple[int, ...]
    profile_dir: str | None
    use_pytorch_profiler: bool
    record_memory_history: bool
    memory_snapshot_path: str


@dataclass(frozen=True)
class TokenizerConfig:
    """--tokenizer-type (after the per-model default) and the files it reads."""

    tokenizer_type: str
    vocab_file: str | None = None
    merge_file: str | None = None
    tokenizer_model: str | None = None
    vocab_size: int | None = None
    # tokens the run needs (--fim-data's sentinels): added where the tokenizer can add
    # tokens (GPT-2 BPE, HF), else the model must hold them
    special_tokens: tuple[str, ...] = ()

    @classmethod
    def from_args(cls, args) -> TokenizerConfig:
        from megatron.trainer.data.fim import FimConfig

        fim = FimConfig.from_args(args)
        return cls(args.tokenizer_type, args.vocab_file, args.merge_file,
                   args.tokenizer_model, args.vocab_size,
                   fim.sentinels if fim is not None else ())

    def build(self):
        from megatron.trainer.data.tokenizer import build_tokenizer

        tokenizer = build_tokenizer(self.tokenizer_type, vocab_file=self.vocab_file,
                                    merge_file=self.merge_file,
                                    tokenizer_model=self.tokenizer_model,
                                    vocab_size=self.vocab_size)
        added = tokenizer.add_special_tokens(self.special_tokens)
        if added:
            log.info(
                "tokenizer: added %s as ids %s (vocabulary size %d)", " ".join(added),
                " ".join(str(tokenizer.vocab[token]) for token in added), tokenizer.vocab_size)
        return tokenizer


@dataclass(frozen=True)
class EmulationConfig(FlagConfig):
    """Emulated variability of the pipeline (megatron/dpp/variability.py's profiles and
    draws, applied by megatron/dpp/transport/emulation.py), seeded by --seed: link delays on chosen edges and straggling compute tasks; off by default."""

    emulate_link_ms: str | None
    emulate_link_gbps: float | None
    emulate_link_edges: str
    emulate_straggler: str | None
    seed: int

    @staticmethod
    def rules(values, need: Need) -> None:
        for parse, text in ((LinkProfile.parse, values.emulate_link_ms),
                            (StragglerProfile.parse, values.emulate_straggler)):
            if text is not None:
                try:
                    parse(text)
                except ValueError as problem:
                    need(False, str(problem))
        gbps = values.emulate_link_gbps
        need(gbps is None or gbps > 0, f"--emulate-link-gbps {gbps} must be > 0")
        need(gbps is None or values.emulate_link_ms is not None,
             "--emulate-link-gbps adds size / G to each message's delay: it needs "
             "--emulate-link-ms (0 for bandwidth alone)")

    def emulation(self) -> Emulation:
        link = None if self.emulate_link_ms is None else LinkProfile.parse(
            self.emulate_link_ms, self.emulate_link_gbps, self.emulate_link_edges)
        straggler = (None if self.emulate_straggler is None
                     else StragglerProfile.parse(self.emulate_straggler))
        return Emulation(self.seed, link, straggler)


@dataclass(frozen=True)
class TrainerConfigs:
    """Every topic's configuration of one run, built once from the validated flags (after
    the fast path has settled for the model, and the tokenizer has said its vocabulary)."""

    model: ModelConfig
    layers: LayerConfig
    parallel: ParallelConfig
    pipeline: PipelineConfig
    data: DataConfig
    schedule: ScheduleConfig
    precision: PrecisionConfig
    fast_path: FastPathConfig
    optimizer: OptimizerConfig
    checkpoint: CheckpointConfig
    logging: LoggingConfig
    emulation: EmulationConfig
    process: ProcessConfig
    profiling: ProfilingConfig
    reruns: RerunConfig
    dpp: DppOptions  # DPP's schedule options (used with --use-dpp)
    # every flag by name, non-plain values as text: W&B's run configuration and the
    # settings the ranks compare at start
    flags: Mapping[str, object] = field(default_factory=lambda: MappingProxyType({}),
                                        compare=False, hash=False, repr=False)

    @classmethod
    def from_args(cls, args, vocab_size: int | None = None,
                  for_model: ModelFastPath | None = None) -> TrainerConfigs:
        """`vocab_size`: the tokenizer's (the model's is padded from it); `for_model`: what
        the model family changes on the fast path (fast_path.resolve_for_model), applied to
        a copy of the flags: the parsed Namespace stays as it is."""
        if for_model is not None and for_model.settings:
            args = argparse.Namespace(**{**vars(args), **for_model.settings})
        fast_path = FastPathConfig.from_args(args)
        if for_model is not None:
            fast_path = dataclasses.replace(fast_path, fast_path_fallbacks=(
                *fast_path.fast_path_fallbacks, *for_model.fallbacks))
        plain = (bool, int, float, str, type(None))
        flags = MappingProxyType({name: value if isinstance(value, plain) else str(value)
                                  for name, value in vars(args).items()})
        return cls(ModelConfig.from_args(args, vocab_size), LayerConfig.from_args(args),
                   ParallelConfig.from_args(args), PipelineConfig.from_args(args),
                   DataConfig.from_args(args), ScheduleConfig.from_args(args),
                   PrecisionConfig.from_args(args), fast_path, OptimizerConfig.from_args(args),
                   CheckpointConfig.from_args(args), LoggingConfig.from_args(args),
                   EmulationConfig.from_args(args), ProcessConfig.from_args(args),
                   ProfilingConfig.from_args(args), RerunConfig.from_args(args),
                   DppOptions.from_args(args), flags)
