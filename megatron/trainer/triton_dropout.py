"""Bias-dropout-add for training as one Triton kernel pair: out = residual + dropout(x + bias).

megatron-core's torch.compile'd version draws one Philox call per element and keeps a bool
mask for the backward: 36 us on an H200 for [2048, 2, 2048] bf16, where the bytes (read x and
residual, write out: 48 MB) need about 14 us. Here each Philox call yields four words, one
per element, and the backward regenerates the mask from the saved seed instead of reading a
mask tensor (8 MB less written and read per call, and no mask kept alive between forward and
backward); it writes grad_x and the bias gradient's per-program partial sums in one pass.

Randomness comes from torch's current CUDA generator: the forward draws one int64 seed on
the device (`torch.randint`), so megatron's keyed reseeding (rng.py) decides the mask, a
CUDA graph replay draws a fresh seed, and activation recomputation (which restores the
generator) redraws the same one. The kernels read the seed through a pointer; nothing waits
on the host.

Element (row, column) of x viewed as [rows, hidden] takes word `column // quarter` of the
Philox call at offset `row * quarter + column % quarter`, quarter = ceil(hidden / 4): a
program works on four [BLOCK_M, BLOCK_Q] tiles, one per word, each contiguous in memory.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add as _core_factory

try:  # CI and the development machines have no Triton; callers check available() first
    import triton
    import triton.language as tl
except ImportError:
    triton = None

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# a word is kept when its top 31 bits are >= p * 2^31: a signed compare, no uint32 arguments
_THRESHOLD_BITS = 31
_NUM_WARPS = 4
# backward programs per SM: more keep more bytes in flight, fewer write fewer bias partials
# (at 4, 2 MB of fp32 partials for [4096, 2048] against 32 MB of gradients)
_BACKWARD_PROGRAMS_PER_SM = 4


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
        layout = _Layout(rows, hidden, x.device)
        _forward_kernel[layout.forward_grid](
            x, x if bias is None else bias, residual, out, seed, rows, hidden, layout.quarter,
            _threshold(prob), 1.0 / (1.0 - prob), HAS_BIAS=bias is not None,
            BLOCK_M=layout.forward_block_m, BLOCK_Q=layout.block_q, num_warps=_NUM_WARPS)
        ctx.save_for_backward(seed)
        ctx.prob, ctx.has_bias, ctx.bias_dtype = prob, bias is not None, x.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (seed,) = ctx.saved_tensors
        needs_x, needs_bias, needs_residual = ctx.needs_input_grad[:3]
        grad_x = grad_bias = None
        if needs_x or needs_bias:
            grad = grad_out.contiguous()
            hidden = grad.shape[-1]
            rows = grad.numel() // hidden
            layout = _Layout(rows, hidden, grad.device)
            grad_x = torch.empty_like(grad)
            with_bias = ctx.has_bias and needs_bias
            # one fp32 row of column sums per row range; summed below without atomics
            partials = torch.empty((layout.row_programs, hidden), dtype=torch.float32,
                                   device=grad.device) if with_bias else grad_x  # unused
            _backward_kernel[layout.backward_grid](
                grad, grad_x, partials, seed, rows, hidden, layout.quarter,
                layout.rows_per_program, _threshold(ctx.prob), 1.0 / (1.0 - ctx.prob),
                HAS_BIAS=with_bias, BLOCK_M=layout.backward_block_m, BLOCK_Q=layout.block_q,
                num_warps=_NUM_WARPS)
            if with_bias:
                grad_bias = partials.sum(0).to(ctx.bias_dtype)
            if not needs_x:
                grad_x = None
        return grad_x, grad_bias, grad_out if needs_residual else None, None


def _threshold(prob: float) -> int:
    return min(round(prob * 2**_THRESHOLD_BITS), 2**_THRESHOLD_BITS - 1)


class _Layout:
    """Block sizes and grids, from the shape and the device's SM count only (the same for
    every call of a shape, so the bias gradient's summation order is too)."""

    def __init__(self, rows: int, hidden: int, device: torch.device):
        self.quarter = -(-hidden // 4)
        # 16-byte bf16 vectors per thread over contiguous columns; about 4096 elements a program
        self.block_q = min(256, triton.next_power_of_2(self.quarter))
        self.forward_block_m = max(1, 1024 // self.block_q)
        # the backward loops over its rows: twice the rows per step for more loads in flight
        self.backward_block_m = 2 * self.forward_block_m
        column_blocks = -(-self.quarter // self.block_q)
        self.forward_grid = (-(-rows // self.forward_block_m), column_blocks)
        # each backward program sums its row range's bias gradient into one partial row
        wanted = max(1, _BACKWARD_PROGRAMS_PER_SM * _sm_count(device) // column_blocks)
        per_program = -(-rows // wanted)
        step = self.backward_block_m
        self.rows_per_program = -(-per_program // step) * step
        self.row_programs = -(-rows // self.rows_per_program)
        self.backward_grid = (self.row_programs, column_blocks)


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # Triton's interpreter on CPU tensors: an H100/H200's count
    return torch.cuda.get_device_properties(device).multi_processor_count


if triton is not None:

    @triton.jit
    def _keep(word, threshold):
        return (word >> 1).to(tl.int32, bitcast=True) >= threshold

    @triton.jit
    def _forward_tile(x_ptr, bias_ptr, residual_ptr, out_ptr, rows, hidden, row, q, quarter,
                      part: tl.constexpr, word, threshold, scale, HAS_BIAS: tl.constexpr):
        column = part * quarter + q
        column_ok = (q < quarter) & (column < hidden)
        mask = (row < rows)[:, None] & column_ok[None, :]
        offsets = row[:, None] * hidden + column[None, :]
        value = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            value += tl.load(bias_ptr + column, mask=column_ok, other=0.0).to(tl.float32)[None, :]
        residual = tl.load(residual_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        out = residual + tl.where(_keep(word, threshold), value * scale, 0.0)
        tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _forward_kernel(x_ptr, bias_ptr, residual_ptr, out_ptr, seed_ptr, rows, hidden, quarter,
                        threshold, scale, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_Q: tl.constexpr):
        # int64 rows: offsets past 2^31 elements, and Philox counters past 2^32
        row = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        q = tl.program_id(1) * BLOCK_Q + tl.arange(0, BLOCK_Q)
        seed = tl.load(seed_ptr)
        words = tl.randint4x(seed, row[:, None] * quarter + q[None, :])
        for part in tl.static_range(4):
            _forward_tile(x_ptr, bias_ptr, residual_ptr, out_ptr, rows, hidden, row, q, quarter,
                          part, words[part], threshold, scale, HAS_BIAS)

    @triton.jit
    def _backward_tile(grad_ptr, grad_x_ptr, rows, hidden, row, q, quarter, part: tl.constexpr,
                       word, threshold, scale):
        """Writes one tile of grad_x and returns it in fp32 for the bias gradient."""
        column = part * quarter + q
        mask = (row < rows)[:, None] & ((q < quarter) & (column < hidden))[None, :]
        offsets = row[:, None] * hidden + column[None, :]
        grad = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        grad_x = tl.where(_keep(word, threshold), grad * scale, 0.0)
        tl.store(grad_x_ptr + offsets, grad_x.to(grad_x_ptr.dtype.element_ty), mask=mask)
        return grad_x

    @triton.jit
    def _store_sums(partials, sums, q, quarter, hidden, part: tl.constexpr):
        column = part * quarter + q
        tl.store(partials + column, tl.sum(sums, axis=0), mask=(q < quarter) & (column < hidden))

    @triton.jit
    def _backward_kernel(grad_ptr, grad_x_ptr, partials_ptr, seed_ptr, rows, hidden, quarter,
                         rows_per_program, threshold, scale, HAS_BIAS: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr):
        program = tl.program_id(0)
        q = tl.program_id(1) * BLOCK_Q + tl.arange(0, BLOCK_Q)
        seed = tl.load(seed_ptr)
        # per-thread sums, reduced across the tile's rows once at the end: a reduction over
        # rows crosses warps (shared memory and a barrier), too dear for every step
        sums0 = tl.zeros((BLOCK_M, BLOCK_Q), dtype=tl.float32)
        sums1 = tl.zeros((BLOCK_M, BLOCK_Q), dtype=tl.float32)
        sums2 = tl.zeros((BLOCK_M, BLOCK_Q), dtype=tl.float32)
        sums3 = tl.zeros((BLOCK_M, BLOCK_Q), dtype=tl.float32)
        first = program.to(tl.int64) * rows_per_program
        for start in range(0, rows_per_program, BLOCK_M):
            row = first + start + tl.arange(0, BLOCK_M)
            words = tl.randint4x(seed, row[:, None] * quarter + q[None, :])
            sums0 += _backward_tile(grad_ptr, grad_x_ptr, rows, hidden, row, q, quarter, 0,
                                    words[0], threshold, scale)
            sums1 += _backward_tile(grad_ptr, grad_x_ptr, rows, hidden, row, q, quarter, 1,
                                    words[1], threshold, scale)
            sums2 += _backward_tile(grad_ptr, grad_x_ptr, rows, hidden, row, q, quarter, 2,
                                    words[2], threshold, scale)
            sums3 += _backward_tile(grad_ptr, grad_x_ptr, rows, hidden, row, q, quarter, 3,
                                    words[3], threshold, scale)
        if HAS_BIAS:
            partials = partials_ptr + program.to(tl.int64) * hidden
            _store_sums(partials, sums0, q, quarter, hidden, 0)
            _store_sums(partials, sums1, q, quarter, hidden, 1)
            _store_sums(partials, sums2, q, quarter, hidden, 2)
            _store_sums(partials, sums3, q, quarter, hidden, 3)
