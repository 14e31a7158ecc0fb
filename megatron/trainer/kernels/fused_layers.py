"""Two of megatron-core's layers, rewritten where the profile showed avoidable memory traffic
(docs/benchmarks/gpu_fusions_h200_2026-11-22.md). Both apply with one tensor-parallel rank
and no sequence parallelism; every other layout keeps megatron-core's own path.

* A column-parallel linear that adds its own bias (the fused qkv projection of the local
  GPT/BERT specs) runs `matmul` and then `output + bias`, a broadcast add that torch cannot
  vectorise (68 us per call on H200 for the [4096, 6144] qkv output). `torch.addmm` puts the
  bias into the GEMM's epilogue instead. Its backward sums the bias gradient as a product
  with a row of ones under the Triton fusions (column_sums.py: 15 against torch's 23 us).
* The word embedding's backward writes a dense [vocab, hidden] bf16 gradient every
  microbatch (memset, sort, scatter), which DDP's hook then adds into the fp32 main_grad:
  about 1 GB of traffic for 4096 tokens. With the gradient-accumulation fusion on, the
  tokens' rows are accumulated into main_grad directly (index_put_ with accumulate, which
  is deterministic), in fp32, without rounding the microbatch's gradient to bf16 first.
  That holds for a word embedding tied to the output layer of the same stage too (see
  `WordEmbeddingIntoMainGrad`).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import ColumnParallelLinear, VocabParallelEmbedding

from megatron.dpp.weight_grad_accumulation import accumulate_weight_grad
from megatron.trainer.kernels import column_sums


def _dummy_weight_grad(weight: torch.nn.Parameter, dtype: torch.dtype) -> torch.Tensor | None:
    """megatron-core's contract once a layer has added its weight gradient to main_grad: the
    parameter is flagged and autograd gets a placeholder that DDP's hook does not add, or
    zeros where the hook adds it anyway (`zero_out_wgrad`: a weight shared by two layers of
    one stage, whose other use hands DDP a real gradient)."""
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    weight.grad_added_to_main_grad = True
    if getattr(weight, "zero_out_wgrad", False):
        return torch.zeros(weight.shape, dtype=dtype, device=weight.device)
    return torch.empty(weight.shape, dtype=dtype, device=weight.device)


def weight_grad(weight, input, grad_output, into_main_grad: bool) -> torch.Tensor | None:
    """A linear layer's weight gradient from its 2-D input and output gradient: added to
    main_grad where `into_main_grad` (the gradient-accumulation fusion, which the B/W split
    may defer) with autograd's placeholder returned, else returned."""
    if into_main_grad:
        accumulate_weight_grad(input, grad_output, weight.main_grad)
        return _dummy_weight_grad(weight, input.dtype)
    return grad_output.t().matmul(input)


class _BiasInEpilogueLinear(torch.autograd.Function):
    """output = input @ weight^T + bias on 2-D input, the bias added by the GEMM."""

    @staticmethod
    def forward(ctx, input, weight, bias, accumulate_into_main_grad, gemv_bias_grad):
        ctx.save_for_backward(input, weight)
        ctx.accumulate = accumulate_into_main_grad and hasattr(weight, "main_grad")
        ctx.gemv_bias_grad = gemv_bias_grad
        return torch.addmm(bias, input, weight.t())

    @staticmethod
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        grad_input = grad_output.matmul(weight)
        if ctx.gemv_bias_grad and column_sums.available(grad_output):
            grad_bias = column_sums.column_sum(grad_output)
        else:
            grad_bias = grad_output.sum(dim=0)
        return (grad_input, weight_grad(weight, input, grad_output, ctx.accumulate), grad_bias,
                None, None)


def biased_linear(input, weight, bias, accumulate_into_main_grad: bool,
                  gemv_bias_grad: bool = False) -> torch.Tensor:
    """[..., in] -> [..., out]; the reshapes stay outside the autograd.Function so the result
    is an ordinary view that callers may modify in place (megatron-core's cross-entropy
    does, on BERT's biased output layer). gemv_bias_grad: the bias gradient as a row of
    ones times the output gradient on a GPU (column_sums.py; torch's `sum(0)` otherwise)."""
    output = _BiasInEpilogueLinear.apply(input.reshape(-1, input.shape[-1]), weight, bias,
                                         accumulate_into_main_grad, gemv_bias_grad)
    return output.view(*input.shape[:-1], weight.shape[0])


