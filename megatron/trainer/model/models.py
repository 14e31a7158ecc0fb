"""Model construction: layer specs, TransformerConfig from the run's typed configurations
(`configs`, config/configs.py's TrainerConfigs), GPT/BERT stage builders, and an
initialisation that does not depend on the parallel layout."""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import logging
import zlib

import torch
from megatron.core import parallel_state
from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec
from megatron.core.models.bert.bert_model import BertModel
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron.trainer.core_compat import core_overrides
from megatron.trainer.kernels import triton_dropout
from megatron.trainer.kernels.cross_entropy import vocab_parallel_cross_entropy
from megatron.trainer.kernels.fused_layers import install_fused_layers
from megatron.trainer.kernels.norms import SequenceParallelNorm
from megatron.trainer.kernels.triton_norm import TritonNorm, TritonResidualNorm
from megatron.trainer.model import gelu_mlp
from megatron.trainer.model.attention import MLA_SDPA_BY_BACKEND, SDPA_BY_BACKEND

log = logging.getLogger(__name__)


class ModelFlagError(ValueError):
    """Flags the model cannot be built with on this machine (a missing Transformer Engine, an
    attention backend that cannot run here); reported as a flag error (run/failures.py)."""


def transformer_engine_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def use_transformer_engine(configs) -> bool:
    impl = configs.model.transformer_impl
    if impl == "transformer_engine":
        if not transformer_engine_available():
            raise ModelFlagError("--transformer-impl transformer_engine: Transformer Engine is not "
                               "importable (or there is no GPU)")
        return True
    return impl == "auto" and transformer_engine_available()


# TransformerConfig's fields that take the value of the same name, by topic of `configs`
_FIELDS_BY_TOPIC = {
    "model": ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
              "num_query_groups", "kv_channels", "hidden_dropout", "attention_dropout",
              "init_method_std", "normalization", "rotary_interleaved"),
    "layers": ("apply_residual_connection_post_layernorm", "attention_softmax_in_fp32",
               "apply_query_key_layer_scaling", "deterministic_mode", "qk_layernorm",
               "test_mode", "recompute_granularity", "recompute_method",
               "recompute_num_layers"),
    "parallel": ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                 "virtual_pipeline_model_parallel_size", "sequence_parallel"),
    "pipeline": ("account_for_embedding_in_pipeline_split",
                 "account_for_loss_in_pipeline_split", "batch_p2p_sync",
                 "defer_embedding_wgrad_compute"),
    "precision": ("fp32_residual_connection", "fp16", "bf16", "params_dtype"),
    "fast_path": ("cross_entropy_loss_fusion",),
}


