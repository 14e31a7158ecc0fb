"""megatron/trainer/core_compat/core_overrides.py and megatron/dpp/compat/core_internals.py: the
installed megatron-core has every internal the trainer and DPP rely on; a moved or changed one
stops start-up with a message naming it; and in a built model every substitution the trainer makes is in place, and undone afterwards."""

import contextlib
import functools
from unittest import mock

import pytest
import torch

from megatron.dpp.compat import core_internals
from megatron.dpp.compat.core_internals import CoreInternalsError, Internal
from megatron.dpp.weight_grad_accumulation import (
    WeightGradAccumulation,
    weight_grad_accumulation_fusion,
)
from megatron.trainer.config.configs import TrainerConfigs
from megatron.trainer.core_compat import core_overrides, no_apex
from megatron.trainer.core_compat.core_overrides import INTERNALS, verify
from megatron.trainer.run.training import setup
from megatron.trainer.tasks.gpt import GPT_TASK  # imported before a test deletes what they import
from tests.distributed import run_ranks
from tests.trainer_runs import TINY, with_flags


def test_installed_megatron_core_has_every_declared_internal():
    verify()


def _setup_fails(args):
    """The trainer's start-up with these flags; returns its CoreInternalsError."""
    with pytest.raises(CoreInternalsError) as error, contextlib.ExitStack() as stack:
        setup(GPT_TASK, args, stack)
    return str(error.value)


@pytest.fixture(scope="module")
def tiny_args():
    from megatron.trainer.config.arguments import parse_args

    return parse_args(with_flags(TINY, train_iters=1), world_size=1)


_REMOVABLE = [(internal, target) for internal in INTERNALS if internal.how != "injected"
              for target in core_internals.targets(internal)]


@pytest.mark.parametrize("declared, target", _REMOVABLE,
                         ids=[f"{target.split(':')[1]}-{internal.how}"
                              for internal, target in _REMOVABLE])
def test_start_up_fails_naming_a_target_gone_from_megatron_core(monkeypatch, tiny_args, declared,
                                                                target):
    owner, name = Internal(target, "", "").owner_and_name()
    monkeypatch.delattr(owner, name)
    message = _setup_fails(tiny_args)
    assert f"{target} is missing" in message or f"{target}: megatron.core no longer" in message
    assert declared.user in message


def test_start_up_fails_when_megatron_core_stops_reading_an_injected_global(monkeypatch,
                                                                             tiny_args):
    """The weight-gradient kernels the trainer injects are only used while megatron-core's
    linear layers still call them by that name."""
    real_source = core_internals._source

    def source_after_a_rename(internal):
        text = real_source(internal)
        if internal is core_internals.WGRAD_KERNELS:
            return text.replace("wgrad_gemm_accum_fp32", "wgrad_accumulate")
        return text

    monkeypatch.setattr(core_internals, "_source", source_after_a_rename)
    message = _setup_fails(tiny_args)
    assert ("megatron.core.tensor_parallel.layers:fused_weight_gradient_mlp_cuda: megatron.core "
            "no longer uses fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32") in message
    assert core_internals.WGRAD_KERNELS.user in message


def test_a_changed_signature_names_what_was_expected(monkeypatch, tiny_args):
    from megatron.core.pipeline_parallel import schedules

    monkeypatch.setattr(schedules, "backward_step", lambda output_tensor, config: None)
    message = _setup_fails(tiny_args)
    assert "schedules:backward_step takes (output_tensor, config)" in message
    assert "(input_tensor, output_tensor, output_tensor_grad, config)" in message
    assert "dpp/schedule.py" in message


def test_a_removed_config_field_and_a_changed_value_are_named(monkeypatch, tiny_args):
    import dataclasses

    from megatron.core import model_parallel_config
    from megatron.core.tensor_parallel import random

    @dataclasses.dataclass
    class WithoutGradSync:
        no_sync_func: object = None
        finalize_model_grads_func: object = None
        grad_scale_func: object = None
        timers: object = None

    monkeypatch.setattr(model_parallel_config, "ModelParallelConfig", WithoutGradSync)
    monkeypatch.setattr(random, "_MODEL_PARALLEL_RNG_TRACKER_NAME", "tp-rng")
    message = _setup_fails(tiny_args)
    assert "ModelParallelConfig no longer has the field(s) grad_sync_func" in message
    assert "_MODEL_PARALLEL_RNG_TRACKER_NAME is 'tp-rng'; expected 'model-parallel-rng'" in message


