"""The fused ops the GPU path turns on, against the unfused ones, with their tolerances
(docs/benchmarks/gpu_mfu_h200_2026-11-22.md): bias-GeLU is the tanh GeLU (|diff| < 5e-4
from the exact one); the fused cross-entropy equals megatron-core's unfused one with bf16
logits (same gradient bits, loss to 1e-5) and rounds the gradient of fp32 logits to bf16."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.fusions.fused_bias_gelu import bias_gelu_impl

from tests.distributed import run_ranks


def test_bias_gelu_is_the_tanh_gelu():
    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 2, 96, generator=generator) * 3).requires_grad_()
    bias = torch.randn(96, generator=generator).requires_grad_()
    fused = bias_gelu_impl(x, bias)
    reference_x, reference_bias = x.detach().clone().requires_grad_(), bias.detach().clone()
    reference_bias.requires_grad_()
    tanh = F.gelu(reference_x + reference_bias, approximate="tanh")
    torch.testing.assert_close(fused, tanh, rtol=1e-5, atol=1e-6)
    exact = F.gelu(x.detach() + bias.detach())
    difference = (fused.detach() - exact).abs().max().item()
    assert 1e-6 < difference < 5e-4  # the approximation shows, within the stated bound
    upstream = torch.randn(fused.shape, generator=generator)
    fused.backward(upstream)
    tanh.backward(upstream)
    torch.testing.assert_close(x.grad, reference_x.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(bias.grad, reference_bias.grad, rtol=1e-4, atol=1e-4)


def _cross_entropies(rank):
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy

    torch.distributed.init_process_group("gloo")
    parallel_state.initialize_model_parallel()
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(32, 2, 160, generator=generator) * 4
    labels = torch.randint(0, 160, (32, 2), generator=generator)
    results = {}
    for dtype in (torch.bfloat16, torch.float32):
        for name, function in (
            ("fused", lambda t: fused_vocab_parallel_cross_entropy(
                t, labels, parallel_state.get_tensor_model_parallel_group())),
            ("unfused", lambda t: tensor_parallel.vocab_parallel_cross_entropy(t, labels)),
        ):
            leaf = logits.to(dtype).clone().requires_grad_()  # fp32: .to() would not copy
            loss = function(leaf)
            loss.sum().backward()
            results[name, dtype] = (loss.detach(), leaf.grad)
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()
    return results


def test_fused_cross_entropy_matches_unfused_in_bf16_only():
    (results,) = run_ranks(1, _cross_entropies)
    (fused_loss, fused_grad), (loss, grad) = (results["fused", torch.bfloat16],
                                              results["unfused", torch.bfloat16])
    assert fused_loss.shape == loss.shape == (32, 2)
    torch.testing.assert_close(fused_loss, loss, rtol=1e-5, atol=1e-5)
    assert torch.equal(fused_grad, grad)
    # megatron-core's fused version rounds the gradient to bf16 whatever the logits' dtype:
    # with fp32 logits it is off by bf16's precision, hence --bf16 only (test_arguments)
    (_, fused_grad), (_, grad) = results["fused", torch.float32], results["unfused", torch.float32]
    assert fused_grad.dtype == torch.float32
    assert 1e-4 < (fused_grad - grad).abs().max().item() < 1e-2
    torch.testing.assert_close(fused_grad, grad.to(torch.bfloat16).float(), rtol=0, atol=1e-2)
