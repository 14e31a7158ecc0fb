"""The DPP plugin for Megatron-LM's trainer (megatron/dpp/megatron_lm): its flags are added to
Megatron-LM's parser, --use-dpp makes the trainer's get_forward_backward_func() return the
DPP schedule (and nothing changes without it), what it cannot run is refused in one message,
and the split backward defers the weight gradients of megatron-core's local layers.

Against the real megatron.training where it is importable (megatron-core >= 0.17, Python
3.12); otherwise against tests/megatron_lm_stand_in, a minimal stand-in of its hooks
(parse_args with extra_args_provider; train() and evaluate() calling the
get_forward_backward_func that megatron.training.training imported from
megatron.core.pipeline_parallel, which the tests call as they do).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from types import SimpleNamespace

import pytest
import torch

from megatron.dpp import megatron_lm
from megatron.dpp.compat.core_internals import CoreInternalsError
from megatron.dpp.config import DEFAULTS
from tests import TESTS
from tests.distributed import run_ranks

STAND_IN = TESTS / "megatron_lm_stand_in"
PP2 = ["--pipeline-model-parallel-size", "2"]


@pytest.fixture(scope="module")
def trainer():
    """Megatron-LM's megatron.training (real, or the stand-in when megatron-core ships none)."""
    real = importlib.util.find_spec("megatron.training") is not None
    if not real:
        sys.path.insert(0, str(STAND_IN))
        importlib.invalidate_caches()
    try:
        yield SimpleNamespace(arguments=importlib.import_module("megatron.training.arguments"),
                              training=importlib.import_module("megatron.training.training"),
                              real=real)
    finally:
        if not real:
            sys.path.remove(str(STAND_IN))
            for name in [n for n in sys.modules if n.startswith("megatron.training")]:
                del sys.modules[name]


@pytest.fixture
def parse(trainer, monkeypatch):
    """Parse a command line as Megatron-LM does, with the plugin's provider; the plugin is
    closed (megatron's functions restored) afterwards."""
    providers = []

    def run(*flags, other=None):
        provider = megatron_lm.extra_args_provider(other)
        providers.append(provider)
        monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *flags])
        return trainer.arguments.parse_args(extra_args_provider=provider), provider

    yield run
    for provider in providers:
        provider.close()


def _core_function():
    from megatron.core import pipeline_parallel

    return pipeline_parallel.get_forward_backward_func


def test_flags_are_registered_and_without_use_dpp_nothing_is_patched(trainer, parse):
    from megatron.core.tensor_parallel import layers

    available = layers._grad_accum_fusion_available
    core_function = _core_function()
    assert trainer.training.get_forward_backward_func is core_function
    args, provider = parse(*PP2, "--no-gradient-accumulation-fusion")
    assert layers._grad_accum_fusion_available == available
    assert (args.use_dpp, args.dpp_split_backward, args.dpp_static, args.dpp_defer_weights) == (
        False, False, False, DEFAULTS.defer_weights)
    assert args.dpp_max_inflight is None
    assert (args.dpp_transport, args.dpp_timeout) == (DEFAULTS.transport, DEFAULTS.timeout)
    assert provider.plugin is None
    assert trainer.training.get_forward_backward_func is core_function
    assert _core_function() is core_function


def test_without_use_dpp_the_default_fusion_gets_the_kernel_and_close_restores(trainer, parse):
    """Megatron-LM's default gradient-accumulation fusion without apex: megatron-core's
    linear layers would stop at construction; the provider supplies the kernel without
    --use-dpp too, so that 1F1B and DPP runs differ in that one flag."""
    from megatron.core.tensor_parallel import layers

    available = layers._grad_accum_fusion_available
    core_function = _core_function()
    args, provider = parse(*PP2)
    assert args.gradient_accumulation_fusion and provider.plugin is None
    assert trainer.training.get_forward_backward_func is core_function
    assert layers._grad_accum_fusion_available
    main_grad = torch.zeros(3, 4)
    grad_output, total_input = torch.randn(5, 3), torch.randn(5, 4)
    layers.fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(total_input, grad_output,
                                                                main_grad)
    torch.testing.assert_close(main_grad, grad_output.t() @ total_input)
    provider.close()
    assert layers._grad_accum_fusion_available == available


