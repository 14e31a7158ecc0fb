"""Layer norms for sequence parallelism without apex or Transformer Engine.

megatron-core's torch fallback (`WrappedTorchNorm`) refuses `sequence_parallel`: under
sequence parallelism each tensor-parallel rank normalises only its slice of the sequence,
so its norm weights get a partial gradient, and megatron-core sums those over the
tensor-parallel group only for parameters tagged `sequence_parallel = True`
(finalize_model_grads), which apex's and TE's norms set and torch's do not.
`SequenceParallelNorm` is torch's LayerNorm / RMSNorm with that tag, used by the local
layer specs under --sequence-parallel (megatron/trainer/models.py).
"""

from __future__ import annotations

import torch


class SequenceParallelNorm:
    """Builds torch.nn.LayerNorm or RMSNorm (config.normalization) with its parameters
    tagged for the tensor-parallel gradient sum; the signature of megatron-core's norms."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5,
                persist_layer_norm: bool = False, zero_centered_gamma: bool = False,
                normalization: str = "LayerNorm") -> torch.nn.Module:
        unsupported = [name for name in ("layernorm_zero_centered_gamma", "persist_layer_norm",
                                         "memory_efficient_layer_norm")
                       if getattr(config, name, False)]
        if unsupported:
            raise ValueError(f"SequenceParallelNorm (torch's norms): {', '.join(unsupported)} "
                             "need apex or Transformer Engine")
        if config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps)
        elif config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        else:
            raise ValueError(f"SequenceParallelNorm: normalization {config.normalization!r} is "
                             "not LayerNorm or RMSNorm")
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm
