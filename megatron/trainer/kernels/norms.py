"""Layer norms for sequence parallelism without apex or Transformer Engine.

megatron-core's torch fallback (`WrappedTorchNorm`) refuses `sequence_parallel`: under
sequence parallelism each tensor-parallel rank normalises only its slice of the sequence,
so its norm weights get a partial gradient, and megatron-core sums those over the
tensor-parallel group only for parameters tagged `sequence_parallel = True`
(finalize_model_grads), which apex's and TE's norms set and torch's do not.
`SequenceParallelNorm` is torch's LayerNorm / RMSNorm with that tag, used by the local
layer specs under --sequence-parallel (megatron/trainer/model/models.py). It also keeps the
weights as offsets from 1 (--apply-layernorm-1p, config.layernorm_zero_centered_gamma),
which torch's norms cannot.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class ZeroCenteredNorm(torch.nn.Module):
    """LayerNorm / RMSNorm whose weight w scales by (1 + w): the weights start at 0 and a
    low-precision copy represents small changes around 1 exactly."""

    def __init__(self, hidden_size: int, eps: float, rms: bool):
        super().__init__()
        self.shape, self.eps, self.rms = (hidden_size,), eps, rms
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size))
        self.bias = None if rms else torch.nn.Parameter(torch.zeros(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch_norm(x, self.weight, self.bias, self.eps, self.rms, zero_centered=True)


def torch_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
               rms: bool, zero_centered: bool) -> torch.Tensor:
    """torch's LayerNorm / RMSNorm over the last dimension, scaling by (1 + weight) where the
    weight is kept as an offset from 1."""
    scale = weight + 1 if zero_centered else weight
    if rms:
        return F.rms_norm(x, x.shape[-1:], scale, eps)
    return F.layer_norm(x, x.shape[-1:], scale, bias, eps)


class SequenceParallelNorm:
    """Builds torch.nn.LayerNorm or RMSNorm (config.normalization) with its parameters
    tagged for the tensor-parallel gradient sum; the signature of megatron-core's norms."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5,
                persist_layer_norm: bool = False, zero_centered_gamma: bool = False,
                normalization: str = "LayerNorm") -> torch.nn.Module:
        unsupported = [name for name in ("persist_layer_norm", "memory_efficient_layer_norm")
                       if getattr(config, name, False)]
        if unsupported:
            raise ValueError(f"SequenceParallelNorm (torch's norms): {', '.join(unsupported)} "
                             "need apex or Transformer Engine")
        if config.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"SequenceParallelNorm: normalization {config.normalization!r} is "
                             "not LayerNorm or RMSNorm")
        rms = config.normalization == "RMSNorm"
        if config.layernorm_zero_centered_gamma:
            norm = ZeroCenteredNorm(hidden_size, eps, rms)
        elif rms:
            norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        else:
            norm = torch.nn.LayerNorm(hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm
