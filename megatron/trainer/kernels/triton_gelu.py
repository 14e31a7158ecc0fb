"""Bias-GeLU (tanh approximation) as one Triton kernel per direction, with the bias gradient
reduced inside the backward kernel.

megatron-core's bias_gelu_impl returns the same [s, b, f] tensor as the gradient of the input
and of the bias, so autograd launches a second kernel that re-reads it (64 MB per call on the
GPT of ../shared/GPU.md) to sum it over rows. Here the backward reads grad_output and the input
once, writes grad_input once, and each program also keeps fp32 column sums over its own rows;
those partials ([programs over rows, f] fp32, 2 MB) are summed by column_sums.finish. No
atomics: the bias gradient is bitwise repeatable.

The math matches megatron-core's fused_bias_gelu.py (fp32 inside, the same constants and
derivative formula); outputs are stored in the input's dtype. Callers check `available(input)`
and fall back to megatron-core's bias_gelu_impl otherwise (CPU, no Triton, other dtypes).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util

import torch
from megatron.core.fusions.fused_bias_gelu import bias_gelu_impl as core_bias_gelu

from megatron.trainer.core_compat import core_overrides
from megatron.trainer.kernels import column_sums

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BLOCK_ROWS = 4  # rows of a forward program's tile and of a backward program's loop step
MAX_BLOCK_COLUMNS = 1024  # columns per program: 8 warps, 16 elements per thread and step
NUM_WARPS = 8


@functools.cache
def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def available(input: torch.Tensor) -> bool:
    """Whether bias_gelu runs on `input`: a contiguous, non-empty CUDA tensor of a supported
    dtype, and Triton importable."""
    return (input.is_cuda and input.dtype in SUPPORTED_DTYPES and input.dim() >= 1
            and input.numel() > 0 and input.is_contiguous() and _triton_importable())


@functools.cache
def _kernels():
    """The two kernels, compiled on first use (triton is imported only here)."""
    import triton
    import triton.language as tl

    @triton.jit
    def gelu_forward(input, bias, output, rows, columns, BLOCK_ROWS: tl.constexpr,
                     BLOCK_COLUMNS: tl.constexpr):
        # one tile per program: no reduction here, so many small programs keep more loads in
        # flight per SM than a few looping ones would
        row = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        column = tl.program_id(1) * BLOCK_COLUMNS + tl.arange(0, BLOCK_COLUMNS)
        inside = (row < rows)[:, None] & (column < columns)[None, :]
        b = tl.load(bias + column, mask=column < columns, other=0.0).to(tl.float32)
        # int64 offsets: rows * columns may pass 2**31 for long sequences
        offset = row.to(tl.int64)[:, None] * columns + column[None, :]
        x = tl.load(input + offset, mask=inside, other=0.0).to(tl.float32) + b[None, :]
        inner = 0.79788456 * x * (1.0 + 0.044715 * x * x)
        # tanh(u) = 1 - 2 / (exp(2u) + 1): exact at both ends (exp overflows to inf -> 1)
        tanh_inner = 1.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0)
        y = x * 0.5 * (1.0 + tanh_inner)
        tl.store(output + offset, y.to(output.dtype.element_ty), mask=inside)

    @triton.jit
    def gelu_backward(grad_output, input, bias, grad_input, bias_partials, rows, columns,
                      rows_per_program, BLOCK_ROWS: tl.constexpr, BLOCK_COLUMNS: tl.constexpr,
                      BIAS_GRAD: tl.constexpr):
        column = tl.program_id(1) * BLOCK_COLUMNS + tl.arange(0, BLOCK_COLUMNS)
        column_inside = column < columns
        b = tl.load(bias + column, mask=column_inside, other=0.0).to(tl.float32)
        first_row = tl.program_id(0) * rows_per_program
        last_row = tl.minimum(first_row + rows_per_program, rows)
        # summed over rows once at the end rather than every step: fewer cross-thread reductions
        column_sum = tl.zeros([BLOCK_ROWS, BLOCK_COLUMNS], tl.float32)
        for start in range(first_row, last_row, BLOCK_ROWS):
            row = start + tl.arange(0, BLOCK_ROWS)
            inside = (row < last_row)[:, None] & column_inside[None, :]
            offset = row.to(tl.int64)[:, None] * columns + column[None, :]
            x = tl.load(input + offset, mask=inside, other=0.0).to(tl.float32) + b[None, :]
            g = tl.load(grad_output + offset, mask=inside, other=0.0).to(tl.float32)
            inner = 0.79788456 * x * (1.0 + 0.044715 * x * x)
            tanh_inner = 1.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0)
            # d/dx of x/2 (1 + tanh(inner)); 0.1070322243 = 3 * 0.044715 * 0.79788456
            slope = (0.5 * x * ((1.0 - tanh_inner * tanh_inner)
                                * (0.79788456 + 0.1070322243 * x * x))
                     + 0.5 * (1.0 + tanh_inner))
            dx = slope * g  # masked lanes: g = 0, so they add nothing below
            tl.store(grad_input + offset, dx.to(grad_input.dtype.element_ty), mask=inside)
            if BIAS_GRAD:
                column_sum += dx
        if BIAS_GRAD:
            tl.store(bias_partials + tl.program_id(0) * columns + column,
                     tl.sum(column_sum, axis=0), mask=column_inside)

    return gelu_forward, gelu_backward


def _block_columns(columns: int) -> int:
    return min(MAX_BLOCK_COLUMNS, 1 << max(0, columns - 1).bit_length())


def _backward_launch(rows: int, columns: int) -> tuple[int, int, int]:
    """(programs over rows, programs over columns, rows per program) of the backward for a
    [rows, columns] input: about column_sums.TARGET_PROGRAMS, each a column block over a
    run of rows."""
    column_programs = -(-columns // _block_columns(columns))
    row_programs, rows_per_program = column_sums.row_programs(rows, column_programs, BLOCK_ROWS)
    return row_programs, column_programs, rows_per_program


class BiasGeLU(torch.autograd.Function):
    """y = gelu_tanh(input + bias) over the last dimension; gradients for both."""

    @staticmethod
    def forward(ctx, input: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        if bias.shape != input.shape[-1:]:
            raise ValueError(f"bias_gelu: bias of shape {tuple(bias.shape)} does not match "
                             f"the input's last dimension {input.shape[-1]}")
        if not input.is_contiguous():
            raise ValueError("bias_gelu: the input must be contiguous (check available(input) "
                             "and use megatron-core's bias_gelu_impl otherwise)")
        bias = bias.contiguous()
        columns = input.shape[-1]
        rows = input.numel() // columns
        block_columns = _block_columns(columns)
        output = torch.empty_like(input)
        gelu_forward, _ = _kernels()
        gelu_forward[(-(-rows // BLOCK_ROWS), -(-columns // block_columns))](
            input, bias, output, rows, columns, BLOCK_ROWS=BLOCK_ROWS,
            BLOCK_COLUMNS=block_columns, num_warps=NUM_WARPS)
        ctx.save_for_backward(input, bias)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        input, bias = ctx.saved_tensors
        grad_output = grad_output.contiguous()
        columns = input.shape[-1]
        rows = input.numel() // columns
        row_programs, column_programs, rows_per_program = _backward_launch(rows, columns)
        bias_grad_needed = ctx.needs_input_grad[1]
        grad_input = torch.empty_like(input)
        # one row of fp32 column sums per program over rows; each entry written exactly once
        partials = torch.empty((row_programs if bias_grad_needed else 1, columns),
                               dtype=torch.float32, device=input.device)
        _, gelu_backward = _kernels()
        gelu_backward[(row_programs, column_programs)](
            grad_output, input, bias, grad_input, partials, rows, columns, rows_per_program,
            BLOCK_ROWS=BLOCK_ROWS, BLOCK_COLUMNS=_block_columns(columns),
            BIAS_GRAD=bias_grad_needed, num_warps=NUM_WARPS)
        bias_grad = column_sums.finish(partials, bias.dtype) if bias_grad_needed else None
        return grad_input, bias_grad


def bias_gelu(input: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Drop-in for megatron-core's bias_gelu_impl(input, bias) where available(input)."""
    return BiasGeLU.apply(input, bias)


def _bias_gelu_where_available(input: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    if available(input) and bias.shape == input.shape[-1:]:
        return BiasGeLU.apply(input, bias)
    return core_bias_gelu(input, bias)


@contextlib.contextmanager
def installed():
    """megatron-core's MLP calls this module's bias-GeLU while open (where available)."""
    with core_overrides.MLP_BIAS_GELU.swapped(_bias_gelu_where_available):
        yield
