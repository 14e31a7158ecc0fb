"""Every megatron.core internal the trainer depends on, declared once and checked at start-up.

The declaration machinery (`Internal`, `Feature`, `verify`, `replace_fallback`) and the
internals megatron/dpp relies on live in megatron/dpp/compat/core_internals.py; `INTERNALS` here is
both lists, and `verify()` (the first step of `training.setup`) checks them all: anything
moved or changed in the installed megatron-core stops the run with one message naming every
such target and its user.
"""

from __future__ import annotations

from megatron.dpp.compat import core_internals
from megatron.dpp.compat.core_internals import Feature, Internal

_SCHEDULES = "megatron.core.pipeline_parallel.schedules"
_LAYERS = "megatron.core.tensor_parallel.layers"
_RANDOM = "megatron.core.tensor_parallel.random"

# trainer/run/rng.py keys megatron-core's RNG tracker streams and reads each layer's microbatch
MICROBATCH_OF_LAYERS = Internal(
    f"{_SCHEDULES}:set_current_microbatch", "private",
    "trainer/run/rng.py ForwardRng._microbatch (TransformerLayer.current_microbatch)",
    read_by=(".current_microbatch = ",), read_in=f"{_SCHEDULES}:set_current_microbatch")
FORWARD_STEP_SETS_MICROBATCH = Internal(
    f"{_SCHEDULES}:forward_step", "private", "trainer/run/rng.py ForwardRng._microbatch",
    read_by=("set_current_microbatch(",), read_in=f"{_SCHEDULES}:forward_step")
MODEL_PARALLEL_RNG = Internal(
    f"{_RANDOM}:_MODEL_PARALLEL_RNG_TRACKER_NAME", "private",
    "trainer/run/rng.py ForwardRng._stream",
    value="model-parallel-rng")
EXPERT_PARALLEL_RNG = Internal(
    f"{_RANDOM}:_EXPERT_PARALLEL_RNG_TRACKER_NAME", "private",
    "trainer/run/rng.py ForwardRng._stream", value="expert-parallel-rng")
# the callbacks the trainer and DPP set on megatron-core's config
SCHEDULE_HOOKS = Internal(
    "megatron.core.model_parallel_config:ModelParallelConfig", "assigned",
    "trainer/run/trainer_setup.py _install_schedule_hooks, trainer/run/training.py start_tracing",
    fields=("no_sync_func", "grad_sync_func", "finalize_model_grads_func", "grad_scale_func",
            "timers"))
# no_apex.foreach_multi_tensor_ops: megatron-core's fallbacks swapped while training
CLIP_GRADS_L2_NORM = Internal(
    "megatron.core.optimizer.clip_grads:l2_norm_impl", "patched",
    "trainer/core_compat/no_apex.py foreach_multi_tensor_ops",
    fallback="megatron.core.utils:local_multi_tensor_l2_norm")
CLIP_GRADS_SCALE = Internal(
    "megatron.core.optimizer.clip_grads:multi_tensor_scale_impl", "patched",
    "trainer/core_compat/no_apex.py foreach_multi_tensor_ops",
    fallback="megatron.core.utils:local_multi_tensor_scale")
OPTIMIZER_SCALE = Internal(
    "megatron.core.optimizer.optimizer:multi_tensor_scale_impl", "patched",
    "trainer/core_compat/no_apex.py foreach_multi_tensor_ops",
    fallback="megatron.core.utils:local_multi_tensor_scale")
LOCAL_L2_NORM = Internal(
    "megatron.core.utils:local_multi_tensor_l2_norm", "called",
    "trainer/core_compat/no_apex.py foreach_l2_norm (the contract it keeps)",
    positional=(("chunk_size", "noop_flag", "tensor_lists", "per_tensor"),))
LOCAL_SCALE = Internal(
    "megatron.core.utils:local_multi_tensor_scale", "called",
    "trainer/core_compat/no_apex.py foreach_scale (the contract it keeps)",
    positional=(("chunk_size", "noop_flag", "tensor_lists", "scale"),))
