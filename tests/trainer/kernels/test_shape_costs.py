"""What a new microbatch shape costs the compiled fusions (docs/variable_lengths.md):
megatron-core's torch.compile'd bias-GeLU compiles the first shape, then once more with the
varying dimension dynamic, and never again for further length buckets or row counts."""

from __future__ import annotations

import torch
from torch._dynamo.utils import counters


def test_compiled_fusion_compiles_at_most_once_per_varying_dimension():
    from megatron.core.fusions.fused_bias_gelu import bias_gelu

    torch._dynamo.reset()
    counters.clear()
    bias = torch.randn(32)
    for length in (128, 256, 384, 512, 640, 768):  # six buckets of 128
        bias_gelu(bias, torch.randn(length, 2, 32))
    assert counters["stats"]["unique_graphs"] == 2
    # a token budget varies the rows as well: one row is specialised, then the rows are
    # dynamic, and further lengths and rows compile nothing
    for rows in (1, 3, 4):
        bias_gelu(bias, torch.randn(256, rows, 32))
    assert counters["stats"]["unique_graphs"] == 4
    for length, rows in ((384, 5), (896, 6), (1024, 7)):
        bias_gelu(bias, torch.randn(length, rows, 32))
    assert counters["stats"]["unique_graphs"] == 4
