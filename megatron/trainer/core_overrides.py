"""Every megatron.core internal the trainer depends on, declared once and checked at start-up.

megatron-core's public API is what the trainer constructs by keyword (TransformerConfig,
OptimizerConfig, ...): a renamed keyword there fails with Python's own TypeError naming it.
What is declared here is what would fail silently, or far from its cause, when
megatron-core changes: functions and classes the trainer patches or replaces, private
names it reads or sets, globals it injects, config fields it assigns, and functions it
calls positionally. `verify()` (the first step of `training.setup`) resolves each target in
the installed megatron-core and compares it with what the trainer was checked on; anything
moved or changed stops the run with one message naming every such target and its user.

The modules that patch go through the declarations here (`Internal.swapped`,
`replace_fallback`, `backward_step`), so a declaration and its use cannot drift apart.
/work/notes/mcore_internals.md has the inventory with the differences between releases.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
import logging

log = logging.getLogger(__name__)

# megatron-core releases every declaration was checked on (setup.py allows >=0.16.1,<0.20)
CHECKED_ON = ("0.16.1", "0.17.1", "0.18.2", "0.19.2")

_MISSING = object()


class CoreInternalsError(RuntimeError):
    """The installed megatron-core lacks or changed internals the trainer relies on."""


@dataclasses.dataclass(frozen=True)
class Internal:
    """One megatron.core name the trainer relies on.

    `target` is "module:attribute.path". `positional`: the leading positional parameters
    the trainer passes, one tuple per megatron-core signature it supports (`variant()` says
    which is installed). `keywords`: parameters it passes by name. `read_by`: text that
    megatron.core's source (of `read_in`, default the target's class or module) must still
    contain for the dependency to mean anything (a global it reads, a method it calls on
    itself). `fields`: dataclass fields the trainer assigns on instances (assigning a
    removed field would silently do nothing). `value`: the value the trainer assumes.
    `fallback`: what megatron-core installs at `target` without apex and Transformer
    Engine (see `replace_fallback`). `stand_in`: a class member of ours that megatron-core
    calls in place of `target` and must take the same parameters."""

    target: str
    how: str  # patched | replaced | private | injected | called | assigned | stand-in
    user: str  # project file and function
    positional: tuple[tuple[str, ...], ...] = ()
    keywords: tuple[str, ...] = ()
    read_by: tuple[str, ...] = ()
    read_in: str | None = None
    fields: tuple[str, ...] = ()
    value: object = _MISSING
    fallback: str | None = None
    stand_in: str | None = None

    def resolve(self):
        return _resolve(self.target)

    def problem(self) -> str | None:
        """Why the installed megatron-core does not satisfy this dependency, or None."""
        if self.how == "injected":  # absent until the trainer puts it there
            return self._unused_reads()
        for name in targets(self):
            try:
                _resolve(name)
            except (ImportError, AttributeError) as error:
                return f"{name} is missing (moved or renamed: {error})"
        value = self.resolve()
        if self.positional or self.keywords:
            names, open_keywords = _parameters(value)
            if names is None:
                return f"{self.target} is no longer a function"
            if self.positional and self.variant_of(names) is None:
                wanted = " or ".join(f"({', '.join(p)})" for p in self.positional)
                return f"{self.target} takes ({', '.join(names)}); expected {wanted}"
            missing = [k for k in self.keywords if k not in names]
            if missing and not open_keywords:
                return f"{self.target} no longer takes {', '.join(missing)}"
        if self.fields:
            declared = {f.name for f in dataclasses.fields(value)}
            missing = [name for name in self.fields if name not in declared]
            if missing:
                return f"{self.target} no longer has the field(s) {', '.join(missing)}"
        if self.value is not _MISSING and value != self.value:
            return f"{self.target} is {value!r}; expected {self.value!r}"
        if self.stand_in is not None:
            ours, _ = _parameters(_resolve(self.stand_in))
            theirs, _ = _parameters(value)
            if ours != theirs:
                return (f"{self.target} takes ({', '.join(theirs or [])}) but its stand-in "
                        f"{self.stand_in} takes ({', '.join(ours or [])})")
        return self._unused_reads()

    def _unused_reads(self) -> str | None:
        if not self.read_by:
            return None
        try:
            source = _source(self)
        except (ImportError, AttributeError) as error:
            return f"{self.read_in} is missing (moved or renamed: {error})"
        unused = [text for text in self.read_by if text not in source]
        if not unused:
            return None
        where = self.read_in or self.target
        return f"{where}: megatron.core no longer uses {', '.join(unused)}"

    def variant_of(self, names: list[str]) -> int | None:
        for index, expected in enumerate(self.positional):
            if tuple(names[: len(expected)]) == expected:
                return index
        return None

    def variant(self) -> int | None:
        """Index into `positional` of the installed signature (None: not a declared one)."""
        return _variant(self, self.resolve())

    def owner_and_name(self):
        """The object holding the target and the target's attribute name."""
        module_name, _, path = self.target.partition(":")
        owner = importlib.import_module(module_name)
        *parents, name = path.split(".")
        for parent in parents:
            owner = getattr(owner, parent)
        return owner, name

    @contextlib.contextmanager
    def swapped(self, replacement):
        """`replacement` at the target while open (also where the target is absent: an
        injected global), the previous state restored afterwards."""
        owner, name = self.owner_and_name()
        original = vars(owner).get(name, _MISSING) if inspect.isclass(owner) else getattr(
            owner, name, _MISSING)
        setattr(owner, name, replacement)
        try:
            yield
        finally:
            if original is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


