"""LayerNorm and RMSNorm as Triton kernels, the local layers' norms on a GPU.

Without apex or Transformer Engine the local layers use torch's layer norm: per norm and
microbatch, a forward kernel and two backward kernels, one for the input gradient and one
for the weight and bias gradients, which reads the input and the output gradient again
(on an H200 at the GPT's [4096, 2048] bf16 rows: 19 + 19 + 23 us, 48 ms per iteration of
../shared/GPU.md's GPT). Here the backward reads each row once and makes all three: every
program takes a run of rows, writes their input gradients and sums their weight and bias
contributions in fp32; a small second kernel (column_sums.finish) adds the programs' partial
sums, so the result does not depend on which program finished first (no atomics). The loop
over a program's rows is software-pipelined (loads of the next row steps in flight): 28 us
in all with the residual's gradient added (TritonResidualNorm) and torch's finishing, against
33 us unpipelined and about 55 us for torch's two kernels plus autograd's separate add.
"""

from __future__ import annotations

import functools

import torch

from megatron.trainer.kernels import column_sums
from megatron.trainer.kernels.norms import torch_norm

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


# Launch shape: rows per program step and warps, forward and backward, backward programs per
# multiprocessor (each writes one row of partial weight and bias gradients) and the depth of
# the backward's software pipeline over row steps
FORWARD_ROWS, FORWARD_WARPS = 1, 4
BACKWARD_ROWS, BACKWARD_WARPS, BACKWARD_PROGRAMS_PER_SM, BACKWARD_STAGES = 2, 8, 1, 3

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
    def _norm_backward(X, DY, DRESIDUAL, DX, W, MEAN, RSTD, PARTIALS, M, N, rows_per_program,
                       IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr,
                       ZERO_CENTERED: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                       BLOCK_N: tl.constexpr, ROWS: tl.constexpr, STAGES: tl.constexpr):
        program = tl.program_id(0)
        cols = tl.arange(0, BLOCK_N)
        w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)
        if ZERO_CENTERED:
            w += 1.0
        dw = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
        db = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
        first = program.to(tl.int64) * rows_per_program
        last = tl.minimum(first + rows_per_program, M)
        # STAGES: the loads of the next steps are issued while this one computes
        for start in tl.range(first, last, ROWS, num_stages=STAGES):
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
            dx *= rstd
            if HAS_RESIDUAL:
                dx += tl.load(DRESIDUAL + offsets, mask=inside, other=0.0).to(tl.float32)
            tl.store(DX + offsets, dx.to(DX.dtype.element_ty), mask=inside)
            dw += dy * normed
            if HAS_BIAS:
                db += dy
        # PARTIALS[0, program] and, with a bias, PARTIALS[1, program]
        tl.store(PARTIALS + program * N + cols, tl.sum(dw, axis=0), mask=cols < N)
        if HAS_BIAS:
            tl.store(PARTIALS + (tl.num_programs(0) + program) * N + cols, tl.sum(db, axis=0),
                     mask=cols < N)


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


class _TritonNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps: float, rms: bool, zero_centered: bool,
                with_residual: bool):
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
        ctx.set_materialize_grads(False)  # an unused residual passes no zeros to add
        if with_residual:
            return out.view(x.shape), x.view_as(x)
        return out.view(x.shape)

    @staticmethod
    def backward(ctx, grad_out, grad_residual=None):
        rows, weight, mean, rstd = ctx.saved_tensors
        rms, has_bias, zero_centered = ctx.flags
        if grad_out is None:  # only the residual was used
            return grad_residual, None, None, None, None, None, None
        count, hidden = rows.shape
        grad_rows = grad_out.reshape(count, hidden).contiguous()
        grad_in = torch.empty_like(rows)
        # whole steps of BACKWARD_ROWS rows per program
        programs = BACKWARD_PROGRAMS_PER_SM * _multiprocessors(rows.device.index or 0)
        per_program = BACKWARD_ROWS * triton.cdiv(count, programs * BACKWARD_ROWS)
        programs = triton.cdiv(count, per_program)
        partials = torch.empty((2 if has_bias else 1, programs, hidden), dtype=torch.float32,
                               device=rows.device)
        residual_rows = (grad_rows if grad_residual is None
                         else grad_residual.reshape(count, hidden).contiguous())
        _norm_backward[(programs,)](
            rows, grad_rows, residual_rows, grad_in, weight, mean, rstd, partials, count,
            hidden, per_program, IS_RMS=rms, HAS_BIAS=has_bias, ZERO_CENTERED=zero_centered,
            HAS_RESIDUAL=grad_residual is not None, BLOCK_N=triton.next_power_of_2(hidden),
            ROWS=BACKWARD_ROWS, STAGES=BACKWARD_STAGES, num_warps=BACKWARD_WARPS)
        sums = column_sums.finish(partials, weight.dtype)
        grad_bias = sums[1].to(ctx.bias_dtype) if has_bias else None
        return grad_in.view(grad_out.shape), sums[0], grad_bias, None, None, None, None


class TritonNorm(torch.nn.Module):
    """LayerNorm or RMSNorm (config.normalization) with megatron-core's norm signature: the
    Triton kernels on a GPU, torch's norms elsewhere. Its parameters are tagged for
    sequence parallelism as megatron-core's own norms tag theirs (norms.py says why), and
    it keeps weights as offsets from 1 under --apply-layernorm-1p."""

    returns_residual = False  # see TritonResidualNorm

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

    def forward(self, x: torch.Tensor):
        if available(x):
            return _TritonNorm.apply(x, self.weight, self.bias, self.eps, self.rms,
                                     self.zero_centered, self.returns_residual)
        out = torch_norm(x, self.weight, self.bias, self.eps, self.rms, self.zero_centered)
        return (out, x) if self.returns_residual else out


class TritonResidualNorm(TritonNorm):
    """TritonNorm for a layer's input and pre-MLP norms: returns (output, residual), the
    residual being its input, which megatron-core >= 0.18's TransformerLayer then adds back
    after attention or the MLP. Both gradients come back to this norm's backward, which adds
    the residual's into the input gradient as it writes it; otherwise autograd adds the two
    branches' gradients with a separate kernel (read 32 MB, write 16 MB per norm and
    microbatch on the GPT of ../shared/GPU.md)."""

    returns_residual = True
