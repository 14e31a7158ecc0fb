"""The Triton bias-dropout-add (megatron/trainer/kernels/triton_dropout.py) against torch: the kept
fraction, kept and dropped values, gradients from the forward's own mask (the backward
regenerates it from the seed), repeatability from the generator state, and CUDA graph replays
(each draws a new mask; a replay after reseeding equals the eager call).

Needs a CUDA GPU and Triton. Where Triton is installed without a GPU, running with
TRITON_INTERPRET=1 checks the kernels on CPU tensors in Triton's interpreter at a smaller
shape (the CUDA graph and dispatch tests still need the GPU)."""

from __future__ import annotations

import importlib.util
import math
import os

import pytest
import torch

from megatron.trainer.kernels import triton_dropout
from megatron.trainer.kernels.triton_dropout import bias_dropout_add, get_bias_dropout_add

_HAS_TRITON = importlib.util.find_spec("triton") is not None
_INTERPRETED = (_HAS_TRITON and not torch.cuda.is_available()
                and os.environ.get("TRITON_INTERPRET") == "1")
if _HAS_TRITON and torch.cuda.is_available():
    DEVICE, SHAPE = "cuda", (2048, 2, 2048)  # the GPT's [seq, micro-batch, hidden]
elif _INTERPRETED:
    DEVICE, SHAPE = "cpu", (64, 2, 2048)  # the interpreter runs a program at a time
else:
    DEVICE, SHAPE = None, None

pytestmark = pytest.mark.skipif(
    DEVICE is None, reason="needs Triton and a CUDA GPU (or Triton with TRITON_INTERPRET=1)"
    if _HAS_TRITON else "Triton is not installed")
needs_gpu = pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs and the dispatch to "
                               "Triton need a CUDA GPU")
P = 0.1  # the GPT's hidden dropout


def _manual_seed(seed: int) -> None:
    if DEVICE == "cuda":
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)


def _inputs(seed: int, dtype=torch.bfloat16, shape=None):
    shape = shape or SHAPE
    generator = torch.Generator().manual_seed(seed)
    x, residual = (torch.randn(shape, generator=generator) for _ in range(2))
    bias = torch.randn(shape[-1], generator=generator)
    return [t.to(DEVICE, dtype).requires_grad_() for t in (x, bias, residual)]


def _mask(seed: int, shape=None) -> torch.Tensor:
    """The mask a call after _manual_seed(seed) applies, read off a forward whose kept values
    are all 1 / (1 - p) and dropped ones 0 (the mask depends on the seed and shape only)."""
    shape = shape or SHAPE
    _manual_seed(seed)
    ones = torch.ones(shape, device=DEVICE, dtype=torch.bfloat16)
    probe = bias_dropout_add(ones, None, torch.zeros_like(ones), P)
    assert set(probe.unique().tolist()) <= {0.0, torch.tensor(1 / (1 - P)).bfloat16().item()}
    return probe != 0


def _assert_kept_fraction(keep: torch.Tensor) -> None:
    n = keep.numel()
    sigma = math.sqrt(P * (1 - P) / n)
    assert abs(keep.float().mean().item() - (1 - P)) < 4 * sigma


def test_kept_fraction_and_values():
    x, bias, residual = _inputs(0)
    keep = _mask(5)
    _assert_kept_fraction(keep)
    _manual_seed(5)
    out = bias_dropout_add(x, bias, residual, P)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    xf, bf, rf = (t.detach().float() for t in (x, bias, residual))
    expected = (rf + (xf + bf) / (1 - P)).bfloat16()
    torch.testing.assert_close(out[keep], expected[keep])  # bf16's tolerance
    assert torch.equal(out[~keep], residual.detach()[~keep])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_backward_uses_the_forward_mask(dtype):
    x, bias, residual = _inputs(1, dtype)
    keep = _mask(6)
    upstream = torch.randn(SHAPE, generator=torch.Generator().manual_seed(2)).to(DEVICE, dtype)
    _manual_seed(6)
    bias_dropout_add(x, bias, residual, P).backward(upstream)
    grad_x = torch.where(keep, upstream.double() / (1 - P), 0.0)
    tolerance = {} if dtype == torch.bfloat16 else {"rtol": 1e-6, "atol": 1e-6}
    torch.testing.assert_close(x.grad, grad_x.to(dtype), **tolerance)
    # column sums of grad_x as x received it (megatron-core's too: autograd sums the x + bias
    # gradient in its dtype), rounded once to the bias dtype
    grad_bias = x.grad.double().reshape(-1, SHAPE[-1]).sum(0)
    tolerance = {"rtol": 1.6e-2, "atol": 1e-2} if dtype == torch.bfloat16 else {
        "rtol": 1e-5, "atol": 1e-4}
    torch.testing.assert_close(bias.grad.double(), grad_bias, **tolerance)
    assert torch.equal(residual.grad, upstream)


