"""TritonNorm (megatron/trainer/kernels/triton_norm.py): the Triton kernels on a GPU against torch's
norms in float64, and the module's torch path elsewhere."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
import torch.nn.functional as F
from megatron.core.transformer import TransformerConfig

from megatron.trainer.kernels.triton_norm import TritonNorm, TritonResidualNorm

GPU = torch.cuda.is_available() and importlib.util.find_spec("triton") is not None
needs_gpu = pytest.mark.skipif(not GPU, reason="the norm kernels need a CUDA GPU and Triton")


def _config(normalization="LayerNorm", zero_centered=False, sequence_parallel=False):
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1,
                               normalization=normalization,
                               layernorm_zero_centered_gamma=zero_centered)
    config.sequence_parallel = sequence_parallel  # set after: it asks for a TP size > 1
    return config


def _reference(norm: TritonNorm, x: torch.Tensor, grad: torch.Tensor):
    """Output and gradients (input, weight, bias) of torch's norm in float64."""
    x = x.detach().double().requires_grad_()
    weight = norm.weight.detach().double().requires_grad_()
    bias = None if norm.bias is None else norm.bias.detach().double().requires_grad_()
    scale = weight + 1 if norm.zero_centered else weight
    shape = (x.shape[-1],)
    out = (F.rms_norm(x, shape, scale, norm.eps) if norm.rms
           else F.layer_norm(x, shape, scale, bias, norm.eps))
    out.backward(grad.double())
    return out, x.grad, weight.grad, None if bias is None else bias.grad


def _run(norm: TritonNorm, x: torch.Tensor, grad: torch.Tensor):
    x = x.detach().requires_grad_()
    norm.zero_grad(set_to_none=True)
    out = norm(x)
    out.backward(grad)
    bias = getattr(norm, "bias", None)  # torch's RMSNorm has none
    return out, x.grad, norm.weight.grad, None if bias is None else bias.grad


def _randomised(norm: TritonNorm, dtype, device, generator) -> TritonNorm:
    with torch.no_grad():
        for param in norm.parameters():
            param.add_(0.2 * torch.randn(param.shape, generator=generator))
    return norm.to(device, dtype)


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("zero_centered", [False, True], ids=["weight", "weight-1p"])
def test_the_torch_path_is_torchs_norm(normalization, zero_centered):
    generator = torch.Generator().manual_seed(1)
    norm = _randomised(TritonNorm(_config(normalization, zero_centered), 24, eps=1e-6),
                       torch.float32, "cpu", generator)
    x, grad = (torch.randn(5, 3, 24, generator=generator) for _ in range(2))
    for got, expected in zip(_run(norm, x, grad), _reference(norm, x, grad), strict=True):
        if expected is None:
            assert got is None
        else:
            torch.testing.assert_close(got, expected.float())


def _run_with_residual(norm: TritonResidualNorm, x, grad, residual_grad):
    """Input gradient when the norm's output gets `grad` and its residual `residual_grad`
    (None: the residual is not used)."""
    x = x.detach().requires_grad_()
    out, residual = norm(x)
    assert residual.data_ptr() == x.data_ptr() and residual.shape == x.shape
    loss = (out.float() * grad.float()).sum()
    if residual_grad is not None:
        loss = loss + (residual.float() * residual_grad.float()).sum()
    loss.backward()
    return out, x.grad


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_gpu)])
def test_the_residual_norm_adds_the_residuals_gradient(device):
    """TritonResidualNorm hands back its input as the layer's residual; the gradient that
    comes back through it is added to the input's (on the GPU inside the norm's kernel)."""
    generator = torch.Generator().manual_seed(6)
    dtype = torch.float32
    plain = _randomised(TritonNorm(_config(), 256), dtype, device, generator)
    with_residual = TritonResidualNorm(_config(), 256).to(device, dtype)
    with_residual.load_state_dict(plain.state_dict())
    x, grad, residual_grad = (torch.randn(33, 2, 256, generator=generator).to(device, dtype)
                              for _ in range(3))
    expected_out, _, _, _ = _run(plain, x, grad)
    # without the residual's gradient: the plain norm's, bit for bit
    out, grad_in = _run_with_residual(with_residual, x, grad, None)
    assert torch.equal(out, expected_out)
    assert torch.equal(grad_in, _run(plain, x, grad)[1])
    # with it: the two added (once, in fp32, rounded once)
    _, grad_in = _run_with_residual(with_residual, x, grad, residual_grad)
    torch.testing.assert_close(grad_in, _run(plain, x, grad)[1] + residual_grad,
                               rtol=1e-6, atol=1e-6)


