"""Faster stand-ins for what megatron-core falls back to when neither apex nor Transformer
Engine is installed (our GPU machines have neither).

megatron-core's fallbacks walk the parameters in Python: the grad-norm one takes each
tensor's norm and reads it back to the host (one device sync per parameter), the
scale/copy one launches two kernels per parameter, and the optimizer is torch's
multi-kernel foreach Adam. Here the norm and scale use torch's foreach kernels and, on GPU,
Adam runs as torch's single fused kernel. Results agree with the fallbacks up to
floating-point summation order (the grad norm) and Adam's fused arithmetic (last bits).

Megatron's gradient-accumulation fusion (the weight-gradient GEMM adds into the fp32
main_grad itself) needs apex's fused_weight_gradient_mlp_cuda;
`weight_grad_accumulation_fusion` installs megatron/dpp's `WeightGradAccumulation` in its
place (torch's GEMMs, on CPU too, where the B/W split of --dpp-split-backward needs the path).
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import logging
import sys
import types

import torch

from megatron.dpp import core_internals
from megatron.dpp.weight_grad_accumulation import WeightGradAccumulation
from megatron.trainer.core_compat import core_overrides

log = logging.getLogger(__name__)


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
    trainer runs; apex's or TE's kernels, when megatron-core found them, stay (logged)."""
    with contextlib.ExitStack() as stack:
        in_effect = [
            stack.enter_context(core_internals.replace_fallback(internal, replacement))
            for internal, replacement in ((core_overrides.CLIP_GRADS_L2_NORM, foreach_l2_norm),
                                          (core_overrides.CLIP_GRADS_SCALE, foreach_scale),
                                          (core_overrides.OPTIMIZER_SCALE, foreach_scale))
        ]
        log.info("grad norm: %s; grad clipping scale: %s; main-to-model copy: %s", *in_effect)
        yield


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
