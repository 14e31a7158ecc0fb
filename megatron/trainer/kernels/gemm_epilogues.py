"""The MLP's bias-GeLU inside its GEMMs, through cuBLASLt epilogues (csrc/gemm/).

Forward, fc1's GEMM adds the bias, applies the tanh GeLU and also writes its input (the
pre-activation) for the backward. Backward, fc2's input-gradient GEMM multiplies by the
GeLU's derivative at that pre-activation; the bias gradient is a column sum of the result
(column_sums.py). Against a GEMM followed by triton_gelu's kernels this drops, per layer and
microbatch, a read of the [tokens, ffn] pre-activation forward and a write and a read of
fc2's input gradient backward.

The GeLU is cuBLASLt's tanh approximation, the one megatron-core's bias_gelu_impl computes.
Tensors are 2-D, contiguous, of one dtype (bf16, fp16 or fp32, fp32 accumulation; fp32 has
no TF32), on one GPU; `available` says whether a call may go here. The native module exists
where the project was installed with CUDA (setup.py).
"""

from __future__ import annotations

import functools

import torch

from megatron.trainer.kernels import column_sums

_DTYPE_CODES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
# cuBLASLt's larger Hopper kernels ask for up to 32 MiB; allocated per call from torch's
# caching allocator (in a graph's pool while one records)
WORKSPACE_BYTES = 32 * 1024 * 1024
OPERAND_ALIGNMENT = 16  # bytes: cuBLASLt's vectorised loads of every operand and vector


@functools.cache
def built() -> bool:
    """Whether the native module was built (CUDA present at install)."""
    try:
        from megatron.trainer.kernels import _gemm_epilogues  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _gemm(device_index: int):
    """One cuBLASLt handle and plan cache per GPU (a process uses one)."""
    from megatron.trainer.kernels import _gemm_epilogues

    with torch.cuda.device(device_index):
        return _gemm_epilogues.EpilogueGemm()


def available(*tensors: torch.Tensor) -> bool:
    """Whether the epilogue GEMMs take these operands: contiguous CUDA tensors of one
    supported dtype on one device, aligned, with rows of whole 16-byte vectors."""
    first = tensors[0]
    return (built() and first.is_cuda and first.dtype in _DTYPE_CODES
            and all(t.device == first.device and t.dtype == first.dtype and t.is_contiguous()
                    and t.numel() > 0 and t.data_ptr() % OPERAND_ALIGNMENT == 0
                    and t.shape[-1] * t.element_size() % OPERAND_ALIGNMENT == 0
                    for t in tensors))


def _launch(method: str, dtype: torch.dtype, device: torch.device, shape, operands):
    workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    stream = torch.cuda.current_stream(device).cuda_stream
    getattr(_gemm(device.index), method)(_DTYPE_CODES[dtype], *shape,
                                         *(t.data_ptr() if isinstance(t, torch.Tensor) else t
                                           for t in operands),
                                         workspace.data_ptr(), WORKSPACE_BYTES, stream)


def linear_bias_gelu(input: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """input [M, K], weight [N, K], bias [N] -> (gelu(pre), pre) with
    pre = input @ weight^T + bias, both [M, N]."""
    rows, inner = input.shape
    features = weight.shape[0]
    if weight.shape[1] != inner or bias.shape != (features,):
        raise ValueError(f"linear_bias_gelu: input {tuple(input.shape)}, weight "
                         f"{tuple(weight.shape)} and bias {tuple(bias.shape)} do not match")
    output = input.new_empty((rows, features))
    pre = input.new_empty((rows, features))
    # column-major: D[N, M] = W^T'[N, K] x input'[K, M], W read transposed
    _launch("gelu_aux_bias", input.dtype, input.device,
            (True, False, features, rows, inner),
            (weight, inner, input, inner, output, features, bias, pre))
    return output, pre


def gelu_backward_linear(grad_output: torch.Tensor, weight: torch.Tensor,
                         pre: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward of `gelu(pre) @ weight^T` up to pre: grad_output [M, H], weight [H, N]
    (the next layer's), pre [M, N] -> (grad_pre, grad_bias) with
    grad_pre = (grad_output @ weight) * gelu'(pre) [M, N] and grad_bias its column sums [N]
    (column_sums.py: accumulated in fp32, rounded once)."""
    rows, outer = grad_output.shape
    features = weight.shape[1]
    if weight.shape[0] != outer or pre.shape != (rows, features):
        raise ValueError(f"gelu_backward_linear: grad_output {tuple(grad_output.shape)}, "
                         f"weight {tuple(weight.shape)} and pre {tuple(pre.shape)} do not match")
    grad_pre = pre.new_empty((rows, features))
    # column-major: D[N, M] = weight'[N, H] x grad_output'[H, M]
    _launch("dgelu", pre.dtype, pre.device, (False, False, features, rows, outer),
            (weight, features, grad_output, outer, grad_pre, features, pre))
    return grad_pre, column_sums.column_sum(grad_pre)
