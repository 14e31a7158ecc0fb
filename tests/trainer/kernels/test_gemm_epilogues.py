"""The cuBLASLt epilogue GEMMs (megatron/trainer/kernels/gemm_epilogues.py) against float64
math, and the MLP built on them (gelu_mlp.py) against megatron-core's fc1, bias-GeLU and fc2.

They need a GPU and the native module, which prerequisite.sh builds where CUDA is.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron.trainer.kernels import gemm_epilogues
from tests.distributed import run_ranks
from tests.trainer_runs import TINY, train_runs, with_flags

needs_gemms = pytest.mark.skipif(
    not (torch.cuda.is_available() and gemm_epilogues.built()),
    reason="the epilogue GEMMs need a CUDA GPU and megatron.trainer.kernels._gemm_epilogues "
           "(built by prerequisite.sh where CUDA is)")

# largest error allowed, relative to the largest reference value: bf16 and fp16 round the
# output once (and the pre-activation GeLU reads), fp32 accumulates over K in another order
RELATIVE_ERROR = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-4}
# (tokens, hidden, ffn): ../shared/GPU.md's GPT, and odd multiples of 8
SHAPES = [(4096, 2048, 8192), (136, 72, 200)]


def _gelu_tanh(x):
    return 0.5 * x * (1 + torch.tanh(0.7978845608028654 * (x + 0.044715 * x ** 3)))


def _close(actual, reference, dtype):
    reference = reference.to(torch.float64)
    error = (actual.to(torch.float64) - reference).abs().max().item()
    assert error <= RELATIVE_ERROR[dtype] * reference.abs().max().item(), error


def _operands(tokens, hidden, ffn, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)

    def make(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=generator)).to(dtype).cuda()

    # scaled so the pre-activations span GeLU's curved middle and both tails
    return (make(tokens, hidden), make(ffn, hidden, scale=2 / hidden ** 0.5), make(ffn),
            make(hidden, ffn, scale=1 / ffn ** 0.5), make(tokens, hidden))


@needs_gemms
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES, ids=["gpt", "odd"])
def test_epilogues_compute_bias_gelu_and_its_gradient(shape, dtype):
    x, w1, b1, w2, grad_y = _operands(*shape, dtype)
    output, pre = gemm_epilogues.linear_bias_gelu(x, w1, b1)
    reference_pre = x.double() @ w1.double().t() + b1.double()
    _close(pre, reference_pre, dtype)
    _close(output, _gelu_tanh(reference_pre), dtype)
    assert output.dtype == pre.dtype == dtype

    grad_pre, grad_bias = gemm_epilogues.gelu_backward_linear(grad_y, w2, pre)
    # the derivative at the pre-activation the GEMM stored, as the backward reads it
    at = pre.double().requires_grad_()
    _gelu_tanh(at).backward(grad_y.double() @ w2.double())
    _close(grad_pre, at.grad, dtype)
    _close(grad_bias, at.grad.sum(0), dtype)
    assert grad_bias.shape == b1.shape and grad_bias.dtype == dtype


@needs_gemms
def test_mlp_function_gives_the_unfused_gradients_and_accumulates_into_main_grad():
    from megatron.trainer.model.gelu_mlp import _GeluMLP

    x, w1, b1, w2, grad_y = _operands(136, 72, 200, torch.float32)
    leaves = [t.clone().requires_grad_() for t in (x, w1, b1, w2)]
    F.linear(F.gelu(F.linear(leaves[0], leaves[1], leaves[2]), approximate="tanh"),
             leaves[3]).backward(grad_y)
    fused = [t.clone().requires_grad_() for t in (x, w1, b1, w2)]
    _GeluMLP.apply(*fused, False).backward(grad_y)
    for mine, reference in zip(fused, leaves, strict=True):
        _close(mine.grad, reference.grad, torch.float32)

    # the gradient-accumulation fusion: weight gradients added to main_grad, placeholders out
    fused = [t.clone().requires_grad_() for t in (x, w1, b1, w2)]
    for weight in (fused[1], fused[3]):
        weight.main_grad = torch.ones_like(weight)
        weight.grad_added_to_main_grad = False
    _GeluMLP.apply(*fused, True).backward(grad_y)
    for weight, reference in ((fused[1], leaves[1]), (fused[3], leaves[3])):
        _close(weight.main_grad - 1, reference.grad, torch.float32)
        assert weight.grad_added_to_main_grad
    _close(fused[0].grad, leaves[0].grad, torch.float32)


@torch._dynamo.config.patch(disable=True)  # megatron-core's bias_gelu_impl without compiling
def _megatron_mlps(rank):
    """megatron-core's dense MLP (local layers, fused bias-GeLU, bf16) as the transformer layer
    calls it, with and without gelu_mlp.install: outputs, gradients, and how many forwards
    went through the epilogue GEMMs."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import (
        ColumnParallelLinear,
        RowParallelLinear,
        model_parallel_cuda_manual_seed,
    )
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron.trainer.model import gelu_mlp

    torch.distributed.init_process_group("nccl")
    torch.cuda.set_device(0)
    parallel_state.initialize_model_parallel()
    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4,
                               bias_activation_fusion=True, add_bias_linear=True,
                               bf16=True, params_dtype=torch.bfloat16)
    submodules = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(32, 2, 64, generator=generator).to(torch.bfloat16).cuda()
    grad = torch.randn(32, 2, 64, generator=generator).to(torch.bfloat16).cuda()
    calls = []
    through_epilogues = gemm_epilogues.linear_bias_gelu
    gemm_epilogues.linear_bias_gelu = lambda *a: calls.append(1) or through_epilogues(*a)
    results = {}
    for fused in (False, True):
        model_parallel_cuda_manual_seed(1)  # the same initial weights for both
        mlp = MLP(config, submodules).cuda()
        with torch.no_grad():  # megatron-core starts biases at zero
            mlp.linear_fc1.bias.copy_(torch.randn(256, generator=torch.Generator().manual_seed(2)))
        installed = gelu_mlp.install(mlp) if fused else 0
        leaf = x.clone().requires_grad_()
        output, bias = mlp(leaf, padding_mask=None)  # as TransformerLayer calls it (0.19)
        (output + bias).backward(grad)
        results[fused] = (installed, output.detach(), leaf.grad,
                          *(p.grad for p in mlp.parameters()))
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()
    return results, len(calls)