def test_a_stand_in_whose_parameters_drift_from_megatron_cores_is_reported(monkeypatch):
    from megatron.trainer.model.attention import SDPAttention

    def forward(self, query, key, value, attention_mask, attn_mask_type=None):
        """lacks attention_bias and packed_seq_params, which megatron.core passes"""

    monkeypatch.setattr(SDPAttention, "forward", forward)
    with pytest.raises(CoreInternalsError, match="its stand-in megatron.trainer.model.attention:"
                                                 "SDPAttention.forward takes"):
        verify()


def _backward_step_0_16(input_tensor, output_tensor, output_tensor_grad, model_type, config):
    return ("0.16", model_type, config)


def _backward_step_0_17(input_tensor, output_tensor, output_tensor_grad, config):
    return ("0.17", config)


def test_backward_step_is_called_with_the_installed_releases_arguments(monkeypatch):
    from megatron.core.enums import ModelType
    from megatron.core.pipeline_parallel import schedules

    config = object()
    monkeypatch.setattr(schedules, "backward_step", _backward_step_0_16)
    verify()
    assert core_internals.BACKWARD_STEP.variant() == 0
    assert core_internals.backward_step(None, None, None, config) == (
        "0.16", ModelType.encoder_or_decoder, config)
    monkeypatch.setattr(schedules, "backward_step", _backward_step_0_17)
    verify()
    assert core_internals.backward_step(None, None, None, config) == ("0.17", config)


