"""`--cross-entropy-fusion-impl triton`: vocab-parallel cross-entropy in two passes over the
logits, one forward and one backward.

megatron-core's native fusion materialises fp32 copies of the [tokens, vocab] logits and
reads them five times per microbatch (78 ms per iteration of 32 microbatches on the GPT of
../shared/GPU.md, docs/benchmarks/gpu_fusions_h200_2026-11-22.md). Here the forward reads
the bf16 logits once, keeping a running maximum and sum of exponentials per token (online
softmax), and the backward reads them once more and writes the gradient
softmax - one_hot(label), scaled by the loss gradient, in the logits' dtype.

With tensor parallelism each rank holds a vocabulary slice: the per-token maxima, rescaled
sums and label logits are combined with three all-reduces over the tensor-parallel group,
as megatron-core does. On GPU with Triton the two passes are Triton kernels; elsewhere the
same computation runs in torch ops (the CPU tests check it against megatron-core's
unfused vocab_parallel_cross_entropy).
"""

from __future__ import annotations

import functools
import importlib.util

import torch
import torch.distributed as dist

BLOCK = 4096  # vocabulary entries per Triton program step


def triton_available() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("triton") is not None


@functools.cache
def _kernels():
    """The Triton kernels, compiled on first use (importing triton needs a GPU build)."""
    import triton
    import triton.language as tl

    @triton.jit
    def row_statistics(logits, labels, row_max, row_sum, label_logit, row_stride, vocab,
                       vocab_start, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = logits + row * row_stride
        offsets = tl.arange(0, BLOCK)
        # 0-d fp32 tensors, so the loop-carried values keep one type
        running_max = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), axis=0)
        running_sum = tl.sum(tl.zeros([BLOCK], tl.float32), axis=0)
        for start in range(0, vocab, BLOCK):
            columns = start + offsets
            x = tl.load(base + columns, mask=columns < vocab, other=float("-inf"))
            x = x.to(tl.float32)
            new_max = tl.maximum(running_max, tl.max(x, axis=0))
            running_sum = (running_sum * tl.exp(running_max - new_max)
                           + tl.sum(tl.exp(x - new_max), axis=0))
            running_max = new_max
        local = tl.load(labels + row) - vocab_start
        here = (local >= 0) & (local < vocab)
        picked = tl.load(base + local, mask=here, other=0.0).to(tl.float32)
        tl.store(row_max + row, running_max)
        tl.store(row_sum + row, running_sum)
        tl.store(label_logit + row, tl.where(here, picked, 0.0))

    @triton.jit
    def logits_gradient(logits, labels, logsumexp, loss_grad, grad, row_stride, vocab,
                        vocab_start, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = columns < vocab
        x = tl.load(logits + row * row_stride + columns, mask=inside, other=0.0)
        probability = tl.exp(x.to(tl.float32) - tl.load(logsumexp + row))
        local = tl.load(labels + row) - vocab_start
        probability = tl.where(columns == local, probability - 1.0, probability)
        value = probability * tl.load(loss_grad + row)
        tl.store(grad + row * vocab + columns, value.to(grad.dtype.element_ty), mask=inside)

    return row_statistics, logits_gradient


class _TritonPasses:
    """The two passes as Triton kernels ([tokens, vocab] logits, last dimension contiguous)."""

    def __init__(self):
        self.row_statistics, self.logits_gradient = _kernels()

    def statistics(self, logits, labels, vocab_start):
        rows, vocab = logits.shape
        row_max, row_sum, label_logit = (
            torch.empty(rows, dtype=torch.float32, device=logits.device) for _ in range(3))
        self.row_statistics[(rows,)](logits, labels, row_max, row_sum, label_logit,
                                     logits.stride(0), vocab, vocab_start, BLOCK=BLOCK,
                                     num_warps=16)
        return row_max, row_sum, label_logit

    def gradient(self, logits, labels, logsumexp, loss_grad, vocab_start):
        rows, vocab = logits.shape
        grad = torch.empty((rows, vocab), dtype=logits.dtype, device=logits.device)
        self.logits_gradient[(rows, -(-vocab // BLOCK))](
            logits, labels, logsumexp, loss_grad, grad, logits.stride(0), vocab, vocab_start,
            BLOCK=BLOCK, num_warps=8)
        return grad


class _TorchPasses:
    """The same two passes in torch ops (CPU, or a GPU without Triton)."""

    @staticmethod
    def _local_labels(labels, vocab, vocab_start):
        local = labels - vocab_start
        here = (local >= 0) & (local < vocab)
        return local.clamp(0, vocab - 1), here

    def statistics(self, logits, labels, vocab_start):
        x = logits.float()
        row_max = x.max(dim=-1).values
        row_sum = torch.exp(x - row_max[:, None]).sum(dim=-1)
        local, here = self._local_labels(labels, x.shape[1], vocab_start)
        label_logit = torch.where(here, x.gather(1, local[:, None])[:, 0], 0.0)
        return row_max, row_sum, label_logit

    def gradient(self, logits, labels, logsumexp, loss_grad, vocab_start):
        probability = torch.exp(logits.float() - logsumexp[:, None])
        local, here = self._local_labels(labels, logits.shape[1], vocab_start)
        probability.scatter_add_(1, local[:, None], -here.to(probability.dtype)[:, None])
        return (probability * loss_grad[:, None]).to(logits.dtype)


class VocabParallelCrossEntropy(torch.autograd.Function):
    """loss[t] = logsumexp(logits[t, :]) - logits[t, label[t]] over the whole vocabulary,
    each tensor-parallel rank holding columns [vocab_start, vocab_start + local vocab)."""

    @staticmethod
    def forward(ctx, logits, labels, group, passes):
        shape = labels.shape
        logits = logits.reshape(-1, logits.shape[-1])
        if logits.stride(-1) != 1:
            logits = logits.contiguous()
        labels = labels.reshape(-1).contiguous()
        tp_size = dist.get_world_size(group) if group is not None else 1
        vocab_start = (dist.get_rank(group) if tp_size > 1 else 0) * logits.shape[1]
        row_max, row_sum, label_logit = passes.statistics(logits, labels, vocab_start)
        if tp_size > 1:
            global_max = row_max.clone()
            dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
            row_sum = row_sum * torch.exp(row_max - global_max)
            dist.all_reduce(row_sum, group=group)
            dist.all_reduce(label_logit, group=group)
            row_max = global_max
        logsumexp = row_max + torch.log(row_sum)
        ctx.save_for_backward(logits, labels, logsumexp)
        ctx.passes, ctx.vocab_start = passes, vocab_start
        return (logsumexp - label_logit).view(shape)

    @staticmethod
    def backward(ctx, loss_grad):
        logits, labels, logsumexp = ctx.saved_tensors
        grad = ctx.passes.gradient(logits, labels, logsumexp,
                                   loss_grad.reshape(-1).float().contiguous(), ctx.vocab_start)
        return grad.view(*loss_grad.shape, -1), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor,
                                 group=None) -> torch.Tensor:
    """Per-token loss (fp32, labels' shape) of `logits` [..., local vocab]; the gradient
    returned to the logits has their dtype."""
    passes = _TritonPasses() if logits.is_cuda and triton_available() else _TorchPasses()
    return VocabParallelCrossEntropy.apply(logits, labels, group, passes)