@needs_gemms
def test_installed_mlp_computes_megatron_cores_mlp_through_the_epilogues():
    results, calls = run_ranks(1, _megatron_mlps, gpu=True)[0]
    (installed, *fused), (_, *unfused) = results[True], results[False]
    assert installed == 1 and calls == 1
    for mine, reference in zip(fused, unfused, strict=True):
        _close(mine, reference, torch.bfloat16)


@pytest.mark.slow
@needs_gemms
@pytest.mark.long
def test_trainer_defaults_train_as_without_the_epilogues():
    """The defaults (MLPs on the epilogue GEMMs, graphed) against --no-gelu-gemm-epilogue
    (fc1, Triton bias-GeLU, fc2) in fp32 without dropout: the same losses and gradient norms
    up to the GEMMs' summation order."""
    flags = with_flags(TINY, train_iters=3, global_batch_size=8, hidden_size=64,
                       num_attention_heads=4, hidden_dropout=0.0, attention_dropout=0.0)
    fused, unfused = run_ranks(1, train_runs, [flags, [*flags, "--no-gelu-gemm-epilogue"]], 1,
                               gpu=True)[0]
    assert not [m for _, m in fused["logs"] if " off: " in m]
    assert any("MLPs compute bias-GeLU in their GEMM epilogues" in m for _, m in fused["logs"])
    assert not any("GEMM epilogues" in m for _, m in unfused["logs"])

    def values(run):
        losses = [value for step in run["losses"] for value in step.values()]
        return torch.tensor([*losses, *run["grad_norms"]], dtype=torch.float64)

    torch.testing.assert_close(values(fused), values(unfused), rtol=1e-4, atol=0)
