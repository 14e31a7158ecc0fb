"""What keeping the weight-gradient sums in B order costs a W task on CPU: the W of one GPT
layer of profiling/bench_two_pods.py's model (hidden 128, MLP 512, 2 x 128 tokens), its four
GEMMs accumulating into main_grad in place (the W tasks in microbatch order) against each
into a buffer of its own, added in B order (`WeightGradStore(any_weight_order=True)`, what
the DPP rule runs on CPU to order the W tasks by their B times). One thread, as each rank.

    python profiling/bench_weight_sums.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron.dpp.weight_grad import WeightGradStore  # noqa: E402
from megatron.dpp.weight_grad_accumulation import weight_grad_accumulation_fusion  # noqa: E402
from megatron.trainer.kernels.fused_layers import biased_linear  # noqa: E402

# (output, input) of the layer's linears: qkv, attention projection, fc1, fc2
LAYER = ((384, 128), (128, 128), (512, 128), (128, 512))
CONFIG = SimpleNamespace(gradient_accumulation_fusion=True, no_sync_func=None,
                         grad_sync_func=None)


def w_times_ms(any_weight_order: bool, tokens: int, microbatches: int,
               generator: torch.Generator) -> list[float]:
    """Each W's time, the W tasks in reverse microbatch order (every one but the last ahead
    of an earlier one: the buffers' worst case)."""
    weights, biases = [], []
    for out_features, in_features in LAYER:
        weight = torch.nn.Parameter(torch.randn(out_features, in_features, generator=generator))
        weight.main_grad, weight.grad_added_to_main_grad = torch.zeros_like(weight), False
        weights.append(weight)
        biases.append(torch.nn.Parameter(torch.zeros(out_features)))
    store = WeightGradStore(any_weight_order=any_weight_order)
    store.begin_iteration(CONFIG, num_chunks=1, num_microbatches=microbatches)
    for microbatch in range(microbatches):
        with store.deferring((0, microbatch)):
            outputs = [biased_linear(torch.randn(tokens, w.shape[1], generator=generator), w, b,
                                     True) for w, b in zip(weights, biases, strict=True)]
            torch.autograd.backward(outputs, [torch.randn_like(o) for o in outputs])
    times = []
    for microbatch in reversed(range(microbatches)):
        start = time.perf_counter()
        store.run((0, microbatch))
        times.append((time.perf_counter() - start) * 1e3)
    store.end_iteration()
    return times


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--microbatches", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    medians = {False: [], True: []}
    with weight_grad_accumulation_fusion():
        for _ in range(args.rounds):  # the two alternate, so drift hits both alike
            for mode in medians:
                times = w_times_ms(mode, args.tokens, args.microbatches, generator)
                medians[mode].append(statistics.median(times))
    in_place, buffered = (statistics.median(medians[mode]) for mode in (False, True))
    print(f"a layer's W, {args.tokens} tokens, median of {args.rounds} rounds of "
          f"{args.microbatches}: in place {in_place:.3f} ms, into buffers added in B order "
          f"{buffered:.3f} ms ({buffered / in_place:.3f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
