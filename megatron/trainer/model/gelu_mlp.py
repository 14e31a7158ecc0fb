"""megatron-core's MLP (fc1, bias-GeLU, fc2) as one autograd function whose GEMMs carry the
bias-GeLU in their epilogues (gemm_epilogues.py), installed per MLP instance.

The function saves what megatron-core's three steps save (fc1's input, the pre-activation,
fc2's input) and computes the same gradients: backward, fc2's input-gradient GEMM yields the
pre-activation's gradient, whose column sums are fc1's bias gradient; both weight gradients
go through fused_layers.weight_grad, so the gradient-accumulation fusion and the zero-bubble
B/W split (dpp/weight_grad.py) treat them as they treat megatron-core's linear layers. fc2's
bias is returned unapplied, as the MLP's `skip_bias_add` does, for the bias-dropout-add.

It applies with one tensor-parallel rank, megatron-core's own ColumnParallelLinear and
RowParallelLinear (the local specs), a biased fc1 and megatron-core's fused tanh bias-GeLU;
fast_path.py decides for the run and logs why not. A call it cannot take (a per-token scale,
operands gemm_epilogues does not take) runs megatron-core's forward.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLP

from megatron.trainer.kernels import gemm_epilogues
from megatron.trainer.kernels.fused_layers import weight_grad


class _GeluMLP(torch.autograd.Function):
    """[tokens, h] -> gelu(input @ fc1^T + b1) @ fc2^T, [tokens, h]."""

    @staticmethod
    def forward(ctx, input, fc1_weight, fc1_bias, fc2_weight, into_main_grad: bool):
        hidden, pre = gemm_epilogues.linear_bias_gelu(input, fc1_weight, fc1_bias)
        ctx.save_for_backward(input, pre, hidden, fc1_weight, fc2_weight)
        ctx.into_main_grad = (into_main_grad and hasattr(fc1_weight, "main_grad")
                              and hasattr(fc2_weight, "main_grad"))
        return hidden.matmul(fc2_weight.t())

    @staticmethod
    def backward(ctx, grad_output):
        input, pre, hidden, fc1_weight, fc2_weight = ctx.saved_tensors
        grad_output = grad_output.contiguous()
        grad_pre, grad_fc1_bias = gemm_epilogues.gelu_backward_linear(grad_output, fc2_weight,
                                                                      pre)
        grad_input = grad_pre.matmul(fc1_weight)
        _, fc1_needs, fc1_bias_needs, fc2_needs, _ = ctx.needs_input_grad
        grad_fc2_weight = (weight_grad(fc2_weight, hidden, grad_output, ctx.into_main_grad)
                           if fc2_needs else None)
        grad_fc1_weight = (weight_grad(fc1_weight, input, grad_pre, ctx.into_main_grad)
                           if fc1_needs else None)
        return (grad_input, grad_fc1_weight, grad_fc1_bias if fc1_bias_needs else None,
                grad_fc2_weight, None)


def _forward(mlp: MLP, megatron_forward, hidden_states, per_token_scale=None, **kwargs):
    """MLP.forward; like megatron-core's dense MLP it ignores `kwargs` (the layer passes
    MoE's padding_mask to every MLP)."""
    fc1, fc2 = mlp.linear_fc1, mlp.linear_fc2
    input = hidden_states.reshape(-1, hidden_states.shape[-1])
    if (per_token_scale is not None
            or not gemm_epilogues.available(input, fc1.weight, fc1.bias, fc2.weight)):
        return megatron_forward(hidden_states, per_token_scale, **kwargs)
    output = _GeluMLP.apply(input, fc1.weight, fc1.bias, fc2.weight,
                            mlp.config.gradient_accumulation_fusion)
    return output.view(*hidden_states.shape[:-1], output.shape[-1]), fc2.bias


def applies_to(module: torch.nn.Module) -> bool:
    """An MLP this module's function computes exactly: megatron-core's dense MLP with its
    own linear layers, one tensor-parallel rank, fc1 biased and the fused tanh bias-GeLU."""
    if type(module) is not MLP:
        return False
    config, fc1, fc2 = module.config, module.linear_fc1, module.linear_fc2
    return (type(fc1) is ColumnParallelLinear and type(fc2) is RowParallelLinear
            and config.tensor_model_parallel_size == 1 and not config.sequence_parallel
            and config.bias_activation_fusion and not config.gated_linear_unit
            and not getattr(config, "use_te_activation_func", False)
            and module.activation_func is F.gelu
            and fc1.bias is not None and fc1.skip_bias_add and fc2.skip_bias_add
            and not fc1.is_expert and not fc2.is_expert
            and getattr(fc1, "gtp_remat_size", 1) == 1 and getattr(fc2, "gtp_remat_size", 1) == 1)


def install(model: torch.nn.Module) -> int:
    """Route every MLP of a freshly built model chunk that `applies_to` through the epilogue
    GEMMs; returns how many."""
    count = 0
    for module in model.modules():
        if applies_to(module):
            module.forward = functools.partial(_forward, module, module.forward)
            count += 1
    return count