# the torch optimizers inside megatron-core's
MEGATRON_OPTIMIZER = Internal(
    "megatron.core.optimizer.optimizer:MegatronOptimizer.__init__", "private",
    "trainer/core_compat/no_apex.py torch_optimizers, "
    "trainer/checkpoint/checkpoint_restore.py _create_adam_states",
    read_by=("self.optimizer = optimizer",))
CHAINED_OPTIMIZER = Internal(
    "megatron.core.optimizer.optimizer:ChainedOptimizer.__init__", "private",
    "trainer/core_compat/no_apex.py torch_optimizers, "
    "trainer/checkpoint/checkpoint_restore.py _create_adam_states",
    read_by=("self.chained_optimizers = chained_optimizers",))
# fused_layers.install_fused_layers
COLUMN_PARALLEL_FORWARD_IMPL = Internal(
    f"{_LAYERS}:ColumnParallelLinear._forward_impl", "replaced",
    "trainer/kernels/fused_layers.py install_fused_layers (per instance)",
    positional=(("self", "input", "weight"),),
    read_by=("self._forward_impl(", "gradient_accumulation_fusion=", "allreduce_dgrad=",
             "sequence_parallel=", "grad_output_buffer="))
VOCAB_PARALLEL_EMBEDDING_FORWARD = Internal(
    f"{_LAYERS}:VocabParallelEmbedding.forward", "replaced",
    "trainer/kernels/fused_layers.py WordEmbeddingIntoMainGrad (class swapped)",
    positional=(("self", "input_"),),
    read_by=("self.tp_group", "self.reduce_scatter_embeddings"))
# cuda_graphs.install_block_graphs
TRANSFORMER_BLOCK_FORWARD = Internal(
    "megatron.core.transformer.transformer_block:TransformerBlock.forward", "replaced",
    "trainer/model/cuda_graphs.py install_block_graphs (per instance)",
    positional=(("self", "hidden_states", "attention_mask"),),
    read_by=("self.pre_process", "self.input_tensor"))
TRANSFORMER_BLOCK_SET_INPUT = Internal(
    "megatron.core.transformer.transformer_block:TransformerBlock.set_input_tensor", "called",
    "trainer/model/cuda_graphs.py BlockGraphs._run", positional=(("self", "input_tensor"),))
# models.py
BERT_MASK_CHECK = Internal(
    "megatron.core.models.bert.bert_model:"
    "BertModel._sanity_check_attention_and_get_attn_mask_dimension", "replaced",
    "trainer/model/models.py SDPABertModel", positional=(("self",),),
    read_by=("self._sanity_check_attention_and_get_attn_mask_dimension()",))
LANGUAGE_MODEL_LOSS = Internal(
    "megatron.core.models.common.language_module.language_module:"
    "LanguageModule.compute_language_model_loss", "replaced",
    "trainer/model/models.py LanguageModelLoss", positional=(("self", "labels", "logits"),))
CORE_ATTENTION_INIT = Internal(
    "megatron.core.transformer.dot_product_attention:DotProductAttention.__init__",
    "stand-in", "trainer/model/attention.py SDPAttention (the core attention of our specs)",
    stand_in="megatron.trainer.model.attention:SDPAttention.__init__")
CORE_ATTENTION_FORWARD = Internal(
    "megatron.core.transformer.dot_product_attention:DotProductAttention.forward",
    "stand-in", "trainer/model/attention.py SDPAttention.forward",
    stand_in="megatron.trainer.model.attention:SDPAttention.forward")
# models.py: multi-latent attention with the local layers
MLA_CORE_ATTENTION = Internal(
    "megatron.core.transformer.multi_latent_attention:MultiLatentAttention.__init__", "private",
    "trainer/model/attention.py MLASDPAttention (the head dims MLA builds its core attention with)",
    read_by=("k_channels=self.q_head_dim", "v_channels=self.config.v_head_dim",
             "softmax_scale=self.softmax_scale"))
