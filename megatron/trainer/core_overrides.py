"""Every megatron.core internal the trainer depends on, declared once and checked at start-up.

PROTOTYPE (issue 20): nothing imports this module yet; /work/notes/mcore_internals.md has
the full inventory and the plan to route the patches through it.

megatron-core's public API is what the trainer constructs by keyword (TransformerConfig,
OptimizerConfig, ...): a renamed keyword there fails with Python's own TypeError naming it.
What is declared here is what fails silently or far from its cause when megatron-core
changes: functions and classes the trainer patches or replaces, private names it reads or
sets, globals it injects, and functions it calls positionally. `verify()` resolves each
target in the installed megatron-core and compares its parameters with the versions the
trainer was checked on; anything moved or changed stops the run with one message naming
every such target and the project code that needs it.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass

CHECKED_ON = ("0.16.1", "0.19.2")


class CoreInternalsError(RuntimeError):
    """The installed megatron-core lacks or changed internals the trainer relies on."""


@dataclass(frozen=True)
class Internal:
    """One megatron.core name the trainer relies on.

    `target` is "module:attribute.path". `positional`: the leading positional parameters
    the trainer passes, one tuple per megatron-core signature it supports (a call site
    then asks `variant()` which one is installed). `keywords`: parameters it passes by
    name. `read_by`: names that megatron.core's own source must still use for the
    dependency to mean anything (a global it reads, a method it calls on itself)."""

    target: str
    how: str  # patched | replaced | private | injected | called | stand-in
    user: str  # project file and function
    positional: tuple[tuple[str, ...], ...] = ()
    keywords: tuple[str, ...] = ()
    read_by: tuple[str, ...] = ()
    stand_in: str | None = None  # "module:attribute" of ours that must take the same parameters

    def resolve(self):
        return _resolve(self.target)

    def problem(self) -> str | None:
        """Why the installed megatron-core does not satisfy this dependency, or None."""
        try:
            value = self.resolve()
        except (ImportError, AttributeError):
            return f"{self.target} is missing (moved or renamed)"
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
        if self.stand_in is not None:
            ours, _ = _parameters(_resolve(self.stand_in))
            theirs, _ = _parameters(value)
            if ours != theirs:
                return (f"{self.target} takes ({', '.join(theirs or [])}) but its stand-in "
                        f"{self.stand_in} takes ({', '.join(ours or [])})")
        if self.read_by:
            source = _source(self)
            unused = [name for name in self.read_by if name not in source]
            if unused:
                return f"{self.target}: megatron.core no longer uses {', '.join(unused)}"
        return None

    def variant_of(self, names: list[str]) -> int | None:
        for index, expected in enumerate(self.positional):
            if tuple(names[: len(expected)]) == expected:
                return index
        return None

    def variant(self) -> int:
        """Index into `positional` of the installed signature (after verify())."""
        names, _ = _parameters(self.resolve())
        return self.variant_of(names)


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
    """Source of the module (or class) that must still read `read_by`."""
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

INTERNALS = (
    # megatron/dpp/schedule.py runs megatron-core's own per-microbatch steps
    Internal(f"{_SCHEDULES}:forward_step", "called", "dpp/schedule.py _Iteration._forward",
             positional=(("forward_step_func", "data_iterator", "model", "num_microbatches",
                          "input_tensor", "forward_data_store", "config"),),
             keywords=("cp_group_size", "collect_non_loss_data", "is_first_microbatch",
                       "current_microbatch", "vp_stage", "is_last_stage")),
    Internal(f"{_SCHEDULES}:backward_step", "called", "dpp/schedule.py _Iteration._backward",
             positional=(("input_tensor", "output_tensor", "output_tensor_grad", "model_type",
                          "config"),  # <= 0.16
                         ("input_tensor", "output_tensor", "output_tensor_grad", "config"))),
    Internal(f"{_SCHEDULES}:deallocate_output_tensor", "called",
             "dpp/schedule.py _Iteration._forward",
             positional=(("out", "deallocate_pipeline_outputs"),)),
    # no_apex.foreach_multi_tensor_ops: module globals swapped while the trainer runs
    Internal("megatron.core.optimizer.clip_grads:l2_norm_impl", "patched",
             "training/no_apex.py foreach_multi_tensor_ops",
             positional=(("chunk_size", "noop_flag", "tensor_lists", "per_tensor"),)),
    Internal("megatron.core.optimizer.clip_grads:multi_tensor_scale_impl", "patched",
             "training/no_apex.py foreach_multi_tensor_ops",
             positional=(("chunk_size", "noop_flag", "tensor_lists", "scale"),)),
    Internal("megatron.core.optimizer.optimizer:multi_tensor_scale_impl", "patched",
             "training/no_apex.py foreach_multi_tensor_ops",
             positional=(("chunk_size", "noop_flag", "tensor_lists", "scale"),)),
    Internal("megatron.core.utils:local_multi_tensor_l2_norm", "private",
             "training/no_apex.py foreach_multi_tensor_ops (the fallback it replaces)"),
    Internal("megatron.core.utils:local_multi_tensor_scale", "private",
             "training/no_apex.py foreach_multi_tensor_ops (the fallback it replaces)"),
    # no_apex.weight_grad_accumulation_fusion: apex's module stood in for
    Internal(f"{_LAYERS}:_grad_accum_fusion_available", "private",
             "training/no_apex.py weight_grad_accumulation_fusion",
             read_by=("fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32",
                      "fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp16")),
    # fused_layers.install_fused_layers
    Internal(f"{_LAYERS}:ColumnParallelLinear._forward_impl", "replaced",
             "training/fused_layers.py install_fused_layers (per instance)",
             positional=(("self", "input", "weight"),),
             read_by=("self._forward_impl(", "gradient_accumulation_fusion=",
                      "allreduce_dgrad=", "sequence_parallel=", "grad_output_buffer=")),
    Internal(f"{_LAYERS}:VocabParallelEmbedding.forward", "replaced",
             "training/fused_layers.py WordEmbeddingIntoMainGrad (class swapped)",
             positional=(("self", "input_"),),
             read_by=("self.tp_group", "self.reduce_scatter_embeddings")),
    # cuda_graphs.install_block_graphs
    Internal("megatron.core.transformer.transformer_block:TransformerBlock.forward",
             "replaced", "training/cuda_graphs.py install_block_graphs (per instance)",
             positional=(("self", "hidden_states", "attention_mask"),),
             read_by=("self.pre_process", "self.input_tensor")),
    Internal("megatron.core.transformer.transformer_block:TransformerBlock.set_input_tensor",
             "called", "training/cuda_graphs.py BlockGraphs._run",
             positional=(("self", "input_tensor"),)),
    # models.py
    Internal("megatron.core.models.bert.bert_model:"
             "BertModel._sanity_check_attention_and_get_attn_mask_dimension", "replaced",
             "training/models.py SDPABertModel", positional=(("self",),),
             read_by=("self._sanity_check_attention_and_get_attn_mask_dimension()",)),
    Internal("megatron.core.models.common.language_module.language_module:"
             "LanguageModule.compute_language_model_loss", "replaced",
             "training/models.py LanguageModelLoss",
             positional=(("self", "labels", "logits"),)),
    Internal("megatron.core.transformer.dot_product_attention:DotProductAttention.__init__",
             "stand-in", "training/attention.py SDPAttention (the core attention of our specs)",
             stand_in="megatron.trainer.attention:SDPAttention.__init__"),
    Internal("megatron.core.transformer.dot_product_attention:DotProductAttention.forward",
             "stand-in", "training/attention.py SDPAttention.forward",
             stand_in="megatron.trainer.attention:SDPAttention.forward"),
    # positional calls of public constructors
    Internal("megatron.core.num_microbatches_calculator:ConstantNumMicroBatchesCalculator"
             ".__init__", "called", "training/training.py _batch_calculator",
             positional=(("self", "global_batch_size", "micro_batch_size", "data_parallel_size",
                          "decrease_batch_size_if_needed", "rank"),)),
    Internal("megatron.core.dist_checkpointing.mapping:ShardedObject.__init__", "called",
             "training/checkpointing.py _rng_sharded_object",
             positional=(("self", "key", "data", "global_shape", "global_offset"),),
             keywords=("replica_id",)),
    Internal("megatron.core.datasets.blended_megatron_dataset_builder:"
             "BlendedMegatronDatasetBuilder.__init__", "called", "training/data.py _build",
             positional=(("self", "cls", "sizes", "is_built_on_rank", "config"),)),
    Internal("megatron.core.transformer.module:Float16Module.__init__", "called",
             "training/optimizer.py wrap_model_chunks",
             positional=(("self", "config", "module"),)),
    Internal("megatron.core.optimizer:get_megatron_optimizer", "called",
             "training/optimizer.py build_optimizer", positional=(("config", "model_chunks"),)),
    Internal("megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.sharded_state_dict",
             "called", "training/checkpointing.py _sharded_state",
             positional=(("self", "model_sharded_state_dict"),),
             keywords=("is_loading", "metadata"), read_by=("dp_reshardable",)),
    # dpp/tracing.py MegatronTimers reads the schedules' timer names
    Internal(f"{_SCHEDULES}:get_forward_backward_func", "called",
             "dpp/tracing.py MegatronTimers (the schedules' timer names)",
             read_by=("'forward-compute'", "'backward-compute'")),
    Internal("megatron.core.pipeline_parallel.p2p_communication:P2PCommunicator", "called",
             "dpp/tracing.py MegatronTimers (the p2p timer names)",
             read_by=("-send'", "-recv'")),
)


def verify(internals=INTERNALS) -> None:
    """Raise CoreInternalsError naming every unmet dependency (call once at start-up)."""
    problems = [(internal, internal.problem()) for internal in internals]
    problems = [(internal, why) for internal, why in problems if why is not None]
    if not problems:
        return
    version = installed_version()
    lines = [f"{why} -- needed by megatron/{internal.user} ({internal.how})"
             for internal, why in problems]
    raise CoreInternalsError(
        f"megatron-core {version} changed internals this trainer relies on (checked on "
        f"{', '.join(CHECKED_ON)}):\n  " + "\n  ".join(lines))


def installed_version() -> str:
    try:
        from megatron.core import package_info
    except ImportError:
        return "(unknown version)"
    return package_info.__version__


def internal(target_suffix: str) -> Internal:
    """The declaration whose target ends with `target_suffix` (e.g. ":backward_step")."""
    matches = [i for i in INTERNALS if i.target.endswith(target_suffix)]
    if len(matches) != 1:
        raise KeyError(f"{len(matches)} declared internals end with {target_suffix!r}")
    return matches[0]