def test_use_dpp_swaps_the_trainers_schedule_and_close_restores_it(trainer, parse):
    from megatron.dpp.schedule import DppSchedule

    core_function = _core_function()
    args, provider = parse(*PP2, "--use-dpp", "--dpp-max-inflight", "3",
                           "--dpp-transport", "torch", "--dpp-timeout", "5", "--dpp-static")
    # what train() and evaluate() call (the real ones need a whole run's arguments)
    schedule = trainer.training.get_forward_backward_func()
    assert isinstance(schedule, DppSchedule)
    options = schedule.options
    assert (options.slack, options.transport, options.timeout, options.static) == (
        3, "torch", 5.0, True)
    assert schedule.weight_grads is None
    # one schedule for the run: every call (0.19's train() passes schedule_pg_collection) and
    # later callers of megatron-core's function
    assert trainer.training.get_forward_backward_func(schedule_pg_collection=None) is schedule
    assert _core_function()(pp_size=2, vp_size=None) is schedule
    provider.close()
    assert trainer.training.get_forward_backward_func is core_function
    assert _core_function() is core_function


def test_a_script_provider_is_kept(parse):
    def modelopt_like(parser):
        parser.add_argument("--script-flag", type=int, default=7)
        return parser

    args, _ = parse(*PP2, "--use-dpp", "--script-flag", "9", other=modelopt_like)
    assert args.script_flag == 9 and args.use_dpp


@pytest.mark.parametrize("flags, reason", [
    (["--use-dpp"], "--use-dpp needs --pipeline-model-parallel-size > 1"),
    (PP2 + ["--use-dpp", "--num-experts", "8"], "--num-experts 8: mixture-of-experts"),
    (PP2 + ["--use-dpp", "--context-parallel-size", "2"],
     "--context-parallel-size 2: context parallelism is not supported"),
    (PP2 + ["--use-dpp", "--dpp-split-backward"],
     "--dpp-split-backward with --transformer-impl transformer_engine"),
    (PP2 + ["--use-dpp", "--dpp-split-backward", "--transformer-impl", "local",
            "--no-gradient-accumulation-fusion"], "drop --no-gradient-accumulation-fusion"),
    (PP2 + ["--dpp-split-backward", "--transformer-impl", "local"],
     "--dpp-split-backward needs --use-dpp"),
    (PP2 + ["--dpp-static"], "--dpp-static needs --use-dpp"),
    (PP2 + ["--dpp-defer-weights"], "--dpp-defer-weights needs --use-dpp"),
    (PP2 + ["--use-dpp", "--dpp-defer-weights"], "--dpp-defer-weights places the W tasks"),
    (PP2 + ["--use-dpp", "--overlap-param-gather"], "--overlap-param-gather is not supported"),
    (PP2 + ["--use-dpp", "--cuda-graph-impl", "full_iteration"],
     "--cuda-graph-impl full_iteration"),
    (PP2 + ["--use-dpp", "--deterministic-mode"], "--deterministic-mode"),
    (PP2 + ["--use-dpp", "--dpp-max-inflight", "-1"], "--dpp-max-inflight -1 must be >= 0"),
])
def test_what_the_plugin_cannot_run_is_refused_by_name(trainer, parse, capsys, flags, reason):
    core_function = _core_function()
    with pytest.raises(SystemExit) as exit_info:
        parse(*flags)
    assert exit_info.value.code == 2
    message = capsys.readouterr().err
    assert "the DPP plugin cannot run these arguments" in message and reason in message
    assert trainer.training.get_forward_backward_func is core_function