MLA_HAVE_TE = Internal(
    "megatron.core.transformer.multi_latent_attention:HAVE_TE", "patched",
    "trainer/model/models.py _mla_without_transformer_engine (False while building without TE)",
    read_by=("isinstance(self.linear_proj, TELinear)",))
MLA_SUBMODULES = Internal(
    "megatron.core.transformer.multi_latent_attention:MLASelfAttentionSubmodules", "assigned",
    "trainer/model/models.py _local_mla_spec",
    fields=("core_attention", "q_layernorm", "kv_layernorm"))
# models.py edits the local layer specs' submodules (assigning a removed field would be ignored)
LAYER_SUBMODULES = Internal(
    "megatron.core.transformer.transformer_layer:TransformerLayerSubmodules", "assigned",
    "trainer/model/models.py _with_norms, _with_sdpa, _with_triton_bias_dropout_add",
    fields=("input_layernorm", "pre_mlp_layernorm", "self_attention", "self_attn_bda",
            "mlp_bda"))
# gelu_mlp.install: the dense MLP's forward, per instance, where gelu_mlp.applies_to holds
MLP_FORWARD = Internal(
    "megatron.core.transformer.mlp:MLP.forward", "replaced", "trainer/model/gelu_mlp.py install",
    positional=(("self", "hidden_states", "per_token_scale"),),
    read_by=("self.linear_fc1", "self.linear_fc2", "bias_gelu_impl(intermediate_parallel, "
             "bias_parallel)", "self.activation_func = ", "return output, output_bias"))
# triton_gelu.installed: the MLP's bias-GeLU, which it imports by name
MLP_BIAS_GELU = Internal(
    "megatron.core.transformer.mlp:bias_gelu_impl", "replaced",
    "trainer/kernels/triton_gelu.py installed",
    read_by=("bias_gelu_impl(",))
SELF_ATTENTION_SUBMODULES = Internal(
    "megatron.core.transformer.attention:SelfAttentionSubmodules", "assigned",
    "trainer/model/models.py _with_sdpa", fields=("core_attention",))
# norms.py: torch's norms tagged for megatron-core's sum of sequence-parallel gradients
SEQUENCE_PARALLEL_NORM = Internal(
    "megatron.core.transformer.torch_norm:WrappedTorchNorm.__new__", "stand-in",
    "trainer/kernels/norms.py SequenceParallelNorm (the local specs' norms under "
    "--sequence-parallel)",
    stand_in="megatron.trainer.kernels.norms:SequenceParallelNorm.__new__")
SEQUENCE_PARALLEL_GRAD_SUM = Internal(
    "megatron.core.distributed.finalize_model_grads:_allreduce_non_tensor_model_parallel_grads",
    "private", "trainer/kernels/norms.py SequenceParallelNorm (param.sequence_parallel)",
    read_by=('getattr(param, "sequence_parallel", False)',),
    read_in="megatron.core.distributed.finalize_model_grads:"
            "_allreduce_non_tensor_model_parallel_grads")
# checkpointing.py, checkpoint_writers.py
SHARDED_OBJECT = Internal(
    "megatron.core.dist_checkpointing.mapping:ShardedObject.__init__", "called",
    "trainer/checkpoint/checkpointing.py _rng_per_rank_object, "
    "megatron_lm_format.py rng_sharded_object",
    positional=(("self", "key", "data", "global_shape", "global_offset"),),
    keywords=("replica_id",))
DISTRIBUTED_OPTIMIZER_STATE = Internal(
    "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.sharded_state_dict",
    "called", "trainer/checkpoint/checkpointing.py _sharded_state",
    positional=(("self", "model_sharded_state_dict"),),
    keywords=("is_loading", "metadata"), read_by=("dp_reshardable",))
WRITE_RESULTS_QUEUE = Internal(
    "megatron.core.dist_checkpointing.strategies.filesystem_async:_results_queue", "private",
    "trainer/checkpoint/checkpoint_writers.py _use_results_queue (no multiprocessing Manager)",
    read_by=("if _results_queue is None",))
