"""The weight-gradient GEMM that accumulates into main_grad (Megatron's gradient-accumulation
fusion) without apex: `WeightGradAccumulation` provides apex's fused_weight_gradient_mlp_cuda
functions with torch's GEMMs (on CPU too, where the B/W split of --dpp-split-backward needs
the path); `weight_grad_accumulation_fusion` installs it where megatron-core's linear layers
look for apex's module (our trainer and the DPP plugin for Megatron-LM's trainer);
`accumulate_weight_grad` calls whichever kernels megatron-core's linear layers call (apex's,
ours, or a WeightGradStore deferring them to a W task).
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import logging
import sys
import types

import torch
from megatron.core.tensor_parallel import layers as core_layers

from megatron.dpp.compat import core_internals

log = logging.getLogger(__name__)


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


@contextlib.contextmanager
def weight_grad_accumulation_fusion():
    """Let megatron-core's linear layers take their gradient_accumulation_fusion path with
    `WeightGradAccumulation` where apex is absent (apex's module, when found, stays)."""
    available, kernels = core_internals.GRAD_ACCUM_FUSION_AVAILABLE, core_internals.WGRAD_KERNELS
    if available.resolve():
        owner, name = kernels.owner_and_name()
        current = getattr(owner, name, None)
        if current is None:
            raise core_internals.CoreInternalsError(
                f"{available.target} is True but {kernels.target} is absent -- needed by "
                f"megatron/{kernels.user}")
        if current is not WeightGradAccumulation:  # else entered again inside itself
            log.info("weight-gradient accumulation: apex's %s", name)
        yield
        return
    with available.swapped(True), kernels.swapped(WeightGradAccumulation), \
            _importable_by_name(kernels.owner_and_name()[1]):
        log.info("weight-gradient accumulation: %s (ours, apex is absent)",
                 WeightGradAccumulation.__qualname__)
        yield


@contextlib.contextmanager
def _importable_by_name(name: str):
    """`WeightGradAccumulation` as apex's module `name` in sys.modules while open: megatron-
    core's drain of the deferred output-layer weight gradients (--defer-embedding-wgrad-
    compute) imports it by name instead of reading the layers module's global."""
    if name in sys.modules:
        yield
        return
    module = types.ModuleType(name, WeightGradAccumulation.__doc__)
    module.__spec__ = importlib.machinery.ModuleSpec(name, loader=None)
    module.wgrad_gemm_accum_fp32 = WeightGradAccumulation.wgrad_gemm_accum_fp32
    module.wgrad_gemm_accum_fp16 = WeightGradAccumulation.wgrad_gemm_accum_fp16
    sys.modules[name] = module
    try:
        yield
    finally:
        if sys.modules.get(name) is module:
            del sys.modules[name]
