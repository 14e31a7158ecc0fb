"""LayerNorm and RMSNorm as Triton kernels, the local layers' norms on a GPU.

Without apex or Transformer Engine the local layers use torch's layer norm: per norm and
microbatch, a forward kernel and two backward kernels, one for the input gradient and one
for the weight and bias gradients, which reads the input and the output gradient again
(on an H200 at the GPT's [4096, 2048] bf16 rows: 19 + 19 + 23 us, 48 ms per iteration of
../shared/GPU.md's GPT). Here the backward reads each row once and makes all three: every
program takes a run of rows, writes their input gradients and sums their weight and bias
contributions in fp32; a second, small reduction adds the programs' partial sums, so the
result does not depend on which program finished first (no atomics).
"""

from __future__ import annotations

import functools

import torch

from megatron.trainer.norms import torch_norm

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU machines: the module falls back to torch's norms
    triton = None

MAX_HIDDEN = 16384  # one row in registers per program
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def available(x: torch.Tensor) -> bool:
    """Whether the kernels can normalise `x` (a CUDA tensor of a supported size and dtype
    with Triton importable)."""
    return (triton is not None and x.is_cuda and x.dtype in DTYPES
            and 0 < x.shape[-1] <= MAX_HIDDEN and x.numel() > 0)


# Launch shape: rows per program step and warps, forward and backward, and backward programs
# per multiprocessor (each writes one row of partial weight and bias gradients)
FORWARD_ROWS, FORWARD_WARPS = 1, 4
BACKWARD_ROWS, BACKWARD_WARPS, BACKWARD_PROGRAMS_PER_SM = 2, 8, 2

if triton is not None:

    @triton.jit
    def _norm_forward(X, Y, W, B, MEAN, RSTD, M, N, eps, IS_RMS: tl.constexpr,
                      HAS_BIAS: tl.constexpr, ZERO_CENTERED: tl.constexpr,
                      BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK_N)
        valid = rows < M
        inside = valid[:, None] & (cols < N)[None, :]
        offsets = rows[:, None] * N + cols[None, :]
        x = tl.load(X + offsets, mask=inside, other=0.0).to(tl.float32)
        if IS_RMS:
            centred = x
        else:
            mean = tl.sum(x, axis=1) / N
            centred = tl.where(inside, x - mean[:, None], 0.0)
            tl.store(MEAN + rows, mean, mask=valid)
        rstd = tl.rsqrt(tl.sum(centred * centred, axis=1) / N + eps)
        tl.store(RSTD + rows, rstd, mask=valid)
        w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)
        if ZERO_CENTERED:
            w += 1.0
        y = centred * rstd[:, None] * w[None, :]
        if HAS_BIAS:
            y += tl.load(B + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + offsets, y.to(Y.dtype.element_ty), mask=inside)

    @triton.jit
    def _norm_backward(X, DY, DX, W, MEAN, RSTD, DW_PARTIAL, DB_PARTIAL, M, N, rows_per_program,
                       IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr,
                       ZERO_CENTERED: tl.constexpr, BLOCK_N: tl.constexpr,
                       ROWS: tl.constexpr):
        program = tl.program_id(0)
        cols = tl.arange(0, BLOCK_N)
        w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)
        if ZERO_CENTERED:
            w += 1.0
        dw = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
        db = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
        first = program.to(tl.int64) * rows_per_program
        last = tl.minimum(first + rows_per_program, M)
        for start in range(first, last, ROWS):
            rows = start + tl.arange(0, ROWS)
            valid = rows < last
            inside = valid[:, None] & (cols < N)[None, :]
            offsets = rows[:, None] * N + cols[None, :]
            x = tl.load(X + offsets, mask=inside, other=0.0).to(tl.float32)
            dy = tl.load(DY + offsets, mask=inside, other=0.0).to(tl.float32)
            rstd = tl.load(RSTD + rows, mask=valid, other=0.0)[:, None]
            if IS_RMS:
                normed = x * rstd
            else:
                mean = tl.load(MEAN + rows, mask=valid, other=0.0)[:, None]
                normed = tl.where(inside, (x - mean) * rstd, 0.0)
            scaled = dy * w[None, :]
            # d/dx of (x - mean) * rstd: the projections onto the normalised row and onto
            # the constant row (the latter only where the mean was subtracted)
            along_normed = tl.sum(normed * scaled, axis=1) / N
            dx = scaled - normed * along_normed[:, None]
            if not IS_RMS:
                dx -= (tl.sum(scaled, axis=1) / N)[:, None]
            tl.store(DX + offsets, (dx * rstd).to(DX.dtype.element_ty), mask=inside)
            dw += dy * normed
            if HAS_BIAS:
                db += dy
        tl.store(DW_PARTIAL + program * N + cols, tl.sum(dw, axis=0), mask=cols < N)
        if HAS_BIAS:
            tl.store(DB_PARTIAL + program * N + cols, tl.sum(db, axis=0), mask=cols < N)


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


