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

from megatron.dpp.weight_grad_accumulation import (
    WeightGradAccumulation,
    weight_grad_accumulation_fusion,
)
from tests.distributed import run_ranks

# megatron-core's fused functions without torch.compile: on the CPU it would build C++
# kernels that no GPU run uses (10-70 s per process on a loaded machine); the functions' math
# is what these tests check
eagerly = torch._dynamo.config.patch(disable=True)


@eagerly
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


@eagerly
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


def _main_grads(rank, fused: bool, extra_flags=()):
    import contextlib

    from megatron.dpp.weight_grad_accumulation import weight_grad_accumulation_fusion
    from megatron.trainer.config.arguments import parse_args
    from megatron.trainer.model.models import (
        build_gpt_stage,
        build_model_chunks,
        transformer_config,
    )
    from megatron.trainer.run.initialize import initialize_distributed
    from megatron.trainer.run.optimizer import wrap_model_chunks
    from tests.trainer_runs import exact_vocab_configs

    flags = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
             "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size",
             "2", "--global-batch-size", "2", "--vocab-size", "96", "--mock-data",
             "--tokenizer-type", "NullTokenizer", "--lr", "1e-4", "--train-iters", "1",
             "--hidden-dropout", "0", "--attention-dropout", "0", "--distributed-backend",
             "nccl" if torch.cuda.is_available() else "gloo", *extra_flags]
    with contextlib.ExitStack() as stack:
        configs = exact_vocab_configs(parse_args(flags, world_size=1))
        device = initialize_distributed(configs, stack)
        config = transformer_config(configs)
        config.gradient_accumulation_fusion = fused
        if fused:
            stack.enter_context(weight_grad_accumulation_fusion())
        (model,) = wrap_model_chunks(build_model_chunks(configs, config, build_gpt_stage),
                                     configs, config, device)
        tokens = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(5))
        tokens, positions = tokens.to(device), torch.arange(16, device=device).expand(2, 16)
        losses = []
        for _ in range(2):  # two microbatches accumulate
            loss = model(tokens, positions, None, labels=tokens).float()
            loss.mean().backward()
            losses.append(loss.detach().cpu())
        marked = [bool(getattr(p, "grad_added_to_main_grad", False)) for p in (
            model.module.decoder.layers[0].self_attention.linear_qkv.weight,
            model.module.embedding.word_embeddings.weight)]
        return ({name: p.main_grad.cpu() for name, p in model.named_parameters()}, marked,
                losses)


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="megatron-core's fused path makes its "
                    "placeholder weight gradient on a CUDA device")
@pytest.mark.parametrize("tying", [[], ["--untie-embeddings-and-output-weights"]],
                         ids=["tied", "untied"])
@pytest.mark.long
def test_weight_grad_accumulation_fusion_gives_the_unfused_gradients(tying):
    # the embedding accumulates into main_grad (fused_layers.py), untied and tied on one
    # stage, where the output layer's placeholder gradient is then left unfilled
    (unfused, unfused_marked, _), = run_ranks(1, _main_grads, False, tying, gpu=True)
    (fused, fused_marked, _), = run_ranks(1, _main_grads, True, tying, gpu=True)
    # the fused paths really ran: megatron-core's linear layer and the project's word
    # embedding (fused_layers.py) mark the weights they accumulated
    assert fused_marked == [True, True] and unfused_marked == [False, False]
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
    with weight_grad_accumulation_fusion():
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
    WeightGradAccumulation.wgrad_gemm_accum_fp32(total_input, grad_output, main_grad)
    torch.testing.assert_close(main_grad, expected, rtol=1e-5, atol=1e-4)


