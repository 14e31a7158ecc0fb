"""Core attention through torch.nn.functional.scaled_dot_product_attention.

Drop-in for megatron.core's DotProductAttention (same constructor and forward), but it
runs on CPU and uses fused kernels on GPU instead of materialising the score matrix; which
ones, in which order of preference, is `--attention-backend`'s (`kernel_order`). With --apply-query-key-layer-scaling it materialises the scores, as
megatron.core does: Q K^T scaled by 1 / layer number in the inputs' dtype, then the
softmax in fp32 with the layer number multiplied back.
"""

from __future__ import annotations

import contextlib
import inspect
import math

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import divide
from torch.nn.attention import SDPBackend, sdpa_kernel

# torch < 2.6 takes a set of kernels without an order of preference
_ORDERED_CHOICE = "set_priority" in inspect.signature(sdpa_kernel).parameters

# --attention-backend -> the SDPA kernels a GPU may use, the preferred first. TE's "fused"
# backend is cuDNN's attention. "auto" puts cuDNN's first whatever torch's own order: at the
# GPT's shape on an H200 its forward+backward takes 0.52 ms against FlashAttention-2's 0.78
# (dropout 0.1; 0.38 against 0.68 without; torch 2.11 orders them so itself)
KERNEL_ORDER = {
    "auto": (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
             SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH),
    "flash": (SDPBackend.FLASH_ATTENTION,),
    "fused": (SDPBackend.CUDNN_ATTENTION,),
}


class SDPAttention(MegatronModule):
    kernel_order = KERNEL_ORDER["auto"]
    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SDPAttention does not support context parallelism")
        tp_size = (
            pg_collection.tp.size()
            if pg_collection is not None
            else tensor_parallel.get_tensor_model_parallel_world_size()
        )
        self.attn_mask_type = attn_mask_type
        self.tp_size = tp_size
        self.heads = divide(config.num_attention_heads, tp_size)
        self.query_groups = divide(config.num_query_groups, tp_size)
        head_dim = config.kv_channels
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(head_dim)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.layer_number = layer_number if config.apply_query_key_layer_scaling else None

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("SDPAttention supports neither packed sequences nor attention bias")
        mask_type = attn_mask_type or self.attn_mask_type
        # [s, b, heads, dim] -> [b, heads, s, dim]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if self.heads != self.query_groups:
            repeat = self.heads // self.query_groups
            k = k.repeat_interleave(repeat, dim=1)
            v = v.repeat_interleave(repeat, dim=1)
        causal = attention_mask is None and mask_type == AttnMaskType.causal
        # megatron masks mark positions to drop with True; SDPA's boolean mask marks positions kept
        sdpa_mask = None if attention_mask is None else ~attention_mask.bool()
        dropout_p = self.dropout_p if self.training else 0.0
        with self._dropout_rng(), self._kernels(q):
            if self.layer_number is not None:
                context = _layer_scaled_attention(q, k, v, sdpa_mask, causal, dropout_p,
                                                  self.softmax_scale, self.layer_number)
            else:
                context = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=sdpa_mask, dropout_p=dropout_p, is_causal=causal,
                    scale=self.softmax_scale,
                )
        # [b, heads, s, dim] -> [s, b, heads * dim]
        s, b = context.shape[2], context.shape[0]
        return context.permute(2, 0, 1, 3).reshape(s, b, -1)

    def _kernels(self, q: torch.Tensor):
        """On a GPU, the SDPA kernels of `kernel_order`, the first that takes the inputs; a
        single kernel that cannot is an error instead of a silent fallback."""
        if not q.is_cuda:
            return contextlib.nullcontext()
        if _ORDERED_CHOICE:
            return sdpa_kernel(list(self.kernel_order), set_priority=True)
        return sdpa_kernel(list(self.kernel_order))

    def _dropout_rng(self):
        # tensor-parallel ranks hold different heads, so their masks come from megatron's
        # model-parallel stream (under sequence parallelism the block has forked it already).
        # With one rank the default generator serves as well, and a CUDA graph (one rank
        # only, cuda_graphs.py) draws from it like the eager forward: swapping the
        # generator's state cannot be recorded
        if self.dropout_p > 0 and self.training and self.tp_size > 1 \
                and not self.config.sequence_parallel:
            return tensor_parallel.get_cuda_rng_tracker().fork()
        return contextlib.nullcontext()


def layer_scaled_scores(q, k, softmax_scale: float, layer_number: int) -> torch.Tensor:
    """Q K^T x softmax_scale / layer_number in the inputs' dtype, [b, heads, s, s]: the
    layer number keeps deep layers' fp16 scores in range."""
    return torch.matmul(q * (softmax_scale / layer_number), k.transpose(-2, -1))


def _layer_scaled_attention(q, k, v, keep_mask, causal: bool, dropout_p: float,
                            softmax_scale: float, layer_number: int) -> torch.Tensor:
    scores = layer_scaled_scores(q, k, softmax_scale, layer_number).float() * layer_number
    if causal:
        s = scores.shape[-1]
        keep_mask = torch.ones(s, s, dtype=torch.bool, device=scores.device).tril()
    if keep_mask is not None:
        scores = scores.masked_fill(~keep_mask, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    if dropout_p > 0:
        probs = F.dropout(probs, dropout_p)
    return torch.matmul(probs, v)


class MLASDPAttention(SDPAttention):
    """The core attention of megatron-core's multi-latent attention, which builds it with
    the q/k head dim (`k_channels`) and the v head dim (`v_channels`) apart and its own
    softmax scale; SDPA takes value heads of another size than the query/key heads."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ):
        # megatron-core's Attention base class first builds one without the head dims,
        # which MLA then replaces
        k_channels = config.kv_channels if k_channels is None else k_channels
        super().__init__(config, layer_number, attn_mask_type, attention_type,
                         attention_dropout=attention_dropout,
                         softmax_scale=softmax_scale or 1.0 / math.sqrt(k_channels),
                         cp_comm_type=cp_comm_type, pg_collection=pg_collection)


class FlashSDPAttention(SDPAttention):
    """`--attention-backend flash` or --use-flash-attn with the local layers."""

    kernel_order = KERNEL_ORDER["flash"]


class CudnnSDPAttention(SDPAttention):
    """`--attention-backend fused` with the local layers: cuDNN's fused attention."""

    kernel_order = KERNEL_ORDER["fused"]


class FlashMLASDPAttention(FlashSDPAttention, MLASDPAttention):
    """--use-flash-attn / `--attention-backend flash` with local MLA layers (equal q/k and v
    head dims only)."""


class CudnnMLASDPAttention(CudnnSDPAttention, MLASDPAttention):
    """`--attention-backend fused` with local MLA layers."""


SDPA_BY_BACKEND = {"auto": SDPAttention, "flash": FlashSDPAttention, "fused": CudnnSDPAttention}
MLA_SDPA_BY_BACKEND = {"auto": MLASDPAttention, "flash": FlashMLASDPAttention,
                       "fused": CudnnMLASDPAttention}
