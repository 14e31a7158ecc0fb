"""megatron/trainer/kernels/triton_gelu.py against megatron-core's bias_gelu_impl.

The kernel tests run on a GPU with Triton; with Triton importable and TRITON_INTERPRET=1 they
also run on CPU in Triton's interpreter (except the CUDA graph test and the full GPT shape,
too slow there). Note: the interpreter truncates fp32 -> bf16 where a GPU rounds to nearest,
so bf16 results there are up to one bf16 unit off; the tolerances allow for that.
"""

import importlib.util
import os

import pytest
import torch

from megatron.trainer.kernels.triton_gelu import available, bias_gelu

TRITON = importlib.util.find_spec("triton") is not None
INTERPRETED = TRITON and not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "1"
needs_kernels = pytest.mark.skipif(
    not (TRITON and (torch.cuda.is_available() or INTERPRETED)),
    reason="the Triton kernels need a CUDA GPU and triton (or triton with TRITON_INTERPRET=1)")

GPT_SHAPE = (2048, 2, 8192)  # [s, b, 4 * hidden] of ../shared/GPU.md's GPT
ODD_SHAPE = (37, 1, 3000)  # odd row count, columns not a multiple of the block
TOLERANCES = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3, torch.float32: 1e-4}  # rtol


def _device():
    return "cpu" if INTERPRETED else "cuda"


def _inputs(shape, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    # scale 3: the tails of GeLU (tanh saturated at both ends) are exercised too
    x = (3 * torch.randn(shape, generator=generator)).to(dtype)
    bias = torch.randn(shape[-1], generator=generator).to(dtype)
    grad_output = torch.randn(shape, generator=generator).to(dtype)
    return (t.to(_device()) for t in (x, bias, grad_output))


def _forward_backward(function, x, bias, grad_output):
    x = x.detach().requires_grad_()
    bias = bias.detach().requires_grad_()
    y = function(x, bias)
    y.backward(grad_output)
    return y.detach(), x.grad, bias.grad


@needs_kernels
@pytest.mark.parametrize("shape,dtype", [
    (GPT_SHAPE, torch.bfloat16), (ODD_SHAPE, torch.bfloat16), (ODD_SHAPE, torch.float16),
    (ODD_SHAPE, torch.float32), ((64, 2048), torch.bfloat16)])
def test_matches_megatron_core_in_float32(shape, dtype):
    if INTERPRETED and shape == GPT_SHAPE:
        pytest.skip("the full GPT shape takes minutes in Triton's interpreter")
    from megatron.core.fusions.fused_bias_gelu import bias_gelu_impl

    x, bias, grad_output = _inputs(shape, dtype)
    y, grad_x, grad_bias = _forward_backward(bias_gelu, x, bias, grad_output)
    expected = _forward_backward(bias_gelu_impl, x.float(), bias.float(), grad_output.float())
    assert (y.dtype, grad_x.dtype, grad_bias.dtype) == (dtype, dtype, dtype)
    rtol = TOLERANCES[dtype]
    torch.testing.assert_close(y.float(), expected[0], rtol=rtol, atol=1e-5)
    torch.testing.assert_close(grad_x.float(), expected[1], rtol=rtol, atol=1e-5)
    # a column sum over rows: its fp32 rounding scales with the largest sum; a row left out
    # (about 1 in a column) is still far outside this
    torch.testing.assert_close(grad_bias.float(), expected[2], rtol=rtol,
                               atol=2 ** -10 * expected[2].abs().max().item())


@needs_kernels
def test_bias_gradient_only_when_needed():
    x, bias, grad_output = _inputs(ODD_SHAPE, torch.bfloat16)
    x.requires_grad_()
    bias_gelu(x, bias).backward(grad_output)
    expected = _forward_backward(bias_gelu, x, bias, grad_output)
    assert bias.grad is None
    assert torch.equal(x.grad, expected[1])


@needs_kernels
def test_bitwise_repeatable():
    shape = (64, 2, 8192) if INTERPRETED else GPT_SHAPE
    x, bias, grad_output = _inputs(shape, torch.bfloat16)
    first = _forward_backward(bias_gelu, x, bias, grad_output)
    second = _forward_backward(bias_gelu, x, bias, grad_output)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


@pytest.mark.skipif(not (TRITON and torch.cuda.is_available()),
                    reason="CUDA graphs need a CUDA GPU (and the kernels triton)")
def test_cuda_graph_replay_equals_eager():
    x, bias, grad_output = _inputs(GPT_SHAPE, torch.bfloat16)
    x.requires_grad_()
    bias.requires_grad_()
    # warm-up on a side stream compiles the kernels before capture (torch.cuda.graphs' recipe)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.autograd.grad(bias_gelu(x, bias), (x, bias), grad_output)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed_y = bias_gelu(x, bias)
        graphed_grads = torch.autograd.grad(graphed_y, (x, bias), grad_output)
    # new values in the static inputs: the replay must compute from them
    new_x, new_bias, new_grad_output = _inputs(GPT_SHAPE, torch.bfloat16, seed=1)
    with torch.no_grad():
        x.copy_(new_x)
        bias.copy_(new_bias)
        grad_output.copy_(new_grad_output)
    graph.replay()
    eager_y = bias_gelu(x, bias)
    eager_grads = torch.autograd.grad(eager_y, (x, bias), grad_output)
    torch.cuda.synchronize()
    assert torch.equal(graphed_y, eager_y)
    for graphed, eager in zip(graphed_grads, eager_grads, strict=True):
        assert torch.equal(graphed, eager)


def test_available_only_where_the_kernels_run():
    assert not available(torch.zeros(4, 8))  # CPU: megatron-core's path
    if torch.cuda.is_available():
        on_gpu = torch.zeros(4, 8, device="cuda", dtype=torch.bfloat16)
        assert available(on_gpu) == TRITON
        assert not available(on_gpu.t())  # not contiguous
        assert not available(on_gpu.double())


def test_mismatched_bias_is_named():
    with pytest.raises(ValueError, match="bias of shape"):
        bias_gelu(torch.zeros(4, 8), torch.zeros(7))