def _bias_in_epilogue(megatron_impl, gemv_bias_grad, input, weight, bias,
                      gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
                      grad_output_buffer=None, **kwargs):
    """ColumnParallelLinear._forward_impl with the bias in the GEMM where the layout allows
    (not for a weight sharded by megatron-core's generalised TP, gtp_remat_size > 1)."""
    if (bias is None or allreduce_dgrad or sequence_parallel or grad_output_buffer is not None
            or not weight.requires_grad or kwargs.get("gtp_remat_size", 1) != 1):
        return megatron_impl(input=input, weight=weight, bias=bias,
                             gradient_accumulation_fusion=gradient_accumulation_fusion,
                             allreduce_dgrad=allreduce_dgrad, sequence_parallel=sequence_parallel,
                             grad_output_buffer=grad_output_buffer, **kwargs)
    return biased_linear(input, weight, bias, gradient_accumulation_fusion, gemv_bias_grad)


class _EmbeddingIntoMainGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, token_ids, weight, tied: bool):
        ctx.save_for_backward(token_ids)
        ctx.weight, ctx.tied = weight, tied
        return F.embedding(token_ids, weight)

    @staticmethod
    def backward(ctx, grad_output):
        (token_ids,) = ctx.saved_tensors
        weight = ctx.weight
        rows = grad_output.reshape(-1, grad_output.shape[-1]).to(weight.main_grad.dtype)
        weight.main_grad.index_put_((token_ids.reshape(-1),), rows, accumulate=True)
        if ctx.tied:  # the output layer hands autograd the weight's placeholder
            return None, None, None
        return None, _dummy_weight_grad(weight, grad_output.dtype), None


class WordEmbeddingIntoMainGrad(VocabParallelEmbedding):
    """VocabParallelEmbedding whose backward accumulates into the weight's main_grad.

    Tied to the output layer of the same stage (PP=1), megatron-core has that layer hand
    DDP a zero gradient (`zero_out_wgrad`) so that DDP's hook adds the embedding's dense
    gradient to it: a [vocab, hidden] memset, a scatter and two full-size adds per
    microbatch. `tie_into_main_grad` drops that: both layers add into main_grad, the output
    layer's placeholder stays unfilled and DDP's hook, seeing the weight marked, adds
    nothing."""

    tied = False

    def accumulates(self) -> bool:
        """The layout allows the rows into main_grad (one tensor-parallel rank)."""
        return (self.tp_group.size() == 1 and not self.reduce_scatter_embeddings
                and getattr(self, "gtp_remat_size", 1) == 1)  # megatron-core >= 0.19's GTP

    def tie_into_main_grad(self) -> None:
        """Called where the output layer of this stage adds its weight gradient to main_grad
        itself (the gradient-accumulation fusion)."""
        if self.accumulates() and getattr(self.weight, "zero_out_wgrad", False):
            self.weight.zero_out_wgrad = False
            self.tied = True

    def forward(self, input_):
        if not self.accumulates() or not hasattr(self.weight, "main_grad"):
            # without main_grad there is no DDP, whose hook is all zero_out_wgrad is for
            return super().forward(input_)
        if not self.tied and getattr(self.weight, "zero_out_wgrad", False):
            return super().forward(input_)
        return _EmbeddingIntoMainGrad.apply(input_, self.weight, self.tied)


def install_fused_layers(model: torch.nn.Module, config, triton_fusions: bool) -> None:
    """Switch a freshly built model chunk's layers to the paths above (tensor-parallel size
    1, no sequence parallelism; the layers themselves fall back per call otherwise), with
    `triton_fusions` their bias gradients by column_sums.column_sum."""
    if config.tensor_model_parallel_size > 1 or config.sequence_parallel:
        return
    for module in model.modules():
        if isinstance(module, ColumnParallelLinear) and module.bias is not None:
            module._forward_impl = functools.partial(_bias_in_epilogue, module._forward_impl,
                                                     triton_fusions)
        if (config.gradient_accumulation_fusion and type(module) is VocabParallelEmbedding):
            # same state and parameters, another backward: swapping the class keeps the
            # parameter names, tying and initialisation megatron-core set up
            module.__class__ = WordEmbeddingIntoMainGrad
            # the fusion has every linear layer, the output layer among them, add its
            # weight gradient to main_grad
            module.tie_into_main_grad()
