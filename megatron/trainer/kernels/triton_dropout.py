"""Bias-dropout-add for training as one Triton kernel pair: out = residual + dropout(x + bias).

megatron-core's torch.compile'd version draws one Philox call per element and keeps a bool
mask for the backward: 36 us on an H200 for [2048, 2, 2048] bf16, where the bytes (read x and
residual, write out: 48 MB) need about 14 us. Here each Philox call yields four words, one
per element. The forward also writes the mask, a byte per element, for the backward: drawing
it again there from the seed costs more than reading it (31 against 18 us on an H200 for the
backward with the bias gradient). The backward kernel is elementwise, on the forward's grid;
the bias gradient is column_sums.column_sum of grad_x (a backward that also kept per-program
column sums in a loop over rows took 55 us).

Randomness comes from torch's current CUDA generator: the forward draws one int64 seed on
the device (`torch.randint`), so megatron's keyed reseeding (rng.py) decides the mask, a
CUDA graph replay draws a fresh seed, and activation recomputation (which restores the
generator) redraws the same one. The kernel reads the seed through a pointer; nothing waits
on the host.

Element (row, column) of x viewed as [rows, hidden] takes word `column // quarter` of the
Philox call at offset `row * quarter + column % quarter`, quarter = ceil(hidden / 4): a
program works on four [BLOCK_M, BLOCK_Q] tiles, one per word, each contiguous in memory.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add as _core_factory

from megatron.trainer.kernels import column_sums

try:  # CI and the development machines have no Triton; callers check available() first
    import triton
    import triton.language as tl
except ImportError:
    triton = None

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# a word is kept when its top 31 bits are >= p * 2^31: a signed compare, no uint32 arguments
_THRESHOLD_BITS = 31
_NUM_WARPS = 4


def available(x: torch.Tensor) -> bool:
    """Whether bias_dropout_add can run on x; megatron-core's path runs otherwise."""
    return (triton is not None and x.is_cuda and x.dtype in _DTYPES and x.is_contiguous()
            and x.dim() >= 1 and x.numel() > 0)


def bias_dropout_add(x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
                     prob: float) -> torch.Tensor:
    """residual + dropout(x + bias, prob) in training mode; bias [hidden] or None, residual
    x's shape (cast to x's dtype as megatron-core does). Output in x's dtype."""
    if not 0.0 <= prob < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {prob}")
    if residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} differs from x's "
                         f"{tuple(x.shape)}")
    if bias is not None and (bias.shape != x.shape[-1:] or bias.dtype != x.dtype):
        raise ValueError(f"bias must be [{x.shape[-1]}] in {x.dtype}, got "
                         f"{list(bias.shape)} in {bias.dtype}")
    residual = residual if residual.dtype == x.dtype else residual.to(x.dtype)
    bias = None if bias is None else bias.contiguous()
    return _BiasDropoutAdd.apply(x.contiguous(), bias, residual.contiguous(), prob)


def get_bias_dropout_add(training: bool, fused: bool) -> Callable:
    """megatron-core's factory with its signature (the layer spec's self_attn_bda/mlp_bda):
    the Triton kernels in training with 0 < p < 1 where they apply, megatron-core's function
    otherwise, and always where the fusion is off (--no-bias-dropout-fusion)."""
    core = _core_factory(training, fused)
    if not training or not fused:
        return core

    def bias_dropout_add_train(x_with_bias, residual, prob):
        x, bias = x_with_bias
        if 0 < prob < 1 and available(x) and residual.shape == x.shape and (
                bias is None or (bias.shape == x.shape[-1:] and bias.dtype == x.dtype)):
            return bias_dropout_add(x, bias, residual, prob)
        return core(x_with_bias, residual, prob)

    return bias_dropout_add_train


