"""Host time per call of megatron-core's fused elementwise ops vs their eager versions.

megatron-core compiles bias-dropout-add and bias-GeLU with torch.compile. On the GPU that
saves device passes, but each call of a compiled function costs the host more than the
few eager ops it replaces; in a launch-bound step the host's cost is what counts. Tiny
tensors, so the time measured is the host's:

    python profiling/fusion_host_cost.py            # CPU or GPU (--device cuda)
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.fusions.fused_bias_gelu import bias_gelu_impl


def per_call_us(function, calls: int) -> float:
    """Best of five rounds, in microseconds per call (the GPU, if any, drained each round)."""
    for _ in range(20):  # warm-up, including torch.compile's first call
        function()
    rounds = []
    for _ in range(5):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            function()
        rounds.append((time.perf_counter() - start) / calls * 1e6)
    return min(rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--calls", type=int, default=1000)
    options = parser.parse_args()
    torch.set_num_threads(1)
    shape = dict(device=options.device, requires_grad=True)
    x, residual = torch.randn(16, 1, 64, **shape), torch.randn(16, 1, 64, **shape)
    bias = torch.randn(64, **shape)
    rows = []
    for fused in (False, True):
        add = get_bias_dropout_add(True, fused)

        def forward_backward(add=add):
            add((x, bias), residual, 0.1).sum().backward()

        rows.append((f"bias-dropout-add, {'compiled' if fused else 'eager'}, forward",
                     per_call_us(lambda add=add: add((x, bias), residual, 0.1), options.calls)))
        rows.append((f"bias-dropout-add, {'compiled' if fused else 'eager'}, forward+backward",
                     per_call_us(forward_backward, options.calls // 4)))
    rows.append(("bias-GeLU, compiled, forward", per_call_us(lambda: bias_gelu_impl(x, bias),
                                                              options.calls)))
    rows.append(("bias-GeLU, eager, forward",
                 per_call_us(lambda: torch.nn.functional.gelu(x + bias), options.calls)))
    sys.stdout.write("".join(f"{name:48s} {us:8.1f} us\n" for name, us in rows))


if __name__ == "__main__":
    main()