def transformer_config(configs) -> TransformerConfig:
    """megatron-core's TransformerConfig (MLATransformerConfig with
    --multi-latent-attention) of the run's configurations."""
    model, layers, pipeline = configs.model, configs.layers, configs.pipeline
    schedule, fast_path, data = configs.schedule, configs.fast_path, configs.data
    te = use_transformer_engine(configs)
    if te and schedule.dpp_split_backward:
        raise ModelFlagError("--dpp-split-backward: Transformer Engine's layers compute their "
                           "weight gradients in their own backward; use --transformer-impl local")
    on_gpu = torch.cuda.is_available()
    if not batch_p2p_comm(configs) and not pipeline.no_batch_p2p_comm and not schedule.use_dpp:
        log.info("megatron-core's schedule at --pipeline-model-parallel-size 2 with virtual "
                 "stages: unbatched p2p (as --no-batch-p2p-comm); batched p2p to the one "
                 "neighbour would swap activations and gradients")
    lengths_vary = data.seq_length_cv > 0 or data.variable_seq_lengths
    overlap_p2p = pipeline.overlap_p2p_communication_warmup_flush
    kwargs = dict(
        {name: getattr(getattr(configs, topic), name)
         for topic, names in _FIELDS_BY_TOPIC.items() for name in names},
        layernorm_epsilon=model.norm_epsilon,
        add_bias_linear=not model.disable_bias_linear,
        gated_linear_unit=model.swiglu,
        activation_func=_activation(model),
        # the fused bias ops go through torch.compile: seconds of compilation per process
        # on CPU for no gain there, so only on GPU. As in Megatron-LM, the fused GeLU is
        # the tanh approximation (differs from the exact GeLU by < 5e-4); megatron-core
        # fuses no squared ReLU
        bias_activation_fusion=(not layers.no_bias_gelu_fusion and on_gpu
                                and not model.squared_relu
                                and (model.swiglu or not model.disable_bias_linear)),
        bias_dropout_fusion=not layers.no_bias_dropout_fusion and on_gpu,
        masked_softmax_fusion=(not layers.no_masked_softmax_fusion
                               and _fused_softmax_available()),
        layernorm_zero_centered_gamma=layers.apply_layernorm_1p,
        apply_rope_fusion=rope_fusion(configs),
        # samples of different lengths: each token weighs the same in the gradient
        # (megatron-core's per-microbatch mean would weigh a short sample's tokens more)
        calculate_per_token_loss=layers.calculate_per_token_loss or data.lengths_per_sample,
        num_layers_in_first_pipeline_stage=pipeline.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=pipeline.decoder_last_pipeline_num_layers,
        pipeline_dtype=configs.precision.params_dtype,
        autocast_dtype=configs.precision.params_dtype,
        batch_p2p_comm=batch_p2p_comm(configs) and not overlap_p2p,
        # the interleaved schedule's overlapped p2p, also in warm-up and flush (megatron-core
        # allows the warm-up/flush overlap only on top of it, unbatched)
        overlap_p2p_comm=overlap_p2p,
        overlap_p2p_comm_warmup_flush=overlap_p2p,
        microbatch_group_size_per_vp_stage=(
            pipeline.microbatch_group_size_per_virtual_pipeline_stage),
        # megatron-core knows native and te; the project's triton passes replace its loss
        # function instead (LanguageModelLoss below)
        cross_entropy_fusion_impl="te" if fast_path.cross_entropy_fusion_impl == "te" else "native",
        deallocate_pipeline_outputs=True,
        variable_seq_lengths=lengths_vary,
        # megatron's own initialisation also tags tensor-parallel weights (partition dim,
        # duplicates for the grad norm); initialize_layout_independent then overwrites values
        perform_initialization=True,
        use_cpu_initialization=not torch.cuda.is_available(),
        # megatron-core passes TE's backend choice on through NVTE_* variables
        attention_backend=_te_attention_backend(layers) if te else AttnBackend.local,
        # the weight-gradient GEMM adds into the fp32 main_grad (dpp.weight_grad_accumulation).
        # On GPU only (it saves a kernel there), unless the B/W split or the deferred output
        # layer needs the path: they defer exactly those GEMMs (megatron/dpp/weight_grad.py)
        gradient_accumulation_fusion=fast_path.gradient_accumulation_fusion and (
            on_gpu or schedule.dpp_split_backward or pipeline.defer_embedding_wgrad_compute),
        wgrad_deferral_limit=pipeline.wgrad_deferral_limit or 0,
    )
    if lengths_vary:
        # megatron-core's validation asks for this whenever variable_seq_lengths is on
        kwargs["moe_token_dispatcher_type"] = "alltoall"
    if model.multi_latent_attention:
        return MLATransformerConfig(**{**kwargs, **_mla_config(configs)})
    return TransformerConfig(**kwargs)


def _mla_config(configs) -> dict:
    """MLATransformerConfig's own fields. The norm stays --normalization (Megatron-LM passes
    it too; MLA's default would be RMSNorm)."""
    layers = configs.layers
    names = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
             "rope_type", "rotary_scaling_factor", "mscale", "mscale_all_dim")
    return {**{name: getattr(layers, name) for name in names},
            "rotary_base": configs.model.rotary_base,
            "rotary_percent": configs.model.rotary_percent,
            "apply_rope_fusion": _mla_rope_fusion(layers)}