def _single_pass_cross_entropies(rank):
    """Each of two tensor-parallel ranks holds half of a 160-entry vocabulary."""
    from megatron.core import parallel_state, tensor_parallel

    from megatron.trainer.kernels.cross_entropy import vocab_parallel_cross_entropy

    torch.distributed.init_process_group("gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    generator = torch.Generator().manual_seed(8)
    logits = (torch.randn(32, 2, 160, generator=generator) * 4)[..., 80 * rank:80 * (rank + 1)]
    labels = torch.randint(0, 160, (32, 2), generator=generator)
    upstream = torch.randn(32, 2, generator=generator)
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        for name, function in (
            ("single pass", lambda t: vocab_parallel_cross_entropy(
                t, labels, parallel_state.get_tensor_model_parallel_group())),
            ("unfused", lambda t: tensor_parallel.vocab_parallel_cross_entropy(t, labels)),
        ):
            leaf = logits.to(dtype).clone().requires_grad_()
            loss = function(leaf)
            loss.backward(upstream)
            results[name, dtype] = (loss.detach(), leaf.grad)
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()
    return results


def test_single_pass_cross_entropy_matches_unfused_across_tensor_parallel_ranks():
    for results in run_ranks(2, _single_pass_cross_entropies):
        loss, grad = results["single pass", torch.float32]
        reference_loss, reference_grad = results["unfused", torch.float32]
        assert loss.dtype == torch.float32 and grad.dtype == torch.float32
        torch.testing.assert_close(loss, reference_loss, rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(grad, reference_grad, rtol=1e-5, atol=1e-6)
        # bf16 logits: the loss stays fp32; the gradient comes back in bf16, one rounding
        # of the fp32 value away from megatron-core's
        loss, grad = results["single pass", torch.bfloat16]
        reference_loss, reference_grad = results["unfused", torch.bfloat16]
        assert loss.dtype == torch.float32 and grad.dtype == torch.bfloat16
        torch.testing.assert_close(loss, reference_loss.float(), rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(grad.float(), reference_grad.float(), rtol=8e-3, atol=1e-5)


def test_single_pass_cross_entropy_in_a_gpt_equals_the_unfused_loss():
    """--cross-entropy-fusion-impl triton through the model (fp32, CPU: the torch passes)."""
    (reference, _, reference_losses), = run_ranks(1, _main_grads, False)
    (fused, _, losses), = run_ranks(1, _main_grads, False, (
        "--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "triton"))
    for loss, reference_loss in zip(losses, reference_losses, strict=True):
        torch.testing.assert_close(loss, reference_loss, rtol=1e-6, atol=1e-6)
    for name, grad in reference.items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(fused[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_bias_in_the_gemm_epilogue_gives_linear_and_its_gradients():
    from megatron.trainer.kernels.fused_layers import biased_linear

    generator = torch.Generator().manual_seed(9)
    x, weight, bias = (torch.randn(shape, generator=generator).requires_grad_()
                       for shape in ((8, 2, 16), (24, 16), (24,)))
    upstream = torch.randn(8, 2, 24, generator=generator)
    output = biased_linear(x, weight, bias, False)
    output.backward(upstream)
    copies = [t.detach().clone().requires_grad_() for t in (x, weight, bias)]
    reference = F.linear(*copies)
    reference.backward(upstream)
    torch.testing.assert_close(output, reference, rtol=1e-6, atol=1e-6)
    for mine, theirs in zip((x, weight, bias), copies, strict=True):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-6, atol=1e-6)


def test_bias_in_the_gemm_epilogue_accumulates_into_main_grad():
    from megatron.trainer.kernels.fused_layers import biased_linear

    generator = torch.Generator().manual_seed(10)
    weight = torch.nn.Parameter(torch.randn(24, 16, generator=generator))
    bias = torch.nn.Parameter(torch.randn(24, generator=generator))
    weight.main_grad, weight.grad_added_to_main_grad = torch.ones(24, 16), False
    inputs = [torch.randn(8, 2, 16, generator=generator) for _ in range(2)]
    for x in inputs:  # two microbatches
        biased_linear(x, weight, bias, True).sum().backward()
    expected = 1 + sum(torch.ones(16, 24).t() @ x.reshape(16, 16) for x in inputs)
    torch.testing.assert_close(weight.main_grad, expected, rtol=1e-6, atol=1e-5)
    assert weight.grad_added_to_main_grad  # DDP's hook will not add the placeholder


def test_word_embedding_accumulates_rows_into_main_grad():
    from megatron.trainer.kernels.fused_layers import _EmbeddingIntoMainGrad

    generator = torch.Generator().manual_seed(11)
    weight = torch.nn.Parameter(torch.randn(50, 16, generator=generator))
    weight.main_grad, weight.grad_added_to_main_grad = torch.randn(50, 16), False
    expected = weight.main_grad.clone()
    for _ in range(2):
        ids = torch.randint(0, 50, (4, 8), generator=generator)  # repeated ids included
        upstream = torch.randn(4, 8, 16, generator=generator)
        output = _EmbeddingIntoMainGrad.apply(ids, weight, False)
        torch.testing.assert_close(output, F.embedding(ids, weight.detach()))
        output.backward(upstream)
        reference = weight.detach().clone().requires_grad_()
        F.embedding(ids, reference).backward(upstream)
        expected += reference.grad
    torch.testing.assert_close(weight.main_grad, expected, rtol=1e-6, atol=1e-6)
    assert weight.grad_added_to_main_grad


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernels need a CUDA GPU")
@pytest.mark.parametrize("vocab", [50304, 1000])
def test_triton_cross_entropy_matches_the_torch_passes(vocab):
    from megatron.trainer.kernels.cross_entropy import (
        VocabParallelCrossEntropy,
        _TorchPasses,
        _TritonPasses,
        triton_available,
    )

    assert triton_available()
    generator = torch.Generator().manual_seed(12)
    logits = (torch.randn(128, 2, vocab, generator=generator) * 4).to("cuda", torch.bfloat16)
    labels = torch.randint(0, vocab, (128, 2), generator=generator).cuda()
    upstream = torch.randn(128, 2, generator=generator).cuda()
    results = []
    for passes in (_TritonPasses(), _TorchPasses()):
        leaf = logits.clone().requires_grad_()
        loss = VocabParallelCrossEntropy.apply(leaf, labels, None, passes)
        loss.backward(upstream)
        results.append((loss, leaf.grad))
    (loss, grad), (reference_loss, reference_grad) = results
    torch.testing.assert_close(loss, reference_loss, rtol=1e-6, atol=1e-5)
    assert grad.dtype == torch.bfloat16
    torch.testing.assert_close(grad.float(), reference_grad.float(), rtol=8e-3, atol=1e-6)
    exact = F.cross_entropy(logits.float().view(-1, vocab), labels.view(-1), reduction="none")
    torch.testing.assert_close(loss.view(-1), exact, rtol=1e-6, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="checks CUDA's index_put_ kernel")
def test_word_embedding_accumulation_is_deterministic_on_gpu():
    from megatron.trainer.kernels.fused_layers import _EmbeddingIntoMainGrad

    generator = torch.Generator().manual_seed(13)
    ids = torch.randint(0, 512, (2, 2048), generator=generator).cuda()  # many repeats
    upstream = torch.randn(2, 2048, 256, generator=generator).to("cuda", torch.bfloat16)
    main_grads = []
    for _ in range(3):
        weight = torch.nn.Parameter(torch.zeros(512, 256, device="cuda", dtype=torch.bfloat16))
        weight.main_grad, weight.grad_added_to_main_grad = torch.zeros(512, 256,
                                                                       device="cuda"), False
        _EmbeddingIntoMainGrad.apply(ids, weight, False).backward(upstream)
        main_grads.append(weight.main_grad)
    assert torch.equal(main_grads[0], main_grads[1]) and torch.equal(main_grads[0], main_grads[2])
    reference = torch.zeros(512, 256, device="cuda").index_add_(
        0, ids.view(-1), upstream.view(-1, 256).float())
    torch.testing.assert_close(main_grads[0], reference, rtol=1e-5, atol=1e-4)


def _cross_entropy_on_biased_logits(rank):
    from megatron.core import parallel_state, tensor_parallel

    from megatron.trainer.kernels.fused_layers import biased_linear

    torch.distributed.init_process_group("gloo")
    parallel_state.initialize_model_parallel()
    generator = torch.Generator().manual_seed(14)
    x, weight, bias = (torch.randn(shape, generator=generator).requires_grad_()
                       for shape in ((8, 2, 16), (40, 16), (40,)))
    labels = torch.randint(0, 40, (8, 2), generator=generator)
    # megatron-core's unfused cross-entropy edits the logits in place
    tensor_parallel.vocab_parallel_cross_entropy(biased_linear(x, weight, bias, False),
                                                 labels).sum().backward()
    copies = [t.detach().clone().requires_grad_() for t in (x, weight, bias)]
    F.cross_entropy(F.linear(*copies).view(-1, 40), labels.view(-1), reduction="sum").backward()
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()
    return [(mine.grad, theirs.grad) for mine, theirs in zip((x, weight, bias), copies,
                                                              strict=True)]


def test_biased_linear_output_may_be_modified_in_place():
    """BERT's output layer has a bias, so its logits come from biased_linear."""
    (pairs,) = run_ranks(1, _cross_entropy_on_biased_logits)
    for mine, theirs in pairs:
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)


def _fused_layer_paths(rank):
    """One step of a GPT with the project's layers (fused_layers.install_fused_layers) and
    one with megatron-core's own, counting the calls of the project's biased linear."""
    import contextlib

    from megatron.core.tensor_parallel import ColumnParallelLinear

    from megatron.trainer.config.arguments import parse_args
    from megatron.trainer.kernels import fused_layers
    from megatron.trainer.model import models
    from megatron.trainer.run import initialize
    from megatron.trainer.run.training import setup
    from megatron.trainer.tasks.gpt import GPT_TASK
    from tests.pipeline_runs import TINY_GPT, one_step
    from tests.trainer_runs import _destroy_model_parallel_only

    initialize._shutdown = _destroy_model_parallel_only  # two set-ups in one process
    calls = []
    project_linear = fused_layers.biased_linear

    def counting_linear(*args, **kwargs):
        calls.append(1)
        return project_linear(*args, **kwargs)

    fused_layers.biased_linear = counting_linear
    results = {}
    for patched in (True, False):
        if not patched:
            models.install_fused_layers = lambda model, config, triton_fusions: None
        args = parse_args(TINY_GPT + ["--global-batch-size", "4"], world_size=1)
        with contextlib.ExitStack() as stack:
            trainer = setup(GPT_TASK, args, stack)
            # the layers that add their own bias (not fc1, whose bias goes with the GeLU)
            biased = sum(isinstance(m, ColumnParallelLinear) and m.bias is not None
                         and not m.skip_bias_add for m in trainer.model[0].modules())
            calls.clear()
            losses, grads = one_step(trainer, trainer.schedule, args.num_microbatches)
            results[patched] = (losses, grads, len(calls), biased * args.num_microbatches)
    return results


def test_column_parallel_linears_take_the_bias_in_epilogue_path():
    """install_fused_layers really reroutes every ColumnParallelLinear of a built GPT that
    adds its own bias (the qkv projections) through biased_linear, and the step equals
    megatron-core's path."""
    (results,) = run_ranks(1, _fused_layer_paths)
    (losses, grads, calls, forwards), (stock_losses, stock_grads, stock_calls, _) = (
        results[True], results[False])
    assert forwards > 0 and calls == forwards
    assert stock_calls == 0
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(stock_losses),
                               rtol=1e-6, atol=1e-5)
    assert grads.keys() == stock_grads.keys()
    for name, (grad, _) in grads.items():
        torch.testing.assert_close(grad, stock_grads[name][0], rtol=1e-5, atol=1e-6, msg=name)
