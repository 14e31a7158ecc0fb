"""The fused ops the GPU path turns on, against the unfused ones, with their tolerances
(docs/benchmarks/gpu_mfu_h200_2026-11-22.md): bias-GeLU is the tanh GeLU (|diff| < 5e-4
from the exact one); the fused cross-entropy equals megatron-core's unfused one with bf16
logits (same gradient bits, loss to 1e-5) and rounds the gradient of fp32 logits to bf16; the
weight-gradient accumulation fusion gives the unfused main_grad (fp32: to 1e-5)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from megatron.core.fusions.fused_bias_gelu import bias_gelu_impl

from megatron.training import no_apex
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


def _main_grads(rank, fused: bool):
    import contextlib

    from megatron.training import no_apex
    from megatron.training.arguments import parse_args
    from megatron.training.initialize import initialize_distributed
    from megatron.training.models import (
        build_gpt_stage,
        build_model_chunks,
        transformer_config_from_args,
    )
    from megatron.training.optimizer import wrap_model_chunks

    flags = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
             "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size",
             "2", "--global-batch-size", "2", "--vocab-size", "96", "--mock-data",
             "--tokenizer-type", "NullTokenizer", "--lr", "1e-4", "--train-iters", "1",
             "--hidden-dropout", "0", "--attention-dropout", "0", "--distributed-backend",
             "nccl"]
    with contextlib.ExitStack() as stack:
        args = parse_args(flags, world_size=1)
        args.padded_vocab_size = args.vocab_size
        device = initialize_distributed(args, stack)
        config = transformer_config_from_args(args)
        config.gradient_accumulation_fusion = fused
        if fused:
            stack.enter_context(no_apex.weight_grad_accumulation_fusion())
        (model,) = wrap_model_chunks(build_model_chunks(args, config, build_gpt_stage),
                                     args, config, device)
        tokens = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(5))
        tokens, positions = tokens.to(device), torch.arange(16, device=device).expand(2, 16)
        for _ in range(2):  # two microbatches accumulate
            model(tokens, positions, None, labels=tokens).float().mean().backward()
        qkv = model.module.decoder.layers[0].self_attention.linear_qkv.weight
        return ({name: p.main_grad.cpu() for name, p in model.named_parameters()},
                bool(getattr(qkv, "grad_added_to_main_grad", False)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="megatron-core's fused path makes its "
                    "placeholder weight gradient on a CUDA device")
def test_weight_grad_accumulation_fusion_gives_the_unfused_gradients():
    (unfused, unfused_marked), = run_ranks(1, _main_grads, False)
    (fused, fused_marked), = run_ranks(1, _main_grads, True)
    # the fused path really ran: megatron-core's linear layer marks the weight it accumulated
    assert fused_marked and not unfused_marked
    assert fused.keys() == unfused.keys()
    for name, grad in unfused.items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(fused[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_weight_grad_accumulation_stands_in_for_apex_until_exit():
    from megatron.core.tensor_parallel import layers

    generator = torch.Generator().manual_seed(6)
    total_input, grad_output = torch.randn(32, 12, generator=generator), torch.randn(32, 20)
    main_grad = torch.randn(20, 12, generator=generator)
    expected = main_grad + grad_output.t() @ total_input
    assert not layers._grad_accum_fusion_available  # no apex here
    with no_apex.weight_grad_accumulation_fusion():
        assert layers._grad_accum_fusion_available
        layers.fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(
            total_input, grad_output, main_grad)
    assert not layers._grad_accum_fusion_available
    assert not hasattr(layers, "fused_weight_gradient_mlp_cuda")
    torch.testing.assert_close(main_grad, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch's bf16 x bf16 -> fp32 GEMM "
                    "(addmm with out_dtype) exists on CUDA only")
def test_weight_grad_accumulation_in_fp32_from_bf16():
    generator = torch.Generator().manual_seed(7)
    total_input = torch.randn(256, 96, generator=generator).to("cuda", torch.bfloat16)
    grad_output = torch.randn(256, 160, generator=generator).to("cuda", torch.bfloat16)
    main_grad = torch.randn(160, 96, generator=generator).cuda()
    expected = main_grad + grad_output.float().t() @ total_input.float()
    no_apex.WeightGradAccumulation.wgrad_gemm_accum_fp32(total_input, grad_output, main_grad)
    torch.testing.assert_close(main_grad, expected, rtol=1e-5, atol=1e-4)
