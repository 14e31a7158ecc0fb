"""Faster stand-ins for what megatron-core falls back to when neither apex nor Transformer
Engine is installed (our GPU machines have neither).

megatron-core's fallbacks walk the parameters in Python: the grad-norm one takes each
tensor's norm and reads it back to the host (one device sync per parameter), the
scale/copy one launches two kernels per parameter, and the optimizer is torch's
multi-kernel foreach Adam. Here the norm and scale use torch's foreach kernels and, on GPU,
Adam runs as torch's single fused kernel. Results agree with the fallbacks up to
floating-point summation order (the grad norm) and Adam's fused arithmetic (last bits).

Megatron's gradient-accumulation fusion without apex is megatron/dpp's
(megatron/dpp/weight_grad_accumulation.py), which the DPP plugin for Megatron-LM's trainer
uses as well.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from megatron.dpp.compat import core_internals
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
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            log.info("grad norm: %s; grad clipping scale: %s; main-to-model copy: %s",
                     *in_effect)
        yield


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