def _mla_rope_fusion(layers) -> bool:
    """MLA rotates only its qk_pos_emb_head_dim channels, in its own fused YaRN kernel
    (Triton, GPU) rather than Transformer Engine's. That kernel spans the q/k head, the v
    head and half the rotary channels with one Triton range each, which must be a power of
    two: other sizes rotate unfused, said in one line."""
    if (layers.no_rope_fusion or layers.rope_type != "yarn" or not torch.cuda.is_available()
            or importlib.util.find_spec("triton") is None):
        return False
    spans = {"--qk-head-dim": layers.qk_head_dim, "--v-head-dim": layers.v_head_dim,
             "--qk-pos-emb-head-dim / 2": layers.qk_pos_emb_head_dim // 2}
    odd = [f"{flag} {size}" for flag, size in spans.items() if size < 1 or size & (size - 1)]
    if odd:
        log.info("MLA's fused YaRN rotary embedding off: %s not a power of two "
                 "(--no-rope-fusion turns it off without this line)", ", ".join(odd))
        return False
    return True


def _activation(model):
    if model.swiglu:
        return torch.nn.functional.silu
    if model.squared_relu:
        from megatron.core.activations import squared_relu

        return squared_relu
    return torch.nn.functional.gelu


def _te_attention_backend(layers) -> AttnBackend:
    if layers.use_flash_attn:
        return AttnBackend.flash
    return AttnBackend[layers.attention_backend]


def rope_fusion(configs) -> bool:
    """Megatron-LM fuses rotary embeddings unless --no-rope-fusion; megatron-core's fused
    kernels are Transformer Engine's (GPU), and do not rotate interleaved pairs."""
    model = configs.model
    return (model.position_embedding_type == "rope" and not configs.layers.no_rope_fusion
            and not model.rotary_interleaved and transformer_engine_available())


def batch_p2p_comm(configs) -> bool:
    """Whether megatron-core's schedules batch their p2p exchanges. A batched exchange pairs
    sends and receives between two ranks by their order; at PP=2 with virtual stages the
    previous and the next rank are the same peer, which then receives a gradient into the
    activation's buffer and the reverse (same shape: silently wrong gradients). Unbatched
    p2p there; any other layout keeps the flag's choice."""
    parallel = configs.parallel
    one_neighbour = (parallel.pipeline_model_parallel_size == 2
                     and parallel.virtual_pipeline_model_parallel_size is not None)
    return not configs.pipeline.no_batch_p2p_comm and not one_neighbour


def _fused_softmax_available() -> bool:
    """megatron.core's fused softmax imports these compiled kernels (built by apex or
    Megatron-LM); without them its fusion path fails at the first forward."""
    return all(
        importlib.util.find_spec(name) is not None
        for name in ("scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda")
    )


def _attention_kernel(layers) -> str:
    return "flash" if layers.use_flash_attn else layers.attention_backend


def _with_sdpa(spec: ModuleSpec, layers) -> ModuleSpec:
    spec = copy.deepcopy(spec)
    backend = _attention_kernel(layers)
    spec.submodules.self_attention.submodules.core_attention = SDPA_BY_BACKEND[backend]
    return spec


def gpt_layer_spec(configs) -> ModuleSpec:
    layers = configs.layers
    mla = configs.model.multi_latent_attention
    if use_transformer_engine(configs):
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        # no normalization argument: TE's fused norm-linear layers read config.normalization
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=layers.qk_layernorm,
                                                          multi_latent_attention=mla)
    local = get_gpt_layer_local_spec(normalization=configs.model.normalization,
                                     qk_layernorm=layers.qk_layernorm, multi_latent_attention=mla)
    if configs.fast_path.triton_fusions:
        local = _with_triton_bias_dropout_add(local)
    if mla:
        return _local_mla_spec(local, configs)
    norm = _norm_class(configs)
    if norm is not None:
        local = _with_norms(local, norm)
    return local if _stock_attention(layers) else _with_sdpa(local, layers)


