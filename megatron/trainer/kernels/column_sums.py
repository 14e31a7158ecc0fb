"""Column sums of [rows, columns] tensors: the layers' bias gradients, and the last step of
the Triton kernels that leave one row of fp32 partial sums per program (norm, bias-GeLU).

A bias gradient is the column sum of the output gradient. torch's `x.sum(0)` on the GPT's
[4096, 6144] bf16 qkv gradient took 23 us on an H200 and 12 us on a [4096, 2048] one, a
Triton loop over row blocks 18-23 and 12-20 us; cuBLAS's product of a row of ones with x, 15
and 8 us: it is the column sum here. It accumulates in fp32 and rounds once, and it is
deterministic (no atomics in a GEMM with one output row).
"""

from __future__ import annotations

import functools

import torch

# Programs over rows and columns together of a kernel that leaves partial sums: about 4 per SM
# of an H100/H200. A function of the shape only (no device query), so the summation order,
# and the bits, are the same on any GPU.
TARGET_PROGRAMS = 512
# finish(): at most this many partial rows, summed in one tile of at most FINISH_TILE elements
FINISH_MAX_COUNT, FINISH_TILE = 1024, 8192


def available(x: torch.Tensor) -> bool:
    """Whether column_sum takes the GEMM path: a non-empty floating-point CUDA tensor."""
    return x.is_cuda and x.is_floating_point() and x.dim() >= 1 and x.numel() > 0


@functools.cache
def _ones(rows: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # one per shape, kept: created in a CUDA-graph recording's warm-up (before the capture)
    return torch.ones((1, rows), dtype=dtype, device=device)


def column_sum(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """x viewed as [rows, x.shape[-1]] summed over rows, accumulated in fp32, in dtype (x's by
    default); the caller checks available(x)."""
    rows = x.reshape(-1, x.shape[-1])
    total = torch.mm(_ones(rows.shape[0], x.dtype, x.device), rows)[0]
    return total if dtype in (None, x.dtype) else total.to(dtype)


def finish(partials: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[groups, count, columns] (or [count, columns]) fp32 partial sums -> [groups, columns]
    (or [columns]) sums over count, in dtype. One Triton launch that holds a program's whole
    column block in registers (torch's sum and cast are two launches: 6.9 us on an H200 for the
    norm's [2, 264, 2048]); torch's ops where the partials are on the CPU or too many. The
    partials come from Triton kernels, so Triton is there whenever they are on a GPU."""
    count = partials.shape[-2]
    if not partials.is_cuda or count > FINISH_MAX_COUNT:
        return partials.sum(-2).to(dtype)
    stacked = partials.reshape(-1, count, partials.shape[-1]).contiguous()
    groups, _, columns = stacked.shape
    out = torch.empty((groups, columns), dtype=dtype, device=partials.device)
    block_rows = 1 << max(0, count - 1).bit_length()
    block_columns = max(1, min(128, FINISH_TILE // block_rows))
    _finish_kernel()[(-(-columns // block_columns), groups)](
        stacked, out, count, columns, BLOCK_ROWS=block_rows, BLOCK_COLUMNS=block_columns,
        num_warps=4)
    return out.view(partials.shape[:-2] + (columns,))


@functools.cache
def _finish_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def sum_rows(partials, out, count, columns, BLOCK_ROWS: tl.constexpr,
                 BLOCK_COLUMNS: tl.constexpr):
        column = tl.program_id(0) * BLOCK_COLUMNS + tl.arange(0, BLOCK_COLUMNS)
        row = tl.arange(0, BLOCK_ROWS)
        inside = (row < count)[:, None] & (column < columns)[None, :]
        base = partials + tl.program_id(1).to(tl.int64) * count * columns
        values = tl.load(base + row[:, None] * columns + column[None, :], mask=inside, other=0.0)
        tl.store(out + tl.program_id(1) * columns + column,
                 tl.sum(values, axis=0).to(out.dtype.element_ty), mask=column < columns)

    return sum_rows


def row_programs(rows: int, column_programs: int, block_rows: int) -> tuple[int, int]:
    """(programs over rows, rows per program, a multiple of block_rows) of a partial-sum kernel
    with `column_programs` column blocks, about TARGET_PROGRAMS programs in all."""
    row_blocks = -(-rows // block_rows)
    programs = max(1, min(row_blocks, TARGET_PROGRAMS // column_programs))
    per_program = -(-row_blocks // programs) * block_rows
    return -(-rows // per_program), per_program
