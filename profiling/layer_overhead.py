"""Host time vs GPU time of one transformer layer's forward and backward.

A training step is launch-bound when the host needs about as long to enqueue a layer's
kernels as the GPU needs to run them. This measures both for the GPT of ../shared/GPU.md
on one GPU, with the project's layer spec (or megatron-core's, `--attention-backend
local`): the GPU is first given a long sleep kernel, so the host enqueues a whole
forward + backward without ever waiting, and host time = wall time of the Python calls,
GPU time = CUDA events around the same work. Two depths (--layers A B) give the cost of
one layer as the difference over the layers added (embedding, output layer and loss
cancel).

    python profiling/layer_overhead.py                      # 2 and 6 layers, GPT of GPU.md
    python profiling/layer_overhead.py --extra="--no-bias-dropout-fusion"
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import json
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: the repository root holds `megatron/`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron.dpp.weight_grad_accumulation import weight_grad_accumulation_fusion  # noqa: E402
from megatron.trainer.config.arguments import parse_args  # noqa: E402
from megatron.trainer.config.configs import TrainerConfigs  # noqa: E402
from megatron.trainer.model.models import (  # noqa: E402
    build_gpt_stage,
    build_model_chunks,
    transformer_config,
)
from megatron.trainer.run.initialize import initialize_distributed  # noqa: E402
from megatron.trainer.run.optimizer import wrap_model_chunks  # noqa: E402
from profiling.bench_gpt import GPT_LAYER_FLAGS  # noqa: E402

# one micro-batch per step: the global batch is the micro-batch
GPT_FLAGS = [*GPT_LAYER_FLAGS, "--global-batch-size", "2", "--train-iters", "1"]
SLEEP_CYCLES = 2_000_000_000  # ~1 s on an H200: longer than any host enqueue measured here


def measure(layers: int, extra: list[str], repeats: int, host_profile: Path | None = None) -> dict:
    args = parse_args([*GPT_FLAGS, "--num-layers", str(layers), *extra], world_size=1)
    configs = TrainerConfigs.from_args(args)
    configs = dataclasses.replace(configs, model=dataclasses.replace(
        configs.model, padded_vocab_size=args.vocab_size))
    config = transformer_config(configs)
    chunks = build_model_chunks(configs, config, build_gpt_stage)
    (model,) = wrap_model_chunks(chunks, configs, config, torch.device("cuda"))
    shape = (args.micro_batch_size, args.seq_length)
    tokens = torch.randint(0, args.vocab_size, shape, device="cuda")
    positions = torch.arange(args.seq_length, device="cuda").expand(shape)
    rows = []
    profile = cProfile.Profile() if host_profile else None
    for attempt in range(repeats + 3):  # 3 warm-ups: torch.compile of the fused ops
        events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)
        events[0].record()
        if profile and attempt >= 3:
            profile.enable()
        started = time.perf_counter()
        loss = model(tokens, positions, None, labels=tokens).float().mean()
        events[1].record()
        forwarded = time.perf_counter()
        loss.backward()
        events[2].record()
        done = time.perf_counter()
        if profile:
            profile.disable()
        ahead = not events[0].query()  # the GPU was still asleep: the host never waited
        torch.cuda.synchronize()
        model.zero_grad_buffer()
        if attempt >= 3:
            rows.append({
                "host_forward_ms": (forwarded - started) * 1e3,
                "host_backward_ms": (done - forwarded) * 1e3,
                "gpu_forward_ms": events[0].elapsed_time(events[1]),
                "gpu_backward_ms": events[1].elapsed_time(events[2]),
                "host_ahead": ahead,
            })
    if profile:
        # the host's Python functions by their own time (the GPU is asleep meanwhile)
        with open(host_profile, "w") as stream:
            pstats.Stats(profile, stream=stream).sort_stats("tottime").print_stats(60)
        profile.dump_stats(f"{host_profile}.prof")  # for pstats' callers / callees views
    del model, chunks
    torch.cuda.empty_cache()
    return {key: (statistics.median(r[key] for r in rows) if key != "host_ahead"
                  else all(r[key] for r in rows)) for key in rows[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, nargs=2, default=[2, 6])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--extra", default="",
                        help="flags added to the model's (write --extra='--flag value')")
    parser.add_argument("--out", default=None, help="also write the result as JSON here")
    parser.add_argument("--host-profile", default=None, metavar="FILE",
                        help="cProfile of the deeper model's measured passes (host functions "
                             "by own time; timings above are then inflated)")
    options = parser.parse_args()
    if not torch.cuda.is_available():
        parser.exit(2, f"{parser.prog}: needs a CUDA GPU\n")
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"),
                        ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29561")):
        os.environ.setdefault(name, value)
    with contextlib.ExitStack() as stack:
        setup = parse_args([*GPT_FLAGS, "--num-layers", "2"], world_size=1)
        initialize_distributed(TrainerConfigs.from_args(setup), stack)
        stack.enter_context(weight_grad_accumulation_fusion())
        low = measure(options.layers[0], options.extra.split(), options.repeats)
        high = measure(options.layers[1], options.extra.split(), options.repeats,
                       Path(options.host_profile) if options.host_profile else None)
    added = options.layers[1] - options.layers[0]
    per_layer = {key: (high[key] - low[key]) / added for key in low if key != "host_ahead"}
    result = {"layers": options.layers, "extra": options.extra, "low": low, "high": high,
              "per_layer": per_layer}
    lines = [f"per layer and micro-batch ({options.extra or 'project spec'}):"]
    for phase in ("forward", "backward"):
        host, gpu = per_layer[f"host_{phase}_ms"], per_layer[f"gpu_{phase}_ms"]
        lines.append(f"  {phase:8s} host {host:7.3f} ms   GPU {gpu:7.3f} ms   host/GPU "
                     f"{host / gpu if gpu > 0 else float('inf'):5.2f}")
    if not (low["host_ahead"] and high["host_ahead"]):
        lines.append("  warning: the GPU finished its sleep before the host finished "
                     "enqueueing; host times include waiting")
    sys.stdout.write("\n".join(lines) + "\n")
    if options.out:
        Path(options.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