def _with_triton_bias_dropout_add(spec: ModuleSpec) -> ModuleSpec:
    """The residual adds after attention and MLP through the Triton kernels in training
    (triton_dropout.py; megatron-core's own where they do not apply)."""
    spec = copy.deepcopy(spec)
    spec.submodules.self_attn_bda = spec.submodules.mlp_bda = triton_dropout.get_bias_dropout_add
    return spec


def _local_mla_spec(spec: ModuleSpec, configs) -> ModuleSpec:
    """megatron-core's local MLA layer with an SDPA core that takes MLA's q/k head dim
    (qk_head_dim + qk_pos_emb_head_dim) and v head dim apart; megatron-core's own
    DotProductAttention sizes all heads by kv_channels and cannot run it."""
    layers = configs.layers
    q_k_dim = layers.qk_head_dim + layers.qk_pos_emb_head_dim
    if layers.attention_backend in ("local", "unfused"):
        raise ModelFlagError(f"--attention-backend {layers.attention_backend} with "
                           "--multi-latent-attention and local layers: megatron-core's "
                           "DotProductAttention has one head dim for q, k and v; use "
                           "--attention-backend auto (SDPA) or Transformer Engine")
    backend = _attention_kernel(layers)
    if backend == "flash" and q_k_dim != layers.v_head_dim:
        raise ModelFlagError(f"FlashAttention with --multi-latent-attention and local layers: "
                           f"torch's FlashAttention kernel needs one head dim, MLA's q/k heads "
                           f"have {q_k_dim} channels and its v heads {layers.v_head_dim}")
    spec = copy.deepcopy(spec)
    attention = spec.submodules.self_attention.submodules
    attention.core_attention = MLA_SDPA_BY_BACKEND[backend]
    norm = _norm_class(configs)
    if norm is not None:
        spec = _with_norms(spec, norm)
        if layers.qk_layernorm:  # MLA's latent norms (sequence-split under sequence parallelism)
            attention = spec.submodules.self_attention.submodules
            attention.q_layernorm = attention.kv_layernorm = norm
    return spec


def _norm_class(configs):
    """The local layers' norm where it is not megatron-core's torch fallback: the Triton
    kernels on the fast path (triton_norm.py), or torch's norms tagged for sequence
    parallelism or with zero-centred weights, which that fallback cannot build (norms.py).
    None: megatron-core's own."""
    if configs.fast_path.triton_fusions:
        return TritonNorm
    if configs.parallel.sequence_parallel or configs.layers.apply_layernorm_1p:
        return SequenceParallelNorm
    return None


def _with_norms(spec: ModuleSpec, norm) -> ModuleSpec:
    """The layer's input and pre-MLP norms of class `norm`; the Triton norm's variant that
    hands the residual back where megatron-core's layer takes it (one kernel less per norm
    in the backward, triton_norm.py)."""
    if norm is TritonNorm and core_overrides.LAYER_TAKES_NORM_RESIDUAL.present():
        norm = TritonResidualNorm
    spec = copy.deepcopy(spec)
    spec.submodules.input_layernorm = norm
    spec.submodules.pre_mlp_layernorm = norm
    return spec


def _gpt_block_spec(configs, config, vp_stage):
    """The decoder's spec: the layer spec, or, where the local layers' norm is not
    megatron-core's (`_norm_class`), the block's layers and its final norm of that class."""
    layer = gpt_layer_spec(configs)
    norm = _norm_class(configs)
    if norm is None or use_transformer_engine(configs):
        return layer
    layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[layer] * layers, layer_norm=norm)


def bert_layer_spec(configs) -> ModuleSpec:
    if use_transformer_engine(configs):
        from megatron.core.models.bert.bert_layer_specs import (
            get_bert_layer_with_transformer_engine_spec,
        )

        return get_bert_layer_with_transformer_engine_spec()
    layers = configs.layers
    return (bert_layer_local_spec if _stock_attention(layers)
            else _with_sdpa(bert_layer_local_spec, layers))