def test_parameters_are_named_and_tagged_as_megatron_cores_norms():
    norm = TritonNorm(_config(sequence_parallel=True), 16)
    assert list(norm.state_dict()) == list(torch.nn.LayerNorm(16).state_dict())
    assert all(param.sequence_parallel for param in norm.parameters())
    assert torch.equal(norm.weight, torch.ones(16))
    assert list(TritonNorm(_config("RMSNorm"), 16).state_dict()) == ["weight"]
    # --apply-layernorm-1p keeps the weight as an offset from 1
    assert torch.equal(TritonNorm(_config(zero_centered=True), 16).weight, torch.zeros(16))


@needs_gpu
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("zero_centered", [False, True], ids=["weight", "weight-1p"])
@pytest.mark.parametrize("shape,dtype", [((2048, 2, 2048), torch.bfloat16),
                                         ((37, 3, 1000), torch.float32),
                                         ((5, 1, 128), torch.float16)])
def test_kernels_match_torchs_norm_in_float64(normalization, zero_centered, shape, dtype):
    generator = torch.Generator().manual_seed(2)
    norm = _randomised(TritonNorm(_config(normalization, zero_centered), shape[-1]), dtype,
                       "cuda", generator)
    x = torch.randn(shape, generator=generator).to("cuda", dtype) * 3 + 1
    grad = torch.randn(shape, generator=generator).to("cuda", dtype)
    expected = _reference(norm, x, grad)
    # torch's own kernels in the same dtype set the tolerance: ours may be at most about as
    # far from float64 as they are
    torch_norm = (torch.nn.RMSNorm(shape[-1], eps=norm.eps) if norm.rms
                  else torch.nn.LayerNorm(shape[-1], eps=norm.eps)).to("cuda", dtype)
    with torch.no_grad():
        torch_norm.weight.copy_(norm.weight + 1 if zero_centered else norm.weight)
        if norm.bias is not None:
            torch_norm.bias.copy_(norm.bias)
    baseline = _run(torch_norm, x, grad)
    for name, got, base, exact in zip(("output", "input grad", "weight grad", "bias grad"),
                                      _run(norm, x, grad), baseline, expected, strict=True):
        if exact is None:
            assert got is None
            continue
        error = (got.double() - exact).abs().max().item()
        allowed = 2 * (base.double() - exact).abs().max().item() + 1e-5 * exact.abs().max().item()
        assert error <= allowed, f"{name}: {error:.3g} > {allowed:.3g}"


@needs_gpu
def test_kernels_repeat_bitwise_and_replay_in_a_cuda_graph():
    generator = torch.Generator().manual_seed(3)
    norm = _randomised(TritonNorm(_config(), 2048), torch.bfloat16, "cuda", generator)
    x = torch.randn(512, 2, 2048, generator=generator).to("cuda", torch.bfloat16)
    grad = torch.randn(512, 2, 2048, generator=generator).to("cuda", torch.bfloat16)
    first, second = _run(norm, x, grad), _run(norm, x, grad)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)

    # a copy whose parameters are first used on the capturing stream (autograd syncs a leaf's
    # gradient with that stream)
    graphed = copy.deepcopy(norm)
    static_x = x.clone().requires_grad_()
    static_grad = grad.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        leaves = (static_x, graphed.weight, graphed.bias)
        torch.autograd.grad(graphed(static_x), leaves, static_grad)  # compiles the kernels
        with torch.cuda.graph(graph, stream=side):
            out = graphed(static_x)
            grads = torch.autograd.grad(out, leaves, static_grad)
    torch.cuda.current_stream().wait_stream(side)
    for scale in (1.0, -0.5):
        with torch.no_grad():
            static_x.copy_(x * scale)
        graph.replay()
        eager = _run(norm, x * scale, grad)
        for got, expected in zip((out, *grads), eager, strict=True):
            assert torch.equal(got, expected)
