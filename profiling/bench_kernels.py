"""Forward + backward time of single operations at the shapes of ../shared/GPU.md's GPT
(tokens 2 x 2048, hidden 2048, 16 heads, vocab 50304, bf16), one GPU: the candidates for
each fused step of the fast path, side by side.

    python profiling/bench_kernels.py --out /tmp/kernels.json
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron.trainer.kernels.cross_entropy import vocab_parallel_cross_entropy  # noqa: E402
from megatron.trainer.kernels.fused_layers import biased_linear  # noqa: E402
from megatron.trainer.kernels.triton_norm import TritonNorm  # noqa: E402

log = logging.getLogger("bench_kernels")
SEQ, BATCH, HIDDEN, HEADS, VOCAB = 2048, 2, 2048, 16, 50304


def milliseconds(step, repeats: int = 20) -> float:
    """Median GPU time of `step()` (forward and backward), after three warm-up calls."""
    for _ in range(3):
        step()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def attention_cases() -> dict:
    shape = (BATCH, HEADS, SEQ, HIDDEN // HEADS)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    grad = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    cases = {}
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                    SDPBackend.EFFICIENT_ATTENTION):
        for dropout in (0.1, 0.0):
            def step(backend=backend, dropout=dropout):
                with sdpa_kernel([backend]):
                    out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout,
                                                         is_causal=True)
                out.backward(grad)
            try:
                cases[f"attention {backend.name} dropout {dropout}"] = milliseconds(step)
            except RuntimeError as error:
                cases[f"attention {backend.name} dropout {dropout}"] = f"unavailable: {error}"[:200]
    return cases


def cross_entropy_cases() -> dict:
    from megatron.core import parallel_state
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy as unfused

    logits = torch.randn(SEQ, BATCH, VOCAB, device="cuda", dtype=torch.bfloat16) * 3
    logits.requires_grad_()
    labels = torch.randint(0, VOCAB, (SEQ, BATCH), device="cuda")
    group = parallel_state.get_tensor_model_parallel_group()
    candidates = {
        "cross-entropy megatron unfused": lambda: unfused(logits, labels),
        "cross-entropy megatron native fusion": lambda: fused_vocab_parallel_cross_entropy(
            logits, labels, group),
        "cross-entropy triton (project)": lambda: vocab_parallel_cross_entropy(logits, labels),
    }
    return {name: milliseconds(lambda f=f: f().sum().backward())
            for name, f in candidates.items()}


def linear_cases() -> dict:
    x = torch.randn(SEQ, BATCH, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(3 * HIDDEN, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.zeros(3 * HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(SEQ, BATCH, 3 * HIDDEN, device="cuda", dtype=torch.bfloat16)
    return {
        "qkv linear, matmul then + bias": milliseconds(
            lambda: (torch.matmul(x, w.t()) + b).backward(grad)),
        "qkv linear, bias in addmm epilogue": milliseconds(
            lambda: biased_linear(x, w, b, False).backward(grad)),
    }


def embedding_cases() -> dict:
    weight = torch.nn.Parameter(torch.randn(VOCAB, HIDDEN, device="cuda", dtype=torch.bfloat16))
    main_grad = torch.zeros(VOCAB, HIDDEN, device="cuda")
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), device="cuda")
    grad = torch.randn(BATCH, SEQ, HIDDEN, device="cuda", dtype=torch.bfloat16)

    def dense_then_add():
        F.embedding(ids, weight).backward(grad)
        main_grad.add_(weight.grad)
        weight.grad = None

    def into_main_grad():
        main_grad.index_put_((ids.reshape(-1),), grad.reshape(-1, HIDDEN).float(),
                             accumulate=True)

    return {"embedding backward, bf16 dense grad + fp32 add": milliseconds(dense_then_add),
            "embedding backward, rows into fp32 main_grad": milliseconds(into_main_grad)}


def norm_cases() -> dict:
    from megatron.core.transformer import TransformerConfig

    x = torch.randn(SEQ, BATCH, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)
    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS)
    norms = {"layer norm torch": torch.nn.LayerNorm(HIDDEN),
             "layer norm triton (project)": TritonNorm(config, HIDDEN)}
    for norm in norms.values():
        norm.to("cuda", torch.bfloat16)
    return {name: milliseconds(lambda n=norm: n(x).backward(grad))
            for name, norm in norms.items()}


CASES = {"cross-entropy": cross_entropy_cases, "linear": linear_cases,
         "embedding": embedding_cases, "norm": norm_cases, "attention": attention_cases}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", default=",".join(CASES),
                        help=f"comma-separated, of {', '.join(CASES)}")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from megatron.core import parallel_state

    torch.distributed.init_process_group("nccl", init_method="tcp://127.0.0.1:29577",
                                         rank=0, world_size=1)
    parallel_state.initialize_model_parallel()  # megatron-core's cross-entropy asks for it
    results = {}
    for group in args.cases.split(","):
        measured = CASES[group]()
        for name, value in measured.items():
            log.info("%-52s %s", name, f"{value:8.3f} ms" if isinstance(value, float) else value)
        results |= measured
        Path(args.out).write_text(json.dumps(results, indent=1))
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