def _stock_attention(layers) -> bool:
    """`--attention-backend local` (or unfused) keeps megatron.core's own DotProductAttention,
    which materialises the score matrix and needs CUDA; every other choice uses SDPA."""
    if layers.attention_backend not in ("local", "unfused"):
        return False
    if not torch.cuda.is_available():
        raise ModelFlagError(f"--attention-backend {layers.attention_backend}: megatron.core's "
                           "DotProductAttention needs CUDA; use --attention-backend auto on CPU")
    return True


class LanguageModelLoss:
    """compute_language_model_loss with `--cross-entropy-fusion-impl triton`
    (cross_entropy.py); megatron-core's own choices otherwise."""

    single_pass_cross_entropy = False

    def compute_language_model_loss(self, labels, logits):
        if not self.single_pass_cross_entropy:
            return super().compute_language_model_loss(labels, logits)
        # labels [b, s], logits [s, b, vocab] -> loss [b, s]
        loss = vocab_parallel_cross_entropy(logits, labels.transpose(0, 1), self.pg_collection.tp)
        return loss.transpose(0, 1).contiguous()


class ProjectGPTModel(LanguageModelLoss, GPTModel):
    pass


class ProjectBertModel(LanguageModelLoss, BertModel):
    @property
    def decoder(self):
        """BERT's transformer block is its encoder; megatron-core's schedules tell a chunk's
        layers their microbatch through `decoder.layers` (rng.ForwardRng reads it)."""
        return self.encoder


class SDPABertModel(ProjectBertModel):
    """BertModel whose mask check accepts the SDPA core (mask layout [b, 1, s, s])."""

    def _sanity_check_attention_and_get_attn_mask_dimension(self) -> str:
        return "b1ss"


def _finish_stage(model, configs, config):
    fast_path = configs.fast_path
    model.single_pass_cross_entropy = (fast_path.cross_entropy_loss_fusion
                                       and fast_path.cross_entropy_fusion_impl == "triton")
    install_fused_layers(model, config, bool(fast_path.triton_fusions))
    if fast_path.gelu_gemm_epilogue:
        log.info("%d MLPs compute bias-GeLU in their GEMM epilogues (gelu_mlp.py)",
                 gelu_mlp.install(model))
    if config.defer_embedding_wgrad_compute:
        _defer_only_in_output_layer(model, config)
    return model


def _defer_only_in_output_layer(model, config) -> None:
    """megatron-core's ColumnParallelLinear appends its input to its deferral buffer whenever
    its config says defer_embedding_wgrad_compute, but only the output layer has buffers
    (Transformer Engine's linears never look): the local layers' column-parallel linears
    get a copy of the config without the deferral."""
    own = copy.copy(config)
    own.defer_embedding_wgrad_compute = False
    output_layer = getattr(model, "output_layer", None)
    for module in model.modules():
        if isinstance(module, ColumnParallelLinear) and module is not output_layer:
            module.config = own


def build_gpt_stage(configs, config, pre_process, post_process, vp_stage=None):
    with _mla_without_transformer_engine(configs.model):
        model = ProjectGPTModel(
            transformer_layer_spec=_gpt_block_spec(configs, config, vp_stage),
            rotary_percent=configs.model.rotary_percent, rotary_base=configs.model.rotary_base,
            **_stage_kwargs(configs.model, config, pre_process, post_process, vp_stage))
    return _finish_stage(model, configs, config)


def _mla_without_transformer_engine(model):
    """megatron-core 0.16.1's MLA believes Transformer Engine is there whenever its TE
    module imports, which it does with stand-ins when TE is absent; its constructor then
    fails on an isinstance check against a stand-in. While building: the truth."""
    flag = core_overrides.MLA_HAVE_TE
    if (not model.multi_latent_attention or importlib.util.find_spec("transformer_engine")
            or not flag.resolve()):
        return contextlib.nullcontext()
    return flag.swapped(False)