@functools.lru_cache(maxsize=8)
def _variant(internal: Internal, function) -> int | None:
    names, _ = _parameters(function)
    return None if names is None else internal.variant_of(names)


def _resolve(target: str):
    """The object named "module:attribute.path". An attribute of a class must be the class's
    own: one inherited from a base class is not what was checked (AttributeError)."""
    module_name, _, path = target.partition(":")
    value = importlib.import_module(module_name)
    for part in path.split("."):
        if inspect.isclass(value) and part not in vars(value):
            raise AttributeError(f"{value.__name__}.{part} is not defined by the class itself")
        value = getattr(value, part)
    return value


def _parameters(value) -> tuple[list[str] | None, bool]:
    try:
        signature = inspect.signature(value)
    except (TypeError, ValueError):
        return None, False
    fixed = [p.name for p in signature.parameters.values()
             if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    open_keywords = any(p.kind == p.VAR_KEYWORD for p in signature.parameters.values())
    return fixed, open_keywords


def _source(internal: Internal) -> str:
    """Source of `read_in`, or of the target's class (or module) that must use `read_by`."""
    if internal.read_in is not None:
        owner = _resolve(internal.read_in)
    else:
        module_name, _, path = internal.target.partition(":")
        owner = importlib.import_module(module_name)
        head = path.split(".")[0]
        if len(path.split(".")) > 1 and inspect.isclass(getattr(owner, head, None)):
            owner = getattr(owner, head)
    try:
        return inspect.getsource(owner)
    except (OSError, TypeError):
        return ""


_SCHEDULES = "megatron.core.pipeline_parallel.schedules"
_LAYERS = "megatron.core.tensor_parallel.layers"
_RANDOM = "megatron.core.tensor_parallel.random"
_WGRAD_KERNELS = ("fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32",
                  "fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp16")

# megatron/dpp/schedule.py runs megatron-core's own per-microbatch steps
FORWARD_STEP = Internal(
    f"{_SCHEDULES}:forward_step", "called", "dpp/schedule.py _Iteration._forward",
    positional=(("forward_step_func", "data_iterator", "model", "num_microbatches",
                 "input_tensor", "forward_data_store", "config"),),
    keywords=("cp_group_size", "collect_non_loss_data", "is_first_microbatch",
              "current_microbatch", "vp_stage", "is_last_stage"))
BACKWARD_STEP = Internal(
    f"{_SCHEDULES}:backward_step", "called",
    "dpp/schedule.py _Iteration._backward (through core_overrides.backward_step)",
    positional=(("input_tensor", "output_tensor", "output_tensor_grad", "model_type",
                 "config"),  # <= 0.16
                ("input_tensor", "output_tensor", "output_tensor_grad", "config")))
DEALLOCATE_OUTPUT_TENSOR = Internal(
    f"{_SCHEDULES}:deallocate_output_tensor", "called", "dpp/schedule.py _Iteration._forward",
    positional=(("out", "deallocate_pipeline_outputs"),))
# dpp/weight_grad.py: the B/W split without pipelining swaps BACKWARD_STEP during the call
NO_PIPELINING_CALLS_BACKWARD_STEP = Internal(
    f"{_SCHEDULES}:forward_backward_no_pipelining", "patched",
    "dpp/weight_grad.py SplitBackwardNoPipelining (swaps the module's backward_step)",
    read_by=("backward_step(",), read_in=f"{_SCHEDULES}:forward_backward_no_pipelining")
GLOBAL_MEMORY_BUFFER = Internal(
    "megatron.core.utils:GlobalMemoryBuffer.__init__", "private",
    "dpp/weight_grad.py _owned (the shared gather buffers)", read_by=("self.buffer = {}",))
# trainer/rng.py keys megatron-core's RNG tracker streams and reads each layer's microbatch
MICROBATCH_OF_LAYERS = Internal(
    f"{_SCHEDULES}:set_current_microbatch", "private",
    "trainer/rng.py ForwardRng._microbatch (TransformerLayer.current_microbatch)",
    read_by=(".current_microbatch = ",), read_in=f"{_SCHEDULES}:set_current_microbatch")
FORWARD_STEP_SETS_MICROBATCH = Internal(
    f"{_SCHEDULES}:forward_step", "private", "trainer/rng.py ForwardRng._microbatch",
    read_by=("set_current_microbatch(",), read_in=f"{_SCHEDULES}:forward_step")
MODEL_PARALLEL_RNG = Internal(
    f"{_RANDOM}:_MODEL_PARALLEL_RNG_TRACKER_NAME", "private", "trainer/rng.py ForwardRng._stream",
    value="model-parallel-rng")
EXPERT_PARALLEL_RNG = Internal(
    f"{_RANDOM}:_EXPERT_PARALLEL_RNG_TRACKER_NAME", "private",
    "trainer/rng.py ForwardRng._stream", value="expert-parallel-rng")
# the callbacks the trainer and DPP set on megatron-core's config
SCHEDULE_HOOKS = Internal(
    "megatron.core.model_parallel_config:ModelParallelConfig", "assigned",
    "trainer/training.py _install_schedule_hooks, start_tracing",
    fields=("no_sync_func", "grad_sync_func", "finalize_model_grads_func", "grad_scale_func",
            "timers"))
# no_apex.foreach_multi_tensor_ops: megatron-core's fallbacks swapped while training
CLIP_GRADS_L2_NORM = Internal(
    "megatron.core.optimizer.clip_grads:l2_norm_impl", "patched",
    "trainer/no_apex.py foreach_multi_tensor_ops",
    fallback="megatron.core.utils:local_multi_tensor_l2_norm")
CLIP_GRADS_SCALE = Internal(
    "megatron.core.optimizer.clip_grads:multi_tensor_scale_impl", "patched",
    "trainer/no_apex.py foreach_multi_tensor_ops",
    fallback="megatron.core.utils:local_multi_tensor_scale")
OPTIMIZER_SCALE = Internal(
    "megatron.core.optimizer.optimizer:multi_tensor_scale_impl", "patched",
    "trainer/no_apex.py foreach_multi_tensor_ops",
    fallback="megatron.core.utils:local_multi_tensor_scale")
LOCAL_L2_NORM = Internal(
    "megatron.core.utils:local_multi_tensor_l2_norm", "called",
    "trainer/no_apex.py foreach_l2_norm (the contract it keeps)",
    positional=(("chunk_size", "noop_flag", "tensor_lists", "per_tensor"),))
LOCAL_SCALE = Internal(
    "megatron.core.utils:local_multi_tensor_scale", "called",
    "trainer/no_apex.py foreach_scale (the contract it keeps)",
    positional=(("chunk_size", "noop_flag", "tensor_lists", "scale"),))
# no_apex.weight_grad_accumulation_fusion: apex's module stood in for
GRAD_ACCUM_FUSION_AVAILABLE = Internal(
    f"{_LAYERS}:_grad_accum_fusion_available", "private",
    "trainer/no_apex.py weight_grad_accumulation_fusion, dpp/weight_grad.py",
    read_by=_WGRAD_KERNELS)
WGRAD_KERNELS = Internal(
    f"{_LAYERS}:fused_weight_gradient_mlp_cuda", "injected",
    "trainer/no_apex.py weight_grad_accumulation_fusion, dpp/weight_grad.py "
    "weight_grads_deferred", read_by=_WGRAD_KERNELS)
# the torch optimizers inside megatron-core's
MEGATRON_OPTIMIZER = Internal(
    "megatron.core.optimizer.optimizer:MegatronOptimizer.__init__", "private",
    "trainer/no_apex.py torch_optimizers, trainer/checkpointing.py _create_adam_states",
    read_by=("self.optimizer = optimizer",))
CHAINED_OPTIMIZER = Internal(
    "megatron.core.optimizer.optimizer:ChainedOptimizer.__init__", "private",
    "trainer/no_apex.py torch_optimizers, trainer/checkpointing.py _create_adam_states",
    read_by=("self.chained_optimizers = chained_optimizers",))
# fused_layers.install_fused_layers
COLUMN_PARALLEL_FORWARD_IMPL = Internal(
    f"{_LAYERS}:ColumnParallelLinear._forward_impl", "replaced",
    "trainer/fused_layers.py install_fused_layers (per instance)",
    positional=(("self", "input", "weight"),),
    read_by=("self._forward_impl(", "gradient_accumulation_fusion=", "allreduce_dgrad=",
             "sequence_parallel=", "grad_output_buffer="))
VOCAB_PARALLEL_EMBEDDING_FORWARD = Internal(
    f"{_LAYERS}:VocabParallelEmbedding.forward", "replaced",
    "trainer/fused_layers.py WordEmbeddingIntoMainGrad (class swapped)",
    positional=(("self", "input_"),),
    read_by=("self.tp_group", "self.reduce_scatter_embeddings"))
# cuda_graphs.install_block_graphs
TRANSFORMER_BLOCK_FORWARD = Internal(
    "megatron.core.transformer.transformer_block:TransformerBlock.forward", "replaced",
    "trainer/cuda_graphs.py install_block_graphs (per instance)",
    positional=(("self", "hidden_states", "attention_mask"),),
    read_by=("self.pre_process", "self.input_tensor"))
TRANSFORMER_BLOCK_SET_INPUT = Internal(
    "megatron.core.transformer.transformer_block:TransformerBlock.set_input_tensor", "called",
    "trainer/cuda_graphs.py BlockGraphs._run", positional=(("self", "input_tensor"),))
# models.py
BERT_MASK_CHECK = Internal(
    "megatron.core.models.bert.bert_model:"
    "BertModel._sanity_check_attention_and_get_attn_mask_dimension", "replaced",
    "trainer/models.py SDPABertModel", positional=(("self",),),
    read_by=("self._sanity_check_attention_and_get_attn_mask_dimension()",))
LANGUAGE_MODEL_LOSS = Internal(
    "megatron.core.models.common.language_module.language_module:"
    "LanguageModule.compute_language_model_loss", "replaced",
    "trainer/models.py LanguageModelLoss", positional=(("self", "labels", "logits"),))
CORE_ATTENTION_INIT = Internal(
    "megatron.core.transformer.dot_product_attention:DotProductAttention.__init__",
    "stand-in", "trainer/attention.py SDPAttention (the core attention of our specs)",
    stand_in="megatron.trainer.attention:SDPAttention.__init__")
CORE_ATTENTION_FORWARD = Internal(
    "megatron.core.transformer.dot_product_attention:DotProductAttention.forward",
    "stand-in", "trainer/attention.py SDPAttention.forward",
    stand_in="megatron.trainer.attention:SDPAttention.forward")
# --defer-embedding-wgrad-compute: dpp/output_weight_grad.py takes the output layer's
# buffered inputs and output gradients out by microbatch and runs their GEMMs itself;
# models.py gives the other column-parallel linears a config without the deferral
OUTPUT_LAYER_DEFERRAL = Internal(
    f"{_LAYERS}:ColumnParallelLinear.forward", "private",
    "dpp/output_weight_grad.py DeferredOutputWeightGrads, trainer/models.py "
    "_defer_only_in_output_layer",
    read_by=("if self.config.defer_embedding_wgrad_compute:",
             "self.embedding_activation_buffer.append(input_parallel)",
             "self.grad_output_buffer if self.config.defer_embedding_wgrad_compute else None"))
OUTPUT_LAYER_GRAD_BUFFER = Internal(
    f"{_LAYERS}:LinearWithGradAccumulationAndAsyncCommunication.backward", "private",
    "dpp/output_weight_grad.py DeferredOutputWeightGrads.after_backward",
    read_by=("grad_output_buffer.append(grad_output)",))
GPT_OUTPUT_LAYER_BUFFERS = Internal(
    "megatron.core.models.gpt.gpt_model:GPTModel.__init__", "private",
    "dpp/output_weight_grad.py DeferredOutputWeightGrads",
    read_by=("self.embedding_activation_buffer = []", "self.grad_output_buffer = []"))
DRAIN_EMBEDDING_WGRAD = Internal(
    "megatron.core.utils:drain_embedding_wgrad_compute", "private",
    "trainer/no_apex.py _importable_by_name (the module megatron-core's schedules' drain "
    "imports)",
    read_by=("import fused_weight_gradient_mlp_cuda",),
    read_in="megatron.core.utils:drain_embedding_wgrad_compute")
# models.py: multi-latent attention with the local layers
MLA_CORE_ATTENTION = Internal(
    "megatron.core.transformer.multi_latent_attention:MultiLatentAttention.__init__", "private",
    "trainer/attention.py MLASDPAttention (the head dims MLA builds its core attention with)",
    read_by=("k_channels=self.q_head_dim", "v_channels=self.config.v_head_dim",
             "softmax_scale=self.softmax_scale"))
MLA_HAVE_TE = Internal(
    "megatron.core.transformer.multi_latent_attention:HAVE_TE", "patched",
    "trainer/models.py _mla_without_transformer_engine (False while building without TE)",
    read_by=("isinstance(self.linear_proj, TELinear)",))
MLA_SUBMODULES = Internal(
    "megatron.core.transformer.multi_latent_attention:MLASelfAttentionSubmodules", "assigned",
    "trainer/models.py _local_mla_spec", fields=("core_attention", "q_layernorm", "kv_layernorm"))
# models.py edits the local layer specs' submodules (assigning a removed field would be ignored)
LAYER_SUBMODULES = Internal(
    "megatron.core.transformer.transformer_layer:TransformerLayerSubmodules", "assigned",
    "trainer/models.py _with_norms, _with_sdpa, _with_triton_bias_dropout_add",
    fields=("input_layernorm", "pre_mlp_layernorm", "self_attention", "self_attn_bda",
            "mlp_bda"))
# gelu_mlp.install: the dense MLP's forward, per instance, where gelu_mlp.applies_to holds
MLP_FORWARD = Internal(
    "megatron.core.transformer.mlp:MLP.forward", "replaced", "trainer/gelu_mlp.py install",
    positional=(("self", "hidden_states", "per_token_scale"),),
    read_by=("self.linear_fc1", "self.linear_fc2", "bias_gelu_impl(intermediate_parallel, "
             "bias_parallel)", "self.activation_func = ", "return output, output_bias"))
# triton_gelu.installed: the MLP's bias-GeLU, which it imports by name
MLP_BIAS_GELU = Internal(
    "megatron.core.transformer.mlp:bias_gelu_impl", "replaced", "trainer/triton_gelu.py installed",
    read_by=("bias_gelu_impl(",))
SELF_ATTENTION_SUBMODULES = Internal(
    "megatron.core.transformer.attention:SelfAttentionSubmodules", "assigned",
    "trainer/models.py _with_sdpa", fields=("core_attention",))
# norms.py: torch's norms tagged for megatron-core's sum of sequence-parallel gradients
SEQUENCE_PARALLEL_NORM = Internal(
    "megatron.core.transformer.torch_norm:WrappedTorchNorm.__new__", "stand-in",
    "trainer/norms.py SequenceParallelNorm (the local specs' norms under --sequence-parallel)",
    stand_in="megatron.trainer.norms:SequenceParallelNorm.__new__")
SEQUENCE_PARALLEL_GRAD_SUM = Internal(
    "megatron.core.distributed.finalize_model_grads:_allreduce_non_tensor_model_parallel_grads",
    "private", "trainer/norms.py SequenceParallelNorm (param.sequence_parallel)",
    read_by=('getattr(param, "sequence_parallel", False)',),
    read_in="megatron.core.distributed.finalize_model_grads:"
            "_allreduce_non_tensor_model_parallel_grads")
# checkpointing.py
SHARDED_OBJECT = Internal(
    "megatron.core.dist_checkpointing.mapping:ShardedObject.__init__", "called",
    "trainer/checkpointing.py _rng_sharded_object",
    positional=(("self", "key", "data", "global_shape", "global_offset"),),
    keywords=("replica_id",))
DISTRIBUTED_OPTIMIZER_STATE = Internal(
    "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.sharded_state_dict",
    "called", "trainer/checkpointing.py _sharded_state",
    positional=(("self", "model_sharded_state_dict"),),
    keywords=("is_loading", "metadata"), read_by=("dp_reshardable",))
WRITE_RESULTS_QUEUE = Internal(
    "megatron.core.dist_checkpointing.strategies.filesystem_async:_results_queue", "private",
    "trainer/checkpointing.py _keep_write_results_in_process (no multiprocessing Manager)",
    read_by=("if _results_queue is None",))
# checkpointing._staged_in_shared_memory: an async request's args are (rank, write buckets,
# results queue) and its preload_fn stages the buckets (--async-ckpt-use-cpu-shm)
ASYNC_WRITE_BUCKETS = Internal(
    "megatron.core.dist_checkpointing.strategies.filesystem_async:"
    "FileSystemWriterAsync.get_save_function_and_args", "private",
    "trainer/checkpointing.py _staged_in_shared_memory",
    read_by=("self.write_buckets, self.results_queue]",
             "partial(self.preload_tensors, self.write_buckets"),
    read_in="megatron.core.dist_checkpointing.strategies.filesystem_async:"
            "FileSystemWriterAsync.get_save_function_and_args")
ASYNC_REQUEST_PRELOAD = Internal(
    "megatron.core.dist_checkpointing.strategies.async_utils:AsyncRequest.execute_sync",
    "private", "trainer/checkpointing.py _staged_in_shared_memory",
    read_by=("async_fn_args[1] = self.preload_fn()",))
WRITE_BUCKET = Internal(
    "megatron.core.dist_checkpointing.strategies.filesystem_async:"
    "FileSystemWriterAsync.write_preloaded_data", "patched",
    "trainer/checkpointing.py _write_errors_raised (a failed write keeps its error)",
    positional=(("transform_list", "local_proc_idx", "write_bucket", "results_queue",
                 "count_queue", "use_fsync"),),
    read_by=("FileSystemWriterAsync.write_preloaded_data",))
# cpu_compat.CpuCompat: activation recomputation's CUDA generator state, on CPU
GET_CUDA_RNG_STATE = Internal(
    f"{_RANDOM}:_get_cuda_rng_state", "patched", "trainer/cpu_compat.py CpuCompat",
    read_by=("_get_cuda_rng_state(",), read_in=f"{_RANDOM}:_get_all_rng_states")
SET_CUDA_RNG_STATE = Internal(
    f"{_RANDOM}:_set_cuda_rng_state", "patched", "trainer/cpu_compat.py CpuCompat",
    read_by=("_set_cuda_rng_state(",), read_in=f"{_RANDOM}:_set_all_rng_states")
# reruns.py: megatron-core's rerun state machine, our subclass installed as its global
_RERUNS = "megatron.core.rerun_state_machine"
SET_RERUN_STATE_MACHINE = Internal(
    f"{_RERUNS}:_set_rerun_state_machine", "private",
    "trainer/reruns.py ResultValidation.start (installs our subclass)",
    positional=(("rerun_state_machine",),), read_by=("_GLOBAL_RERUN_STATE_MACHINE = ",))
RERUN_STATS_REPORT = Internal(
    f"{_RERUNS}:RerunStateMachine._maybe_report_stats", "replaced",
    "trainer/reruns.py _StateMachine._maybe_report_stats (report_stats' log)",
    positional=(("self",),),
    read_by=("self._maybe_report_stats()", "self.stats[caller].record(",
             "REPORTING_INTERVAL_ITERATIONS"))
RERUN_FAILED_CALL = Internal(
    f"{_RERUNS}:RerunStateMachine.validate_result", "private",
    "trainer/reruns.py ResultValidation.verdict (names the check that failed)",
    read_by=("self.failed_validation_call = validation_call",),
    read_in=f"{_RERUNS}:RerunStateMachine.validate_result")
# positional calls of public constructors
DATASET_BUILDER = Internal(
    "megatron.core.datasets.blended_megatron_dataset_builder:"
    "BlendedMegatronDatasetBuilder.__init__", "called", "trainer/data.py _build",
    positional=(("self", "cls", "sizes", "is_built_on_rank", "config"),))
BLENDING_INDICES = Internal(
    "megatron.core.datasets.helpers:build_blending_indices", "called",
    "trainer/documents.py (megatron-core's compiled helper)")
FLOAT16_MODULE = Internal(
    "megatron.core.transformer.module:Float16Module.__init__", "called",
    "trainer/optimizer.py wrap_model_chunks", positional=(("self", "config", "module"),))
GET_MEGATRON_OPTIMIZER = Internal(
    "megatron.core.optimizer:get_megatron_optimizer", "called",
    "trainer/optimizer.py build_optimizer", positional=(("config", "model_chunks"),))
# dpp/tracing.py MegatronTimers reads the schedules' timer names
SCHEDULE_TIMER_NAMES = Internal(
    f"{_SCHEDULES}:get_forward_backward_func", "called",
    "dpp/tracing.py MegatronTimers (the schedules' timer names)",
    read_by=("'forward-compute'", "'backward-compute'"))
P2P_TIMER_NAMES = Internal(
    "megatron.core.pipeline_parallel.p2p_communication:P2PCommunicator", "called",
    "dpp/tracing.py MegatronTimers (the p2p timer names)", read_by=("-send'", "-recv'"))

INTERNALS = tuple(value for value in dict(globals()).values() if isinstance(value, Internal))


@dataclasses.dataclass(frozen=True)
class Feature:
    """A megatron-core behaviour the trainer uses where the installed release has it and does
    without otherwise: not checked by verify(), asked by `present()`."""

    internal: Internal

    def present(self) -> bool:
        return _present(self.internal)


@functools.cache
def _present(internal: Internal) -> bool:
    return internal.problem() is None


# models.py: a layer's input and pre-MLP norms may return (output, residual); TransformerLayer
# then adds that residual back (megatron-core >= 0.18; 0.16 keeps its own input)
LAYER_TAKES_NORM_RESIDUAL = Feature(Internal(
    "megatron.core.transformer.transformer_layer:TransformerLayer", "private",
    "trainer/models.py _with_norms (triton_norm.TritonResidualNorm)",
    read_by=("input_layernorm_output, residual = input_layernorm_output",
             "pre_mlp_layernorm_output, residual = pre_mlp_layernorm_output")))


def verify(internals=INTERNALS) -> None:
    """Raise CoreInternalsError naming every unmet dependency (the first step of start-up)."""
    problems = [(internal, internal.problem()) for internal in internals]
    problems = [(internal, why) for internal, why in problems if why is not None]
    version = installed_version()
    if problems:
        lines = [f"{why} -- needed by megatron/{internal.user} ({internal.how})"
                 for internal, why in problems]
        raise CoreInternalsError(
            f"megatron-core {version} changed internals this trainer relies on (checked on "
            f"{', '.join(CHECKED_ON)}):\n  " + "\n  ".join(lines))
    if version not in CHECKED_ON:
        log.warning("megatron-core %s: not one of the releases the trainer was checked on "
                    "(%s); every internal it relies on is present", version, ", ".join(CHECKED_ON))


def installed_version() -> str:
    try:
        from megatron.core import package_info
    except ImportError:
        return "(unknown version)"
    return package_info.__version__


def targets(internal: Internal) -> tuple[str, ...]:
    """The megatron.core names a declaration depends on (its target and fallback)."""
    return tuple(t for t in (internal.target, internal.fallback) if t is not None)


def _kernel_origin(value) -> str | None:
    """'apex' or 'Transformer Engine' for the compiled kernels megatron-core imports when it
    finds them (their module names), None for anything else."""
    module = getattr(value, "__module__", None) or ""
    if module.startswith("transformer_engine"):
        return "Transformer Engine"
    if module.startswith(("amp_C", "apex")):
        return "apex"
    return None


@contextlib.contextmanager
def replace_fallback(internal: Internal, replacement):
    """`replacement` at `internal.target` while open, where megatron-core installed its
    no-apex fallback there; apex's or Transformer Engine's kernel, when that is what it
    found, stays. Anything else there stops the run. Yields what is in effect, in words."""
    current = internal.resolve()
    if current is replacement:  # entered again inside itself: already in place
        yield f"{_name(replacement)} (ours)"
        return
    if current is _resolve(internal.fallback):
        with internal.swapped(replacement):
            yield f"{_name(replacement)} (ours, for {_name(current)})"
        return
    origin = _kernel_origin(current)
    if origin is None:
        raise CoreInternalsError(
            f"{internal.target} is {_name(current)}: neither megatron-core's fallback "
            f"{internal.fallback} nor an apex / Transformer Engine kernel -- needed by "
            f"megatron/{internal.user}")
    yield f"{origin}'s {_name(current)}"


def _name(value) -> str:
    return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', value)}"


def backward_step(input_tensor, output_tensor, output_tensor_grad, config):
    """megatron-core's schedules.backward_step under every supported release (0.16 also
    takes the model type, dropped in 0.17)."""
    from megatron.core.pipeline_parallel import schedules

    function = schedules.backward_step
    if _variant(BACKWARD_STEP, function) == 0:
        from megatron.core.enums import ModelType

        return function(input_tensor, output_tensor, output_tensor_grad,
                        ModelType.encoder_or_decoder, config)
    return function(input_tensor, output_tensor, output_tensor_grad, config)
