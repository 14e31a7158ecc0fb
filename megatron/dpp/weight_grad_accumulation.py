"""The weight-gradient GEMM that accumulates into main_grad (Megatron's gradient-accumulation
fusion) without apex: `WeightGradAccumulation` provides apex's fused_weight_gradient_mlp_cuda
functions with torch's GEMMs (on CPU too, where the B/W split of --dpp-split-backward needs
the path); `accumulate_weight_grad` calls whichever kernels megatron-core's linear layers
call (apex's, ours, or a WeightGradStore deferring them to a W task).
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel import layers as core_layers


class WeightGradAccumulation:
    """apex's fused_weight_gradient_mlp_cuda contract: main_grad += grad_output^T @ input
    (2-D), the GEMM accumulating in place (cuBLAS beta = 1): no bf16 weight gradient is
    written, re-read and added by a second kernel, and it is not rounded to bf16 first."""

    @staticmethod
    def wgrad_gemm_accum_fp32(total_input, grad_output, main_grad):
        if total_input.dtype == torch.float32:
            main_grad.addmm_(grad_output.t(), total_input)
        elif main_grad.is_cuda:
            torch.addmm(main_grad, grad_output.t(), total_input, out_dtype=torch.float32,
                        out=main_grad)
        else:  # torch's mixed-dtype GEMM is CUDA-only: fp32 copies of the operands
            main_grad.addmm_(grad_output.t().float(), total_input.float())

    @staticmethod
    def wgrad_gemm_accum_fp16(total_input, grad_output, main_grad):
        main_grad.addmm_(grad_output.t(), total_input)


def accumulate_weight_grad(input, grad_output, main_grad) -> None:
    """main_grad += grad_output^T @ input through the kernels megatron-core's linear layers
    call (apex's, no_apex's, or a WeightGradStore deferring them to a W task)."""
    kernels = getattr(core_layers, "fused_weight_gradient_mlp_cuda", WeightGradAccumulation)
    if main_grad.dtype == torch.float32:
        kernels.wgrad_gemm_accum_fp32(input, grad_output, main_grad)
    else:
        kernels.wgrad_gemm_accum_fp16(input, grad_output, main_grad)