def test_every_problem_is_named_in_one_message(parse, capsys):
    with pytest.raises(SystemExit):
        parse(*PP2, "--use-dpp", "--num-experts", "4", "--context-parallel-size", "2")
    message = capsys.readouterr().err
    assert "--num-experts 4" in message and "--context-parallel-size 2" in message


def test_a_changed_trainer_hook_stops_the_start_naming_it(trainer, parse, monkeypatch):
    def train_without_the_schedule_call():
        return None

    monkeypatch.setattr(trainer.training, "train", train_without_the_schedule_call)
    core_function = _core_function()
    with pytest.raises(CoreInternalsError,
                       match=r"megatron.training.training:train: megatron.core no longer uses "
                             r"get_forward_backward_func\("):
        parse(*PP2, "--use-dpp")
    assert trainer.training.get_forward_backward_func is core_function


def test_split_backward_installs_the_store_and_the_weight_gradient_kernel(trainer, parse):
    from megatron.core.tensor_parallel import layers

    available = layers._grad_accum_fusion_available
    args, provider = parse(*PP2, "--use-dpp", "--dpp-split-backward", "--transformer-impl",
                           "local", "--dpp-defer-weights")
    schedule = trainer.training.get_forward_backward_func()
    assert schedule.weight_grads is not None and schedule.options.defer_weights
    assert layers._grad_accum_fusion_available
    assert hasattr(layers.fused_weight_gradient_mlp_cuda, "wgrad_gemm_accum_fp32")
    provider.close()
    assert layers._grad_accum_fusion_available == available


def _split_linear_rank(rank, stand_in):
    """Megatron-core's local ColumnParallelLinear built after the plugin activated the split:
    its weight gradient waits for W, and W gives autograd's gradient."""
    import sys as rank_sys

    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    from megatron.trainer.core_compat.cpu_compat import CpuCompat

    if stand_in and str(STAND_IN) not in rank_sys.path:
        rank_sys.path.insert(0, str(STAND_IN))
    from megatron.training import arguments

    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel()
    provider = megatron_lm.extra_args_provider()
    rank_sys.argv = ["pretrain_gpt.py", *PP2, "--use-dpp", "--dpp-split-backward",
                     "--transformer-impl", "local"]
    arguments.parse_args(extra_args_provider=provider)
    try:
        with CpuCompat():
            store = provider.plugin.get_forward_backward_func().weight_grads
            config = ModelParallelConfig(gradient_accumulation_fusion=True,
                                         use_cpu_initialization=True)
            torch.manual_seed(0)
            layer = ColumnParallelLinear(16, 24, config=config, init_method=torch.nn.init.normal_,
                                         bias=False, gather_output=True)
            layer.weight.main_grad = torch.zeros_like(layer.weight)
            layer.weight.grad_added_to_main_grad = False
            x = torch.randn(8, 2, 16, requires_grad=True)
            upstream = torch.randn(8, 2, 24)
            store.begin_iteration(SimpleNamespace(gradient_accumulation_fusion=True,
                                                  no_sync_func=None, grad_sync_func=None), 1, 1)
            with store.deferring((0, 0)):
                layer(x)[0].backward(upstream)
            deferred = layer.weight.main_grad.abs().sum().item()
            store.run((0, 0))
            store.end_iteration()
            expected = upstream.reshape(16, 24).t() @ x.detach().reshape(16, 16)
            return (deferred, (layer.weight.main_grad - expected).abs().max().item(),
                    (x.grad - upstream @ layer.weight.detach()).abs().max().item())
    finally:
        provider.close()


def test_split_backward_defers_megatron_cores_local_layer(trainer):
    deferred, weight_error, input_error = run_ranks(1, _split_linear_rank, not trainer.real)[0]
    assert deferred == 0  # B left the weight gradient to W
    assert weight_error < 1e-5 and input_error < 1e-5