# checkpointing._staged_in_shared_memory: an async request's args are (rank, write buckets,
# results queue) and its preload_fn stages the buckets (--async-ckpt-use-cpu-shm)
ASYNC_WRITE_BUCKETS = Internal(
    "megatron.core.dist_checkpointing.strategies.filesystem_async:"
    "FileSystemWriterAsync.get_save_function_and_args", "private",
    "trainer/checkpoint/checkpointing.py _staged_in_shared_memory",
    read_by=("self.write_buckets, self.results_queue]",
             "partial(self.preload_tensors, self.write_buckets"),
    read_in="megatron.core.dist_checkpointing.strategies.filesystem_async:"
            "FileSystemWriterAsync.get_save_function_and_args")
ASYNC_REQUEST_PRELOAD = Internal(
    "megatron.core.dist_checkpointing.strategies.async_utils:AsyncRequest.execute_sync",
    "private", "trainer/checkpoint/checkpointing.py _staged_in_shared_memory",
    read_by=("async_fn_args[1] = self.preload_fn()",))
WRITE_BUCKET = Internal(
    "megatron.core.dist_checkpointing.strategies.filesystem_async:"
    "FileSystemWriterAsync.write_preloaded_data", "patched",
    "trainer/checkpoint/checkpoint_writers.py _write_errors_raised (a failed write keeps its "
    "error)",
    positional=(("transform_list", "local_proc_idx", "write_bucket", "results_queue",
                 "count_queue", "use_fsync"),),
    read_by=("FileSystemWriterAsync.write_preloaded_data",))
# cpu_compat.CpuCompat: activation recomputation's CUDA generator state, on CPU
GET_CUDA_RNG_STATE = Internal(
    f"{_RANDOM}:_get_cuda_rng_state", "patched", "trainer/core_compat/cpu_compat.py CpuCompat",
    read_by=("_get_cuda_rng_state(",), read_in=f"{_RANDOM}:_get_all_rng_states")
SET_CUDA_RNG_STATE = Internal(
    f"{_RANDOM}:_set_cuda_rng_state", "patched", "trainer/core_compat/cpu_compat.py CpuCompat",
    read_by=("_set_cuda_rng_state(",), read_in=f"{_RANDOM}:_set_all_rng_states")
# reruns.py: megatron-core's rerun state machine, our subclass installed as its global
_RERUNS = "megatron.core.rerun_state_machine"
SET_RERUN_STATE_MACHINE = Internal(
    f"{_RERUNS}:_set_rerun_state_machine", "private",
    "trainer/core_compat/reruns.py ResultValidation.start (installs our subclass)",
    positional=(("rerun_state_machine",),), read_by=("_GLOBAL_RERUN_STATE_MACHINE = ",))
RERUN_STATS_REPORT = Internal(
    f"{_RERUNS}:RerunStateMachine._maybe_report_stats", "replaced",
    "trainer/core_compat/reruns.py _StateMachine._maybe_report_stats (report_stats' log)",
    positional=(("self",),),
    read_by=("self._maybe_report_stats()", "self.stats[caller].record(",
             "REPORTING_INTERVAL_ITERATIONS"))
RERUN_FAILED_CALL = Internal(
    f"{_RERUNS}:RerunStateMachine.validate_result", "private",
    "trainer/core_compat/reruns.py ResultValidation.verdict (names the check that failed)",
    read_by=("self.failed_validation_call = validation_call",),
    read_in=f"{_RERUNS}:RerunStateMachine.validate_result")
# planned_p2p.py: megatron-core's schedules take each microbatch's shape from the plan
_P2P = "megatron.core.pipeline_parallel.p2p_communication"
P2P_SHAPE_EXCHANGE = Internal(
    f"{_P2P}:P2PCommunicator._communicate_shapes", "replaced",
    "trainer/core_compat/planned_p2p.py PlannedShapesP2P",
    positional=(("self", "tensor_send_next", "tensor_send_prev", "recv_prev", "recv_next"),),
    read_by=("self._communicate_shapes(",), read_in=f"{_P2P}:P2PCommunicator._communicate")