def build_bert_stage(configs, config, pre_process, post_process, vp_stage=None):
    layers = configs.layers
    stock = use_transformer_engine(configs) or _stock_attention(layers)
    model_class = ProjectBertModel if stock else SDPABertModel
    model = model_class(
        transformer_layer_spec=bert_layer_spec(configs),
        num_tokentypes=layers.num_tokentypes if not layers.bert_no_binary_head else 0,
        add_binary_head=not layers.bert_no_binary_head,
        **_stage_kwargs(configs.model, config, pre_process, post_process, vp_stage))
    return _finish_stage(model, configs, config)


def _stage_kwargs(model, config, pre_process, post_process, vp_stage) -> dict:
    """What megatron-core's GPT and BERT language models are both built with."""
    return dict(
        config=config, vocab_size=model.padded_vocab_size,
        max_sequence_length=model.max_position_embeddings, pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=not model.untie_embeddings_and_output_weights,
        position_embedding_type=model.position_embedding_type, vp_stage=vp_stage)


def build_model_chunks(configs, config, build_stage) -> list[torch.nn.Module]:
    """This rank's model chunks (one per virtual pipeline stage), initialised."""
    vpp = configs.parallel.virtual_pipeline_model_parallel_size or 1
    chunks = []
    for vp_stage in range(vpp):
        pre = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
        post = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
        chunk = build_stage(configs, config, pre, post, vp_stage=vp_stage if vpp > 1 else None)
        chunk.model_type = getattr(chunk, "model_type", None)
        initialize_layout_independent(chunk, configs)
        chunks.append(chunk)
    return chunks


def _canonical_names(module: torch.nn.Module, tied: bool) -> dict[str, torch.nn.Parameter]:
    """Parameter name -> parameter, with transformer layers named by their global number so
    the same weight has the same name under every pipeline layout."""
    names: dict[str, torch.nn.Parameter] = {}
    in_layers: set[int] = set()
    for layer in module.modules():
        if isinstance(layer, TransformerLayer):
            for pname, param in layer.named_parameters():
                names[f"layers.{layer.layer_number}.{pname}"] = param
                in_layers.add(id(param))
    for pname, param in module.named_parameters():
        if id(param) in in_layers:
            continue
        if tied and pname == "output_layer.weight":
            pname = "embedding.word_embeddings.weight"
        names[pname] = param
    return names


def initialize_layout_independent(module: torch.nn.Module, configs) -> None:
    """Initialise every parameter from a seed derived from its canonical name, generating
    the full (unsplit) tensor and keeping this rank's tensor-parallel slice."""
    model = configs.model
    tied = not model.untie_embeddings_and_output_weights
    # --apply-layernorm-1p: norm weights are offsets from 1
    norm_weight = 0.0 if configs.layers.apply_layernorm_1p else 1.0
    std = model.init_method_std
    output_std = std / (2.0 * model.num_layers) ** 0.5
    seed = configs.process.seed
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    with torch.no_grad():
        for name, param in _canonical_names(module, tied).items():
            full_shape = list(param.shape)
            split_dim = getattr(param, "partition_dim", -1)
            sharded = getattr(param, "tensor_model_parallel", False) and split_dim >= 0
            if sharded:
                full_shape[split_dim] *= tp_size
            values = _initial_values(name, full_shape, std, output_std, seed, norm_weight)
            if sharded:
                values = values.chunk(tp_size, dim=split_dim)[tp_rank]
            param.copy_(values.to(param.dtype))


def _initial_values(name, shape, std, output_std, seed, norm_weight) -> torch.Tensor:
    leaf = name.rsplit(".", 1)[-1]
    is_norm = "norm" in name or "layernorm" in name
    if leaf == "bias" or leaf.endswith("_bias") or (is_norm and leaf != "weight" and "bias" in leaf):
        return torch.zeros(shape)
    if is_norm:
        return torch.full(shape, norm_weight)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    scale = output_std if ("linear_proj" in name or "linear_fc2" in name) else std
    return torch.empty(shape).normal_(0.0, scale, generator=generator)