class _TritonNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps: float, rms: bool, zero_centered: bool):
        hidden = x.shape[-1]
        rows = x.reshape(-1, hidden).contiguous()
        out = torch.empty_like(rows)
        count = rows.shape[0]
        rstd = torch.empty(count, dtype=torch.float32, device=x.device)
        mean = rstd if rms else torch.empty_like(rstd)
        _norm_forward[(triton.cdiv(count, FORWARD_ROWS),)](
            rows, out, weight, bias if bias is not None else weight, mean, rstd, count, hidden,
            eps, IS_RMS=rms, HAS_BIAS=bias is not None, ZERO_CENTERED=zero_centered,
            BLOCK_N=triton.next_power_of_2(hidden), ROWS=FORWARD_ROWS, num_warps=FORWARD_WARPS)
        ctx.save_for_backward(rows, weight, mean, rstd)
        ctx.flags = (rms, bias is not None, zero_centered)
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return out.view(x.shape)

    @staticmethod
    def backward(ctx, grad_out):
        rows, weight, mean, rstd = ctx.saved_tensors
        rms, has_bias, zero_centered = ctx.flags
        count, hidden = rows.shape
        grad_rows = grad_out.reshape(count, hidden).contiguous()
        grad_in = torch.empty_like(rows)
        # whole steps of BACKWARD_ROWS rows per program
        programs = BACKWARD_PROGRAMS_PER_SM * _multiprocessors(rows.device.index or 0)
        per_program = BACKWARD_ROWS * triton.cdiv(count, programs * BACKWARD_ROWS)
        programs = triton.cdiv(count, per_program)
        dw_partial = torch.empty((programs, hidden), dtype=torch.float32, device=rows.device)
        db_partial = torch.empty_like(dw_partial) if has_bias else dw_partial
        _norm_backward[(programs,)](
            rows, grad_rows, grad_in, weight, mean, rstd, dw_partial, db_partial, count, hidden,
            per_program, IS_RMS=rms, HAS_BIAS=has_bias, ZERO_CENTERED=zero_centered,
            BLOCK_N=triton.next_power_of_2(hidden), ROWS=BACKWARD_ROWS,
            num_warps=BACKWARD_WARPS)
        grad_weight = dw_partial.sum(0).to(weight.dtype)
        grad_bias = db_partial.sum(0).to(ctx.bias_dtype) if has_bias else None
        return grad_in.view(grad_out.shape), grad_weight, grad_bias, None, None, None


class TritonNorm(torch.nn.Module):
    """LayerNorm or RMSNorm (config.normalization) with megatron-core's norm signature: the
    Triton kernels on a GPU, torch's norms elsewhere. Its parameters are tagged for
    sequence parallelism as megatron-core's own norms tag theirs (norms.py says why), and
    it keeps weights as offsets from 1 under --apply-layernorm-1p."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5,
                 persist_layer_norm: bool = False, zero_centered_gamma: bool = False,
                 normalization: str = "LayerNorm"):
        super().__init__()
        if config.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"TritonNorm: normalization {config.normalization!r} is not "
                             "LayerNorm or RMSNorm")
        self.rms = config.normalization == "RMSNorm"
        self.zero_centered = bool(config.layernorm_zero_centered_gamma)
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.full((hidden_size,),
                                                    0.0 if self.zero_centered else 1.0))
        self.bias = None if self.rms else torch.nn.Parameter(torch.zeros(hidden_size))
        for param in self.parameters():
            param.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if available(x):
            return _TritonNorm.apply(x, self.weight, self.bias, self.eps, self.rms,
                                     self.zero_centered)
        return torch_norm(x, self.weight, self.bias, self.eps, self.rms, self.zero_centered)