def _amp_c_kernel(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """stands in for apex's amp_C.multi_tensor_l2norm"""


_amp_c_kernel.__module__ = "amp_C"


def test_fallback_replaced_apex_kept_anything_else_refused(monkeypatch):
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    declared = core_overrides.CLIP_GRADS_L2_NORM
    with core_internals.replace_fallback(declared, no_apex.foreach_l2_norm) as in_effect:
        assert clip_grads.l2_norm_impl is no_apex.foreach_l2_norm
        assert "local_multi_tensor_l2_norm" in in_effect
    assert clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm

    monkeypatch.setattr(clip_grads, "l2_norm_impl", _amp_c_kernel)
    with core_internals.replace_fallback(declared, no_apex.foreach_l2_norm) as in_effect:
        assert clip_grads.l2_norm_impl is _amp_c_kernel
        assert in_effect.startswith("apex's amp_C.")

    monkeypatch.setattr(clip_grads, "l2_norm_impl", torch.linalg.vector_norm)
    with pytest.raises(CoreInternalsError, match="clip_grads:l2_norm_impl is .*vector_norm: "
                                                 "neither megatron-core's fallback"):
        with no_apex.foreach_multi_tensor_ops():
            pass


def test_apex_weight_gradient_kernels_are_kept(monkeypatch, caplog):
    from megatron.core.tensor_parallel import layers

    apex_module = object()
    monkeypatch.setattr(layers, "_grad_accum_fusion_available", True)
    monkeypatch.setattr(layers, "fused_weight_gradient_mlp_cuda", apex_module, raising=False)
    with caplog.at_level("INFO", logger="megatron.dpp"), \
            weight_grad_accumulation_fusion():
        assert layers.fused_weight_gradient_mlp_cuda is apex_module
    assert "apex's fused_weight_gradient_mlp_cuda" in caplog.text
    monkeypatch.delattr(layers, "fused_weight_gradient_mlp_cuda")
    with pytest.raises(CoreInternalsError, match="_grad_accum_fusion_available is True but"):
        with weight_grad_accumulation_fusion():
            pass


def test_generalised_tensor_parallel_weights_keep_megatron_cores_path():
    """megatron-core 0.19's GTP (gtp_remat_size > 1) shards a weight further; the fused
    paths of fused_layers.py do not know that layout and hand the call back."""
    from megatron.trainer.kernels import fused_layers

    megatron_impl = mock.Mock(return_value="megatron-core's")
    x, weight, bias = torch.randn(4, 2, 8), torch.randn(6, 8, requires_grad=True), torch.randn(6)
    common = dict(input=x, weight=weight, bias=bias, gradient_accumulation_fusion=False,
                  allreduce_dgrad=False, sequence_parallel=False)
    assert fused_layers._bias_in_epilogue(megatron_impl, False, **common,
                                          gtp_remat_size=2) == "megatron-core's"
    assert fused_layers._bias_in_epilogue(megatron_impl, False, **common,
                                          gtp_remat_size=1).shape == (4, 2, 6)
    assert megatron_impl.call_count == 1

    embedding = torch.nn.Module()
    embedding.__class__ = fused_layers.WordEmbeddingIntoMainGrad
    embedding.tp_group = mock.Mock(size=lambda: 1)
    embedding.reduce_scatter_embeddings = False
    embedding.weight = torch.nn.Parameter(torch.randn(10, 8))
    embedding.weight.main_grad = torch.zeros(10, 8)
    embedding.gtp_remat_size = 2
    with mock.patch.object(fused_layers.VocabParallelEmbedding, "forward",
                           return_value="megatron-core's") as stock:
        assert embedding.forward(torch.tensor([[1, 2]])) == "megatron-core's"
        embedding.gtp_remat_size = 1
        assert embedding.forward(torch.tensor([[1, 2]])).shape == (1, 2, 8)
    assert stock.call_count == 1


def test_transformer_engine_gpt_spec_is_asked_for_with_arguments_it_takes(monkeypatch, tiny_args):
    """With Transformer Engine importable the GPT layer spec comes from megatron-core's TE
    spec function, called only with parameters it has (it has no `normalization`: TE's
    fused norm-linear layers read it from the config)."""
    from megatron.core.models.gpt import gpt_layer_specs

    from megatron.trainer.model import models

    spec = object()
    real = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec
    monkeypatch.setattr(gpt_layer_specs, "get_gpt_layer_with_transformer_engine_spec",
                        mock.create_autospec(real, return_value=spec))
    monkeypatch.setattr(models, "use_transformer_engine", lambda configs: True)
    assert models.gpt_layer_spec(TrainerConfigs.from_args(tiny_args)) is spec


def _substitutions_in_a_built_model(rank, save_dir):
    """Set up the trainer for a tiny GPT (the B/W split, so the weight-gradient fusion path
    runs on CPU) and a tiny BERT, and report which of megatron-core's internals the
    trainer's substitutions occupy, during the run and after it."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as core_optimizer
    from megatron.core.tensor_parallel import ColumnParallelLinear, VocabParallelEmbedding, layers
    from megatron.core.tensor_parallel import random as core_random

    from megatron.trainer.config.arguments import parse_args
    from megatron.trainer.core_compat import cpu_compat
    from megatron.trainer.data.batch_schedule import BatchSizeSchedule
    from megatron.trainer.kernels import fused_layers
    from megatron.trainer.model import attention, models
    from megatron.trainer.run import initialize, training
    from megatron.trainer.tasks.bert import BERT_TASK
    from megatron.trainer.tasks.gpt import GPT_TASK
    from tests.pipeline_runs import unwrap
    from tests.trainer_runs import _destroy_model_parallel_only

    initialize._shutdown = _destroy_model_parallel_only  # two set-ups in one process
    original_rng_state = core_random._get_cuda_rng_state, core_random._set_cuda_rng_state
    bucket_writer = vars(filesystem_async.FileSystemWriterAsync)["write_preloaded_data"]
    gpt = with_flags(TINY, train_iters=1, dpp_split_backward=True, save=save_dir,
                     save_interval=1)
    bert = with_flags(TINY, train_iters=1)
    live = {}
    for task, flags in ((GPT_TASK, gpt), (BERT_TASK, bert)):
        with contextlib.ExitStack() as stack:
            trainer = training.setup(task, parse_args(flags, world_size=1), stack)
            chunk = unwrap(trainer.model[0])
            modules = list(chunk.modules())
            if task is GPT_TASK:
                biased = [m for m in modules
                          if isinstance(m, ColumnParallelLinear) and m.bias is not None]
                live.update({
                    "grad norm": clip_grads.l2_norm_impl is no_apex.foreach_l2_norm,
                    "clip scale": clip_grads.multi_tensor_scale_impl is no_apex.foreach_scale,
                    "copy scale": core_optimizer.multi_tensor_scale_impl is no_apex.foreach_scale,
                    "grad accumulation fusion": layers._grad_accum_fusion_available,
                    "weight-gradient kernels":
                        layers.fused_weight_gradient_mlp_cuda is WeightGradAccumulation,
                    "bias in epilogue": bool(biased) and all(
                        isinstance(m._forward_impl, functools.partial)
                        and m._forward_impl.func is fused_layers._bias_in_epilogue
                        for m in biased),
                    "embedding into main_grad": [type(m) for m in modules if isinstance(
                        m, VocabParallelEmbedding)] == [fused_layers.WordEmbeddingIntoMainGrad],
                    "SDPA core attention": sum(isinstance(m, attention.SDPAttention)
                                               for m in modules) == 4,
                    "host stream": isinstance(torch.cuda.current_stream(),
                                              cpu_compat._HostStream),
                    "rng state stubs": core_random._get_cuda_rng_state is not original_rng_state[0]
                    and core_random._set_cuda_rng_state is not original_rng_state[1],
                    "language model loss": type(chunk).compute_language_model_loss
                    is models.LanguageModelLoss.compute_language_model_loss,
                    "batch schedule": isinstance(trainer.batch_calculator, BatchSizeSchedule),
                })
                live["sequence-parallel norms"] = _sequence_parallel_norms_tagged(trainer.configs)
                training.train(trainer)  # one step, then a save
                live["results in process"] = type(filesystem_async._results_queue) is queue.Queue
            else:
                live["BERT mask check"] = type(chunk) is models.SDPABertModel and (
                    chunk._sanity_check_attention_and_get_attn_mask_dimension() == "b1ss")
    from megatron.core import utils

    restored = {
        "grad norm": clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm,
        "clip scale": clip_grads.multi_tensor_scale_impl is utils.local_multi_tensor_scale,
        "copy scale": core_optimizer.multi_tensor_scale_impl is utils.local_multi_tensor_scale,
        "grad accumulation fusion": not layers._grad_accum_fusion_available,
        "weight-gradient kernels": not hasattr(layers, "fused_weight_gradient_mlp_cuda"),
        "rng state stubs": (core_random._get_cuda_rng_state,
                            core_random._set_cuda_rng_state) == original_rng_state,
        "bucket writer after the save":
            vars(filesystem_async.FileSystemWriterAsync)["write_preloaded_data"] is bucket_writer,
    }
    return live, restored


def _sequence_parallel_norms_tagged(configs) -> bool:
    """A GPT stage built under --sequence-parallel has torch norms whose parameters carry the
    tag megatron-core sums sequence-parallel gradients by. Built, not run: at TP=1 the config
    refuses sequence parallelism, so it is switched on after validation."""
    import dataclasses

    from megatron.trainer.model import models

    config = models.transformer_config(configs)
    configs = dataclasses.replace(configs, parallel=dataclasses.replace(
        configs.parallel, sequence_parallel=True))
    config.sequence_parallel = True
    stage = models.build_gpt_stage(configs, config, pre_process=True, post_process=True)
    norms = [m for name, m in stage.named_modules()
             if name.rpartition(".")[2] in ("input_layernorm", "pre_mlp_layernorm",
                                            "final_layernorm")]
    return len(norms) == 2 * configs.model.num_layers + 1 and all(
        type(norm) is torch.nn.LayerNorm and norm.weight.sequence_parallel for norm in norms)


def test_every_substitution_is_live_in_a_built_model_and_undone_after(tmp_path):
    (live, restored), = run_ranks(1, _substitutions_in_a_built_model, str(tmp_path / "ckpt"))
    assert [name for name, ok in live.items() if not ok] == []
    assert len(live) == 15  # every check above ran
    assert [name for name, ok in restored.items() if not ok] == []
