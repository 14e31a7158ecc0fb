"""Faster stand-ins for what megatron-core falls back to when neither apex nor Transformer
Engine is installed (our GPU machines have neither).

megatron-core's fallbacks walk the parameters in Python: the grad-norm one takes each
tensor's norm and reads it back to the host (one device sync per parameter), the
scale/copy one launches two kernels per parameter, and the optimizer is torch's
multi-kernel foreach Adam. Here the norm and scale use torch's foreach kernels and, on GPU,
Adam runs as torch's single fused kernel. Results agree with the fallbacks up to
floating-point summation order (the grad norm) and Adam's fused arithmetic (last bits).

Megatron's gradient-accumulation fusion (the weight-gradient GEMM adds into the fp32
main_grad itself) needs apex's fused_weight_gradient_mlp_cuda; `WeightGradAccumulation`
provides its two functions with torch's GEMMs (on CPU too, where the B/W split of
--dpp-split-backward needs the path).
"""

from __future__ import annotations

import contextlib

import torch
from megatron.core import utils as core_utils
from megatron.core.optimizer import clip_grads
from megatron.core.optimizer import optimizer as core_optimizer
from megatron.core.tensor_parallel import layers as core_layers


def foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """amp_C.multi_tensor_l2norm's contract: ([1] float32 total norm, per-tensor norms)."""
    tensors = tensor_lists[0]
    norms = torch._foreach_norm(tensors)
    total = torch.linalg.vector_norm(torch.stack([n.float() for n in norms]))
    return total.reshape(1), (torch.stack(norms) if per_tensor else None)


def foreach_scale(chunk_size, noop_flag, tensor_lists, scale):
    """amp_C.multi_tensor_scale's contract: dst = src * scale (dst may be src, or of
    another dtype: the main-to-model parameter copy)."""
    sources, targets = tensor_lists[0], tensor_lists[1]
    if all(s is t for s, t in zip(sources, targets, strict=True)):
        # gradient clipping scales in place: no copy of every gradient
        torch._foreach_mul_(targets, scale)
        return
    if scale != 1.0:
        sources = torch._foreach_mul(sources, scale)
    torch._foreach_copy_(targets, sources)


@contextlib.contextmanager
def foreach_multi_tensor_ops():
    """Swap megatron-core's per-parameter fallbacks for the foreach versions while the
    trainer runs; apex's or TE's kernels, when megatron-core found them, stay."""
    replacements = [
        (clip_grads, "l2_norm_impl", core_utils.local_multi_tensor_l2_norm, foreach_l2_norm),
        (clip_grads, "multi_tensor_scale_impl", core_utils.local_multi_tensor_scale,
         foreach_scale),
        (core_optimizer, "multi_tensor_scale_impl", core_utils.local_multi_tensor_scale,
         foreach_scale),
    ]
    originals = []
    for module, name, fallback, replacement in replacements:
        current = getattr(module, name, None)
        if current is fallback:
            originals.append((module, name, current))
            setattr(module, name, replacement)
    try:
        yield
    finally:
        for module, name, current in originals:
            setattr(module, name, current)


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


@contextlib.contextmanager
def weight_grad_accumulation_fusion():
    """Let megatron-core's linear layers take their gradient_accumulation_fusion path with
    `WeightGradAccumulation` where apex is absent (apex's module, when found, stays)."""
    if core_layers._grad_accum_fusion_available:
        yield
        return
    core_layers._grad_accum_fusion_available = True
    core_layers.fused_weight_gradient_mlp_cuda = WeightGradAccumulation
    try:
        yield
    finally:
        core_layers._grad_accum_fusion_available = False
        del core_layers.fused_weight_gradient_mlp_cuda


def torch_optimizers(megatron_optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside megatron-core's (possibly chained) optimizer."""
    inner = getattr(megatron_optimizer, "chained_optimizers", [megatron_optimizer])
    return [o.optimizer for o in inner if getattr(o, "optimizer", None) is not None]


def use_fused_adam(megatron_optimizer) -> bool:
    """Switch torch Adam/AdamW param groups whose parameters all live on the GPU to the
    fused kernel. Returns whether any group was switched."""
    switched = False
    for optimizer in torch_optimizers(megatron_optimizer):
        if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        for group in optimizer.param_groups:
            if not all(p.is_cuda and p.dtype == torch.float32 for p in group["params"]):
                continue
            group["fused"], group["foreach"] = True, False
            switched = True
            # the fused kernel keeps the step count on the device (a resumed state has it
            # on the host)
            for param in group["params"]:
                state = optimizer.state.get(param, {})
                if torch.is_tensor(state.get("step")):
                    state["step"] = state["step"].to(param.device, torch.float32)
    return switched