def test_repeatable_from_the_generator_state():
    x, bias, residual = _inputs(2)
    upstream = torch.randn(SHAPE, generator=torch.Generator().manual_seed(3)).to(DEVICE,
                                                                                torch.bfloat16)
    results = []
    for seed in (7, 7, 8):
        for t in (x, bias, residual):
            t.grad = None
        _manual_seed(seed)
        out = bias_dropout_add(x, bias, residual, P)
        out.backward(upstream)
        results.append((out.detach(), x.grad, bias.grad))
    for same, other in zip(results[0], results[1], strict=True):
        assert torch.equal(same, other)  # bias gradient included: no atomics
    assert not torch.equal(results[0][0], results[2][0])


def test_without_bias_and_odd_shapes():
    """No bias (no bias gradient); an odd row count and a hidden size that is neither a
    multiple of 4 nor of the block."""
    for shape, with_bias in (((37, 1, 2048), False), ((37, 3, 1001), True)):
        x, bias, residual = _inputs(3, torch.float32, shape)
        keep = _mask(9, shape)
        _manual_seed(9)
        out = bias_dropout_add(x, bias if with_bias else None, residual, P)
        added = x.detach() + (bias.detach() if with_bias else 0)
        expected = residual.detach() + torch.where(keep, added / (1 - P), 0.0)
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
        out.sum().backward()
        torch.testing.assert_close(x.grad, torch.where(keep, 1 / (1 - P), 0.0))
        if with_bias:
            torch.testing.assert_close(bias.grad, x.grad.reshape(-1, shape[-1]).sum(0),
                                       rtol=1e-5, atol=1e-4)


def test_zero_probability_adds():
    x, bias, residual = _inputs(4)
    out = bias_dropout_add(x, bias, residual, 0.0)
    xf, bf, rf = (t.detach().float() for t in (x, bias, residual))
    torch.testing.assert_close(out, (rf + xf + bf).bfloat16())
    upstream = torch.randn_like(out)
    out.backward(upstream)
    assert torch.equal(x.grad, upstream)  # every element kept, scale 1


def test_bad_probability_is_refused():
    x, bias, residual = _inputs(4, shape=(4, 8))
    with pytest.raises(ValueError, match="dropout probability"):
        bias_dropout_add(x, bias, residual, 1.0)


@needs_gpu
def test_factory_dispatch():
    """Triton in training with p > 0 (residual cast to x's dtype, as megatron-core does);
    megatron-core's own function at p = 0."""
    x, bias, residual = _inputs(10)
    residual_fp32 = residual.detach().float().requires_grad_()
    assert triton_dropout.available(x)
    train = get_bias_dropout_add(training=True, fused=True)
    _manual_seed(11)
    out = train((x, bias), residual_fp32, P)
    _manual_seed(11)
    assert torch.equal(out, bias_dropout_add(x, bias, residual, P))
    out.sum().backward()
    assert residual_fp32.grad.dtype == torch.float32
    core = triton_dropout._core_factory(True, True)
    exact = core((x, bias), residual, 0.0)
    assert torch.equal(train((x, bias), residual, 0.0), exact)
    xf, bf, rf = (t.detach().float() for t in (x, bias, residual))
    torch.testing.assert_close(exact.float(), rf + xf + bf, rtol=1.6e-2, atol=1e-2)


@needs_gpu
def test_cuda_graph_replays():
    """Forward and backward in one graph: every replay draws a new seed, its backward uses
    its own forward's mask, and a replay after reseeding equals the eager call."""
    generator = torch.Generator().manual_seed(12)
    # positive x + bias and a zero residual: the output's nonzeros are the mask
    x = (torch.rand(SHAPE, generator=generator) + 0.5).to(DEVICE, torch.bfloat16)
    bias = torch.rand(SHAPE[-1], generator=generator).to(DEVICE, torch.bfloat16)
    residual = torch.zeros(SHAPE, device=DEVICE, dtype=torch.bfloat16)
    upstream = torch.randn(SHAPE, generator=generator).to(DEVICE, torch.bfloat16)
    for leaf in (x, bias, residual):
        leaf.requires_grad_()

    def step():
        out = bias_dropout_add(x, bias, residual, P)
        return (out, *torch.autograd.grad(out, (x, bias), upstream))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()

    masks = []
    for _ in range(2):
        graph.replay()
        out, grad_x, grad_bias = (t.clone() for t in static)
        keep = out != 0
        _assert_kept_fraction(keep)
        expected = torch.where(keep, upstream.float() / (1 - P), 0.0)
        torch.testing.assert_close(grad_x, expected.bfloat16())
        # the column sums of grad_x as x received it (see test_backward_uses_the_forward_mask)
        torch.testing.assert_close(grad_bias.float(),
                                   grad_x.float().reshape(-1, SHAPE[-1]).sum(0),
                                   rtol=1.6e-2, atol=1e-2)
        masks.append(keep)
    assert not torch.equal(masks[0], masks[1])

    _manual_seed(13)
    graph.replay()
    replayed = [t.clone() for t in static]
    _manual_seed(13)
    for eager, from_graph in zip(step(), replayed, strict=True):
        assert torch.equal(eager, from_graph)