# emulated_p2p.py: sends on an emulated edge leave megatron-core's p2p call; they are posted
# on the group its unbatched p2p receives them on (odd ranks of two stages: the world group)
P2P_COMMUNICATE = Internal(
    f"{_P2P}:P2PCommunicator._communicate", "replaced",
    "trainer/core_compat/planned_p2p.py PlannedShapesP2P._communicate (emulated links)",
    keywords=("tensor_send_next", "tensor_send_prev", "recv_prev", "recv_next",
              "tensor_shape", "wait_on_reqs"),
    read_by=("self.next_rank", "self.prev_rank", "p2p_func = _p2p_ops"),
    read_in=f"{_P2P}:P2PCommunicator._communicate")
P2P_ODD_RANKS_SEND_ON_WORLD = Internal(
    f"{_P2P}:_p2p_ops", "private", "trainer/core_compat/planned_p2p.py "
    "PlannedShapesP2P._send_group", read_by=("even_recv_odd_send_group = torch.distributed.group.WORLD",))
ONE_F_ONE_B_COMMUNICATOR, INTERLEAVED_COMMUNICATOR = (Internal(
    f"{_SCHEDULES}:forward_backward_pipelining_{kind}_interleaving", "called",
    "trainer/run/training.py train_step, evaluate (planned_p2p.PlannedShapes.arguments)",
    keywords=("p2p_communicator", "pg_collection")) for kind in ("without", "with"))
# the interleaved schedule's order of (microbatch, chunk), which its messages follow
SCHEDULE_TABLE = Internal(
    f"{_SCHEDULES}:get_schedule_table", "called",
    "trainer/core_compat/planned_p2p.py boundary_messages",
    positional=(("num_microbatches", "num_model_chunks", "microbatch_group_size_per_vp_stage"),),
    read_by=("get_schedule_table(",),
    read_in=f"{_SCHEDULES}:forward_backward_pipelining_with_interleaving")
DEFAULT_PROCESS_GROUPS = Internal(
    "megatron.core.process_groups_config:ProcessGroupCollection.use_mpu_process_groups",
    "called", "trainer/core_compat/planned_p2p.py PlannedShapes",
    keywords=("required_pgs",))
# positional calls of public constructors
DATASET_BUILDER = Internal(
    "megatron.core.datasets.blended_megatron_dataset_builder:"
    "BlendedMegatronDatasetBuilder.__init__", "called", "trainer/data/data.py _build",
    positional=(("self", "cls", "sizes", "is_built_on_rank", "config"),))
BLENDING_INDICES = Internal(
    "megatron.core.datasets.helpers:build_blending_indices", "called",
    "trainer/data/documents.py (megatron-core's compiled helper)")
FLOAT16_MODULE = Internal(
    "megatron.core.transformer.module:Float16Module.__init__", "called",
    "trainer/run/optimizer.py wrap_model_chunks", positional=(("self", "config", "module"),))
GET_MEGATRON_OPTIMIZER = Internal(
    "megatron.core.optimizer:get_megatron_optimizer", "called",
    "trainer/run/optimizer.py build_optimizer", positional=(("config", "model_chunks"),))

INTERNALS = core_internals.INTERNALS + tuple(
    value for value in dict(globals()).values() if isinstance(value, Internal))


# models.py: a layer's input and pre-MLP norms may return (output, residual); TransformerLayer
# then adds that residual back (megatron-core >= 0.18; 0.16 keeps its own input)
LAYER_TAKES_NORM_RESIDUAL = Feature(Internal(
    "megatron.core.transformer.transformer_layer:TransformerLayer", "private",
    "trainer/model/models.py _with_norms (triton_norm.TritonResidualNorm)",
    read_by=("input_layernorm_output, residual = input_layernorm_output",
             "pre_mlp_layernorm_output, residual = pre_mlp_layernorm_output")))


def verify() -> None:
    """Raise CoreInternalsError naming every unmet dependency of the trainer and of DPP."""
    core_internals.verify(INTERNALS)