class _BiasDropoutAdd(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, residual, prob):
        hidden = x.shape[-1]
        rows = x.numel() // hidden
        # the seed is drawn on the device: graph replays and reseeding change it, no sync
        seed = torch.randint(0, 2**62, (1,), device=x.device, dtype=torch.int64)
        out = torch.empty_like(x)
        keep = torch.empty(x.shape, dtype=torch.int8, device=x.device)
        layout = _Layout(rows, hidden)
        _forward_kernel[layout.grid](
            x, x if bias is None else bias, residual, out, keep, seed, rows, hidden,
            layout.quarter, _threshold(prob), 1.0 / (1.0 - prob), HAS_BIAS=bias is not None,
            BLOCK_M=layout.block_m, BLOCK_Q=layout.block_q, num_warps=_NUM_WARPS)
        ctx.save_for_backward(keep)
        ctx.prob, ctx.has_bias, ctx.bias_dtype = prob, bias is not None, x.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (keep,) = ctx.saved_tensors
        needs_x, needs_bias, needs_residual = ctx.needs_input_grad[:3]
        grad_x = grad_bias = None
        if needs_x or needs_bias:
            grad = grad_out.contiguous()
            hidden = grad.shape[-1]
            rows = grad.numel() // hidden
            layout = _Layout(rows, hidden)
            grad_x = torch.empty_like(grad)
            _backward_kernel[layout.grid](
                grad, keep, grad_x, rows, hidden, layout.quarter, 1.0 / (1.0 - ctx.prob),
                BLOCK_M=layout.block_m, BLOCK_Q=layout.block_q, num_warps=_NUM_WARPS)
            if ctx.has_bias and needs_bias:
                # fp32 accumulation, deterministic, in the bias dtype
                grad_bias = column_sums.column_sum(grad_x, ctx.bias_dtype)
            if not needs_x:
                grad_x = None
        return grad_x, grad_bias, grad_out if needs_residual else None, None


def _threshold(prob: float) -> int:
    return min(round(prob * 2**_THRESHOLD_BITS), 2**_THRESHOLD_BITS - 1)


class _Layout:
    """Block sizes and grid of both kernels, from the shape only."""

    def __init__(self, rows: int, hidden: int):
        self.quarter = -(-hidden // 4)
        # 16-byte bf16 vectors per thread over contiguous columns; about 4096 elements a program
        self.block_q = min(256, triton.next_power_of_2(self.quarter))
        self.block_m = max(1, 1024 // self.block_q)
        self.grid = (-(-rows // self.block_m), -(-self.quarter // self.block_q))


if triton is not None:

    @triton.jit
    def _keep(word, threshold):
        return (word >> 1).to(tl.int32, bitcast=True) >= threshold

    @triton.jit
    def _forward_tile(x_ptr, bias_ptr, residual_ptr, out_ptr, keep_ptr, rows, hidden, row, q,
                      quarter, part: tl.constexpr, word, threshold, scale,
                      HAS_BIAS: tl.constexpr):
        column = part * quarter + q
        column_ok = (q < quarter) & (column < hidden)
        mask = (row < rows)[:, None] & column_ok[None, :]
        offsets = row[:, None] * hidden + column[None, :]
        value = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            value += tl.load(bias_ptr + column, mask=column_ok, other=0.0).to(tl.float32)[None, :]
        residual = tl.load(residual_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        keep = _keep(word, threshold)
        out = residual + tl.where(keep, value * scale, 0.0)
        tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(keep_ptr + offsets, keep.to(tl.int8), mask=mask)

    @triton.jit
    def _forward_kernel(x_ptr, bias_ptr, residual_ptr, out_ptr, keep_ptr, seed_ptr, rows, hidden,
                        quarter, threshold, scale, HAS_BIAS: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr):
        # int64 rows: offsets past 2^31 elements, and Philox counters past 2^32
        row = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        q = tl.program_id(1) * BLOCK_Q + tl.arange(0, BLOCK_Q)
        seed = tl.load(seed_ptr)
        words = tl.randint4x(seed, row[:, None] * quarter + q[None, :])
        for part in tl.static_range(4):
            _forward_tile(x_ptr, bias_ptr, residual_ptr, out_ptr, keep_ptr, rows, hidden, row, q,
                          quarter, part, words[part], threshold, scale, HAS_BIAS)

    @triton.jit
    def _backward_kernel(grad_ptr, keep_ptr, grad_x_ptr, rows, hidden, quarter, scale,
                         BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr):
        # the forward's tiles, so that a program reads what one forward program wrote
        row = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        q = tl.program_id(1) * BLOCK_Q + tl.arange(0, BLOCK_Q)
        for part in tl.static_range(4):
            column = part * quarter + q
            mask = (row < rows)[:, None] & ((q < quarter) & (column < hidden))[None, :]
            offsets = row[:, None] * hidden + column[None, :]
            grad = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            keep = tl.load(keep_ptr + offsets, mask=mask, other=0)
            grad_x = tl.where(keep != 0, grad * scale, 0.0)
            tl.store(grad_x_ptr + offsets, grad_x.to(grad_x_ptr.dtype.element_ty), mask=mask)
