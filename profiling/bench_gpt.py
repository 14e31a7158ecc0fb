"""Throughput of the GPT of ../shared/GPU.md under several configurations, in one invocation.

Each configuration is one `torchrun pretrain_gpt.py` run; the script parses Megatron's
iteration lines (--log-interval 1), drops the warm-up iterations and reports the median
time per iteration, tokens/s (tokens actually trained), TFLOP/s/GPU and MFU.

    python profiling/bench_gpt.py --out runs/bench --configs local,sdpa,dpp-torch
    python profiling/bench_gpt.py --out runs/one --gpus 1 --pp 1 \
        --configs one-gpu-default,one-gpu-fastest,one-gpu-local      # one GPU
    python profiling/bench_gpt.py --out runs/var --gpus 4 --pp 4 --corpus PREFIX \
        --configs docs-packed,docs-1f1b,docs-1f1b-cost,docs-dpp,docs-dpp-static

Variable lengths (docs/variable_lengths.md): `docs-*` train the documents of `--corpus` (a prefix of
tools/build_length_corpus.py's corpus, tokenized), `cv-*` mock data cut to lengths drawn
with --seq-length-cv 0.5 (`cv-*-tokens`: one draw per sample, microbatches by a token
budget of 2,048); each padded to buckets of --pad-to-multiple (128 on GPU). Their
rows add real (non-pad) tokens/s, the padding share, the median time per real token and
the largest deviation of an iteration's from it, and every rank's peak memory.

Writes results.json, results.csv (one row per configuration) and table.txt under --out;
with --memory-snapshots also memory.txt: what each rank held at its peak, by call site, and
the difference between the configurations compared (DPP against 1F1B fed the same order).
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the `profiling` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from profiling import memory_peak  # noqa: E402

log = logging.getLogger("bench_gpt")

# the layer shape, precision and data of ../shared/GPU.md's GPT (also profiling/layer_overhead.py)
GPT_LAYER_FLAGS = [
    "--hidden-size", "2048", "--num-attention-heads", "16", "--seq-length", "2048",
    "--max-position-embeddings", "2048", "--micro-batch-size", "2", "--bf16", "--mock-data",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "50304", "--lr", "1e-4",
]
GPT_OF_GPU_MD = [
    "--num-layers", "24", *GPT_LAYER_FLAGS, "--log-interval", "1", "--eval-iters", "0",
    "--log-throughput",
]

# megatron-core as it runs without apex / TE, only the core attention swapped for SDPA:
# ../shared/GPU.md's "SDPA-only" configuration
MEGATRON_FALLBACKS = ["--batch-p2p-sync", "--megatron-optimizer-fallbacks", "--no-bias-gelu-fusion"]
FUSED = ["--cross-entropy-loss-fusion", "--decoder-first-pipeline-num-layers", "13"]
M32 = ["--global-batch-size", "64"]
M64 = ["--global-batch-size", "128"]
GRAPHS = ["--cuda-graph-impl", "block"]
XENT = ["--cross-entropy-fusion-impl", "triton"]
VARIABLE = ["--seq-length-cv", "0.5"]

CONFIGS = {
    # name: extra flags (a later --global-batch-size overrides --microbatches)
    "local": ["--attention-backend", "local", *MEGATRON_FALLBACKS],
    "sdpa": [],
    "dpp-torch": ["--use-dpp", "--dpp-transport", "torch"],
    "dpp-shm": ["--use-dpp", "--dpp-transport", "shm"],
    "var-1f1b": ["--seq-length-cv", "0.5"],
    "var-dpp-torch": ["--seq-length-cv", "0.5", "--use-dpp", "--dpp-transport", "torch"],
    "var-dpp-shm": ["--seq-length-cv", "0.5", "--use-dpp", "--dpp-transport", "shm"],
    # the fast path's steps, each adding one change to the previous
    "sdpa-only": MEGATRON_FALLBACKS,
    "step1-p2p-nosync": ["--megatron-optimizer-fallbacks", "--no-bias-gelu-fusion"],
    "step2-optimizer": ["--no-bias-gelu-fusion"],
    "step3-bias-gelu": [],
    "step4-xent": FUSED[:1],
    "step5-split": FUSED,
    "fast-m32": [*FUSED, *M32],
    "fast-m32-dpp-shm": [*FUSED, *M32, "--use-dpp", "--dpp-transport", "shm"],
    "fast-m32-dpp-torch": [*FUSED, *M32, "--use-dpp", "--dpp-transport", "torch"],
    "fast-m32-gc": [*FUSED, *M32, "--manual-gc"],
    "fast-m32-gc-dpp-torch": [*FUSED, *M32, "--manual-gc", "--use-dpp", "--dpp-transport",
                              "torch"],
    "fast-m32-gc-dpp-shm": [*FUSED, *M32, "--manual-gc", "--use-dpp", "--dpp-transport", "shm"],
    # CUDA graphs of the transformer blocks (megatron/trainer/model/cuda_graphs.py)
    "graphs": [*FUSED, *GRAPHS],
    "graphs-m32": [*FUSED, *M32, *GRAPHS],
    "graphs-m32-dpp-torch": [*FUSED, *M32, *GRAPHS, "--use-dpp", "--dpp-transport", "torch"],
    "graphs-m32-dpp-shm": [*FUSED, *M32, *GRAPHS, "--use-dpp", "--dpp-transport", "shm"],
    "graphs-m64": [*FUSED, *M64, *GRAPHS],
    "graphs-m64-dpp-torch": [*FUSED, *M64, *GRAPHS, "--use-dpp", "--dpp-transport", "torch"],
    "graphs-m64-dpp-shm": [*FUSED, *M64, *GRAPHS, "--use-dpp", "--dpp-transport", "shm"],
}
# every configuration above was measured before the weight-gradient accumulation fusion
# existed: it stays off there, so the documented figures stay reproducible
CONFIGS = {name: [*flags, "--no-gradient-accumulation-fusion"] for name, flags in CONFIGS.items()}
CONFIGS |= {
    # the weight-gradient GEMM accumulates into main_grad (dpp.weight_grad_accumulation)
    "wgrad-m32": [*FUSED, *M32],
    "wgrad-graphs-m32": [*FUSED, *M32, *GRAPHS],
    "wgrad-graphs-m64": [*FUSED, *M64, *GRAPHS],
    "wgrad-graphs-m64-dpp-torch": [*FUSED, *M64, *GRAPHS, "--use-dpp", "--dpp-transport",
                                   "torch"],
    "wgrad-graphs-m64-dpp-shm": [*FUSED, *M64, *GRAPHS, "--use-dpp", "--dpp-transport", "shm"],
    # + the single-pass cross-entropy (megatron/trainer/kernels/cross_entropy.py)
    "xent-graphs-m32": [*FUSED, *XENT, *M32, *GRAPHS],
    "xent-graphs-m64": [*FUSED, *XENT, *M64, *GRAPHS],
    "xent-graphs-m64-dpp-torch": [*FUSED, *XENT, *M64, *GRAPHS, "--use-dpp", "--dpp-transport",
                                  "torch"],
    "xent-graphs-m64-dpp-shm": [*FUSED, *XENT, *M64, *GRAPHS, "--use-dpp", "--dpp-transport",
                                "shm"],
    # one GPU (--pp 1): the trainer's defaults, and the fastest flags known
    "one-default": [],
    "one-fast": [*FUSED[:1], *XENT, *GRAPHS],
    # one GPU (--gpus 1 --pp 1): the B/W split's own cost, each W right after its B
    "pp1-xent": [*FUSED[:1], *XENT],
    "pp1-xent-split": [*FUSED[:1], *XENT, "--dpp-split-backward"],
    "pp1-xent-graphs": [*FUSED[:1], *XENT, *GRAPHS],
    "pp1-xent-graphs-split": [*FUSED[:1], *XENT, *GRAPHS, "--dpp-split-backward"],
    # pipelined (--pp 2): DPP placing the W tasks (zero-bubble), at +0 and the default slack
    "xent-graphs-m64-dpp-shm-split": [*FUSED, *XENT, *M64, *GRAPHS, "--use-dpp",
                                      "--dpp-transport", "shm", "--dpp-split-backward"],
    "xent-graphs-m64-dpp-shm-split-slack0": [*FUSED, *XENT, *M64, *GRAPHS, "--use-dpp",
                                             "--dpp-transport", "shm", "--dpp-split-backward",
                                             "--dpp-max-inflight", "0"],
    # variable lengths against the best static schedule given the same order:
    # plain 1F1B, 1F1B fed the cost order, DPP at slack 0 without and with the split
    "var2-1f1b": [*FUSED, *XENT, *VARIABLE],
    "var2-1f1b-cost": [*FUSED, *XENT, *VARIABLE, "--microbatch-order", "cost"],
    "var2-dpp-shm-slack0": [*FUSED, *XENT, *VARIABLE, "--use-dpp", "--dpp-transport", "shm",
                            "--dpp-max-inflight", "0"],
    "var2-dpp-shm-split-slack0": [*FUSED, *XENT, *VARIABLE, "--use-dpp", "--dpp-transport",
                                  "shm", "--dpp-max-inflight", "0", "--dpp-split-backward"],
}

# every configuration above was measured before the CUDA-graph blocks and the single-pass
# cross-entropy became defaults on GPU (megatron/trainer/config/fast_path.py): where a configuration
# does not ask for them they stay off, so the documented figures stay reproducible
CONFIGS = {name: [*flags,
                  *([] if "--cuda-graph-impl" in flags else ["--cuda-graph-impl", "none"]),
                  *([] if "--cross-entropy-loss-fusion" in flags
                    else ["--no-cross-entropy-loss-fusion"])]
           for name, flags in CONFIGS.items()}
CONFIGS |= {
    # one GPU (--gpus 1 --pp 1): no speed flags (the fast path's defaults), the
    # fastest flags known, and megatron-core's local spec as it runs without apex / TE
    "one-gpu-default": [],
    "one-gpu-fastest": [*FUSED[:1], *XENT, *GRAPHS],
    "one-gpu-local": CONFIGS["local"],
    # the attention kernels apart: FlashAttention-2 only, cuDNN's only
    "one-gpu-flash": [*FUSED[:1], *XENT, *GRAPHS, "--attention-backend", "flash"],
    "one-gpu-cudnn": [*FUSED[:1], *XENT, *GRAPHS, "--attention-backend", "fused"],
    # the defaults with torch's norm and megatron-core's compiled fusions, not the Triton ones
    "one-gpu-torch-kernels": ["--no-triton-fusions"],
    # the defaults with fc1's GEMM then the Triton bias-GeLU, not the cuBLASLt epilogues
    "one-gpu-no-gelu-epilogue": ["--no-gelu-gemm-epilogue"],
}
# variable lengths, each without and with CUDA graphs per length bucket
# (`-graphs`): packed fixed-length training (megatron's default on the corpus, and fixed
# 1,024-token microbatches), megatron-core's 1F1B in natural and cost order, DPP as
# --use-dpp runs it (on GPUs the split backward at slack 0, its plan in order), DPP without
# the split, DPP's plan replayed statically (--dpp-static: ZB-H1 fed the same order), DPP's
# dynamic rule (--no-dpp-static), megatron-core's
# interleaved schedule fed the same order, and DPP / 1F1B on
# microbatches of a token budget of 2048 tokens, the
# documents grouped by length (on the corpus of tools/build_length_corpus.py: 15 to 22,
# on average 19, microbatches per iteration, 7.8 % padding, against 29.7 % for
# microbatches of 2 in Megatron's order)
VARIABLE_SCHEDULES = {
    "1f1b": [],
    "1f1b-cost": ["--microbatch-order", "cost"],
    "dpp": ["--use-dpp", "--dpp-transport", "shm"],
    "dpp-nosplit": ["--use-dpp", "--dpp-transport", "shm", "--no-dpp-split-backward"],
    "dpp-static": ["--use-dpp", "--dpp-transport", "shm", "--dpp-static"],
    # the dynamic rule (the default with variable lengths until the plan in order measured
    # faster there)
    "dpp-dynamic": ["--use-dpp", "--dpp-transport", "shm", "--no-dpp-static"],
    # megatron-core's interleaved schedule (two model chunks a stage) in DPP's cost order
    "interleaved-cost": ["--virtual-pipeline-model-parallel-size", "2",
                         "--microbatch-order", "cost"],
}
TOKEN_BUDGET = ["--microbatch-tokens", "2048", "--group-by-length"]
GRAPH_CHOICES = {"": ["--cuda-graph-impl", "none"],
                 "-graphs": ["--cuda-graph-impl", "block", "--cuda-graph-memory-limit", "24"]}
for suffix, graph_flags in GRAPH_CHOICES.items():
    CONFIGS |= {
        f"docs-packed{suffix}": ["--corpus", *graph_flags],
        f"fixed-1024{suffix}": ["--seq-length", "1024", *graph_flags],
        f"docs-1f1b-tokens{suffix}": ["--corpus", "--variable-seq-lengths", *TOKEN_BUDGET,
                                      *graph_flags],
        # megatron-core's 1F1B fed the cost order DPP runs, on the same microbatches
        f"docs-1f1b-cost-tokens{suffix}": ["--corpus", "--variable-seq-lengths", *TOKEN_BUDGET,
                                           *VARIABLE_SCHEDULES["1f1b-cost"], *graph_flags],
        f"docs-dpp-tokens{suffix}": ["--corpus", "--variable-seq-lengths", *TOKEN_BUDGET,
                                     *VARIABLE_SCHEDULES["dpp"], *graph_flags],
        # each W deferred as ZB-H1 defers them (the default runs it right after its B)
        f"docs-dpp-tokens-deferred{suffix}": ["--corpus", "--variable-seq-lengths",
                                              *TOKEN_BUDGET, *VARIABLE_SCHEDULES["dpp"],
                                              "--dpp-defer-weights", *graph_flags],
    }
    # --seq-length-cv 0.5's lengths drawn per sample under the same budget (no corpus)
    for schedule in ("1f1b", "1f1b-cost", "dpp"):
        CONFIGS[f"cv-{schedule}-tokens{suffix}"] = [*VARIABLE, *TOKEN_BUDGET,
                                                    *VARIABLE_SCHEDULES[schedule], *graph_flags]
    CONFIGS[f"cv-dpp-tokens-deferred{suffix}"] = [*VARIABLE, *TOKEN_BUDGET,
                                                  *VARIABLE_SCHEDULES["dpp"],
                                                  "--dpp-defer-weights", *graph_flags]
    for schedule, schedule_flags in VARIABLE_SCHEDULES.items():
        CONFIGS[f"docs-{schedule}{suffix}"] = ["--corpus", "--variable-seq-lengths",
                                               *schedule_flags, *graph_flags]
        # a global batch's documents sorted by length into microbatches: 8.4 % padding on
        # the corpus against 29.7 % in Megatron's order (docs/variable_lengths.md)
        CONFIGS[f"docs-grouped-{schedule}{suffix}"] = [
            "--corpus", "--variable-seq-lengths", "--group-by-length", *schedule_flags,
            *graph_flags]
        CONFIGS[f"cv-{schedule}{suffix}"] = [*VARIABLE, *schedule_flags, *graph_flags]
# "--corpus" in a configuration: its data are --corpus's documents (data_flags)
CORPUS_MARK = "--corpus"
MOCK_DATA = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "50304"]

# the one-GPU targets: the defaults' share of the fastest flags' tokens/s, and their MFU
TARGETS = {"one-gpu-default": ("one-gpu-fastest", 0.98, 55.0)}

# (a, b): print a's tokens/s over b's when both ran
RATIOS = (
    ("sdpa", "local"), ("step5-split", "local"), ("fast-m32", "sdpa-only"),
    ("fast-m32-dpp-shm", "fast-m32"), ("fast-m32-dpp-torch", "fast-m32"),
    ("fast-m32-gc", "fast-m32"), ("fast-m32-gc-dpp-torch", "fast-m32-gc"),
    ("fast-m32-gc-dpp-shm", "fast-m32-gc"), ("fast-m32-gc-dpp-shm", "fast-m32-gc-dpp-torch"),
    ("dpp-torch", "sdpa"), ("dpp-shm", "sdpa"), ("dpp-shm", "dpp-torch"),
    ("var-dpp-torch", "var-1f1b"), ("var-dpp-shm", "var-1f1b"),
    ("graphs", "step5-split"), ("graphs-m32", "fast-m32"), ("graphs-m32", "sdpa-only"),
    ("graphs-m32-dpp-torch", "graphs-m32"), ("graphs-m32-dpp-shm", "graphs-m32"),
    ("graphs-m32-dpp-shm", "graphs-m32-dpp-torch"), ("graphs-m64", "sdpa-only"),
    ("graphs-m64-dpp-torch", "graphs-m64"), ("graphs-m64-dpp-shm", "graphs-m64"),
    ("graphs-m64-dpp-shm", "graphs-m64-dpp-torch"), ("wgrad-graphs-m32", "graphs-m32"),
    ("wgrad-graphs-m64", "graphs-m64"), ("wgrad-graphs-m64", "sdpa-only"),
    ("wgrad-graphs-m64-dpp-torch", "wgrad-graphs-m64"),
    ("wgrad-graphs-m64-dpp-shm", "wgrad-graphs-m64"), ("wgrad-m32", "fast-m32"),
    ("xent-graphs-m64", "wgrad-graphs-m64"), ("xent-graphs-m64", "sdpa-only"),
    ("xent-graphs-m64-dpp-torch", "xent-graphs-m64"), ("xent-graphs-m64-dpp-shm", "xent-graphs-m64"),
    ("xent-graphs-m64-dpp-shm", "xent-graphs-m64-dpp-torch"), ("one-fast", "one-default"),
    ("pp1-xent-split", "pp1-xent"), ("pp1-xent-graphs-split", "pp1-xent-graphs"),
    ("var2-1f1b-cost", "var2-1f1b"), ("var2-dpp-shm-slack0", "var2-1f1b-cost"),
    ("var2-dpp-shm-split-slack0", "var2-1f1b-cost"), ("var2-dpp-shm-split-slack0", "var2-1f1b"),
    ("xent-graphs-m64-dpp-shm-split", "xent-graphs-m64-dpp-shm"),
    ("xent-graphs-m64-dpp-shm-split-slack0", "xent-graphs-m64"),
    ("one-gpu-default", "one-gpu-fastest"), ("one-gpu-default", "one-gpu-local"),
    ("one-gpu-default", "one-default"), ("one-gpu-cudnn", "one-gpu-flash"),
    ("one-gpu-default", "one-gpu-flash"), ("one-gpu-default", "one-gpu-torch-kernels"),
    ("one-gpu-default", "one-gpu-no-gelu-epilogue"),
    *((f"{source}-{a}{graphs}", f"{source}-{b}{graphs}") for source in ("docs", "docs-grouped", "cv")
      for graphs in GRAPH_CHOICES for a, b in (
          ("dpp", "1f1b"), ("dpp", "1f1b-cost"), ("dpp", "dpp-static"), ("dpp", "interleaved-cost"),
          ("dpp-dynamic", "dpp-static"),
          ("dpp-nosplit", "1f1b-cost"), ("dpp", "dpp-nosplit"), ("1f1b-cost", "1f1b"))),
    *((f"docs-{a}{graphs}", f"docs-{b}{graphs}") for graphs in GRAPH_CHOICES
      for a, b in (("dpp-tokens", "dpp"), ("1f1b-tokens", "1f1b"), ("dpp", "packed"),
                   ("dpp-tokens", "1f1b-tokens"), ("dpp-tokens", "packed"),
                   ("dpp-tokens", "dpp-tokens-deferred"),
                   ("dpp-tokens", "1f1b-cost-tokens"),
                   ("dpp-tokens-deferred", "1f1b-tokens"))),
    *((f"docs-grouped-dpp{graphs}", f"docs-packed{graphs}") for graphs in GRAPH_CHOICES),
    *((f"cv-{a}{graphs}", f"cv-{b}{graphs}") for graphs in GRAPH_CHOICES
      for a, b in (("dpp-tokens", "1f1b-tokens"), ("dpp-tokens", "1f1b-cost-tokens"),
                   ("dpp-tokens", "dpp-tokens-deferred"), ("dpp-tokens", "dpp"))),
)
# variable lengths: ratios of real (non-pad) tokens/s, where padding is what differs
REAL_RATIOS = tuple((a, b) for a, b in RATIOS if a.startswith(("docs-", "cv-")))
REAL_RATIOS += tuple((f"{v}{graphs}", f"fixed-1024{graphs}") for graphs in GRAPH_CHOICES
                     for v in ("docs-dpp", "docs-1f1b", "docs-grouped-dpp", "docs-grouped-1f1b",
                               "cv-dpp", "cv-1f1b", "cv-dpp-tokens", "cv-1f1b-tokens"))

# TFLOP/s and MFU are logged only on a GPU whose peak the trainer knows (metrics.py)
LINE = re.compile(
    r"iteration\s+(\d+)/.*elapsed time per iteration \(ms\): ([\d.]+)"
    r"(?:.*throughput per GPU \(TFLOP/s/GPU\): ([\d.]+))?(?:.*MFU: ([\d.]+)%)?.*tokens/s: (\d+)"
)
# the trainer's memory line: max allocated on a GPU, max RSS on CPU
MEMORY = re.compile(r"memory per rank \(max (?:allocated|RSS), MB\): (.*)")
REAL = re.compile(r"iteration\s+(\d+)/.*real tokens per second: (\d+) \| padding: ([\d.]+)%")


def data_flags(flags: list[str], corpus: str | None) -> list[str]:
    """A configuration's data: mock data, or the documents of --corpus (GPT-2 BPE) where it
    is marked CORPUS_MARK."""
    if CORPUS_MARK not in flags:
        return flags
    if corpus is None:
        raise SystemExit(f"the configuration {' '.join(flags)} trains documents: give --corpus "
                         "PREFIX (tools/build_length_corpus.py, then tools/preprocess_data.py)")
    root = Path(__file__).resolve().parents[1]
    return ["--data-path", corpus, "--split", "98,1,1", "--tokenizer-type", "GPT2BPETokenizer",
            "--vocab-file", str(root / "datasets_gpt/vocab.json"),
            "--merge-file", str(root / "datasets_gpt/merges.txt"),
            *(flag for flag in flags if flag != CORPUS_MARK)]


def model_flags(flags: list[str]) -> list[str]:
    """GPU.md's GPT, without its mock data where the configuration reads a corpus."""
    if "--data-path" not in flags:
        return GPT_OF_GPU_MD
    at = GPT_OF_GPU_MD.index(MOCK_DATA[0])
    if GPT_OF_GPU_MD[at:at + len(MOCK_DATA)] != MOCK_DATA:
        raise AssertionError("GPT_LAYER_FLAGS no longer hold MOCK_DATA in one piece")
    return GPT_OF_GPU_MD[:at] + GPT_OF_GPU_MD[at + len(MOCK_DATA):]


def peak_memory(text: str) -> tuple[list[float] | None, list[bool] | None]:
    """Each rank's peak over the run (the last memory report: the reports are cumulative) and
    whether the first report, after iteration 1, already held it: with CUDA graphs that step
    records every bucket, so such a rank's peak is the recording step's, not the schedule's."""
    reports = [[float(entry.split(":")[1]) for entry in line.split("|")]
               for line in MEMORY.findall(text)]
    if not reports:
        return None, None
    return reports[-1], [first == last for first, last in
                         zip(reports[0], reports[-1], strict=True)]


def variable_length_figures(text: str, rows: list[tuple], warmup: int) -> dict:
    """Real-token figures of a run whose log lines report padding (else the tokens/s are
    all real): median real tokens/s, padding share, median microseconds per real token
    and the largest deviation of a measured iteration's from that median."""
    real = {int(m[0]): (float(m[1]), float(m[2])) for m in REAL.findall(text)}
    measured = [(int(r[0]), float(r[4])) for r in rows if int(r[0]) > warmup]
    per_iteration = [real.get(i, (tokens, 0.0)) for i, tokens in measured]
    us_per_token = [1e6 / tokens for tokens, _ in per_iteration if tokens > 0]
    if not us_per_token:
        return {}
    median = statistics.median(us_per_token)
    return {
        "real_tokens_per_s": statistics.median(tokens for tokens, _ in per_iteration),
        "padding_percent": statistics.median(share for _, share in per_iteration),
        "us_per_real_token": median,
        "max_deviation_percent": 100 * max(abs(t - median) / median for t in us_per_token),
    }


def observer_flags(name: str, args, out: Path) -> list[str]:
    """--trace / --profile for the measured iterations (they perturb the timings a little:
    take throughput from a run without them)."""
    first, end = args.warmup + 1, args.warmup + args.iters + 1
    flags = []
    if args.trace:  # the last iteration only: the median of the others stays untouched
        flags += ["--trace", "--trace-dir", str(out / f"trace-{name}"),
                  "--trace-iters", str(end - 1)]
    if args.profile:
        flags += ["--profile", "--use-pytorch-profiler", "--profile-step-start", str(first),
                  "--profile-step-end", str(end), "--profile-ranks",
                  *map(str, range(args.gpus)), "--profile-dir", str(out / f"profile-{name}")]
    if args.memory_snapshots:
        flags += ["--record-memory-history", "--memory-snapshot-path",
                  str(snapshot_folder(out, name) / "snapshot.pickle"), "--profile-ranks",
                  *map(str, range(args.gpus))]
    return flags


def snapshot_folder(out: Path, name: str) -> Path:
    """--memory-snapshots: a configuration's snapshots, one per rank (two folders down: the
    device tool does not bring back these large files, only memory.txt)."""
    return out / "snapshots" / name


def memory_lines(names: list[str], out: Path, ranks: int, top: int = 8) -> list[str]:
    """Each rank's peak by call site (profiling/memory_peak.py) for the configurations whose
    snapshots are there, and the difference per site for each pair of RATIOS that ran."""
    peaks = {}
    for name in names:
        paths = [snapshot_folder(out, name) / f"snapshot-rank{rank}.pickle" for rank in range(ranks)]
        if all(path.exists() for path in paths):
            peaks[name] = [memory_peak.find_peak(memory_peak.load(path)) for path in paths]
    lines = []
    for name, per_rank in peaks.items():
        for rank, peak in enumerate(per_rank):
            lines += memory_peak.report(f"{name} rank {rank}", peak, top)
    for a, b in RATIOS:
        if a in peaks and b in peaks:
            for rank, (peak, other) in enumerate(zip(peaks[a], peaks[b], strict=True)):
                lines += memory_peak.compare(f"{a} rank {rank}", peak, b, other, top)
    return lines


def pipeline_flags(flags: list[str], pp: int) -> list[str]:
    """`flags` for a pipeline of `pp` stages: an uneven split needs two stages or more."""
    if pp == 1 and "--decoder-first-pipeline-num-layers" in flags:
        at = flags.index("--decoder-first-pipeline-num-layers")
        flags = flags[:at] + flags[at + 2:]
    return ["--pipeline-model-parallel-size", str(pp), *flags]


def run(name: str, flags: list[str], args, out: Path, model: list[str] | None = None) -> dict:
    """One configuration: its torchrun, log (out/<name>.log) and figures. `model`: the
    model's flags (default GPU.md's GPT, `model_flags`)."""
    # --find-syncs: the same run under profiling/find_syncs.py (device syncs per call site)
    wrapper = ["profiling/find_syncs.py", "--out", str(out / f"syncs-{name}")] if (
        args.find_syncs) else []
    # --installed: the pip-installed trainer, started outside the checkout so that nothing
    # of the checkout is imported
    program = ["-m", "pretrain_gpt"] if args.installed else [*wrapper, "pretrain_gpt.py"]
    command = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.gpus}",
        f"--master_port={args.port}", *program,
        *(model_flags(flags) if model is None else model),
        "--global-batch-size", str(2 * args.microbatches),
        "--train-iters", str(args.warmup + args.iters), *pipeline_flags(flags, args.pp),
        *observer_flags(name, args, out),
    ]
    started = time.time()
    log_path = out / f"{name}.log"
    with open(log_path, "w") as log_file:
        try:
            returncode = subprocess.run(command, stdout=log_file, stderr=subprocess.STDOUT,
                                        env=os.environ.copy(), timeout=args.timeout,
                                        cwd=tempfile.gettempdir() if args.installed else None
                                        ).returncode
        except subprocess.TimeoutExpired:
            returncode = "timeout"
    result = log_figures(name, log_path.read_text(), flags, args.warmup, returncode)
    if "error" not in result:
        result["wall_s"] = round(time.time() - started, 1)
    return result


def log_figures(name: str, text: str, flags: list[str], warmup: int,
                returncode: int | str = 0) -> dict:
    """A run's figures from its log: the medians over the iterations after `warmup`."""
    rows = [m.groups() for m in LINE.finditer(text)]
    if returncode != 0 or not rows:
        return {"name": name, "error": f"exit {returncode}", "tail": text[-3000:]}
    measured = [r for r in rows if int(r[0]) > warmup]
    ms = statistics.median(float(r[1]) for r in measured)
    per_rank, first_step = peak_memory(text)
    tokens = statistics.median(float(r[4]) for r in measured)
    return {
        "name": name, "flags": " ".join(flags), "ms_per_iter": ms,
        "tokens_per_s": tokens,
        "tflops_per_gpu": (statistics.median(float(r[2]) for r in measured)
                           if measured[0][2] else None),
        "mfu_percent": statistics.median(float(r[3]) for r in measured) if measured[0][3] else None,
        "peak_mb": max(per_rank) if per_rank else None, "peak_mb_per_rank": per_rank,
        "peak_in_first_step": first_step, "iterations": len(measured),
        **variable_length_figures(text, rows, warmup),
    }


CSV_COLUMNS = ("name", "ms_per_iter", "tokens_per_s", "tflops_per_gpu", "mfu_percent", "peak_mb",
               "real_tokens_per_s", "padding_percent", "us_per_real_token",
               "max_deviation_percent", "peak_mb_per_rank", "peak_in_first_step", "iterations",
               "wall_s", "error", "flags")


def variable_length_lines(results: list[dict], base: dict) -> list[str]:
    """The variable-length rows' real-token figures, each rank's peak memory, and the ratios
    of real tokens/s."""
    rows = [r for r in results if "us_per_real_token" in r]
    if not rows:
        return []
    lines = [f"{'config':24s} {'real tok/s':>10s} {'padding%':>9s} {'us/real tok':>11s} "
             f"{'max dev%':>9s}  peak MB per rank"]
    for r in rows:
        peaks = r.get("peak_mb_per_rank") or []
        first_step = r.get("peak_in_first_step") or [False] * len(peaks)
        ranks = " ".join(f"{mb:.0f}{'*' if early else ''}" for mb, early in
                         zip(peaks, first_step, strict=True))
        lines.append(f"{r['name']:24s} {r['real_tokens_per_s']:10.0f} {r['padding_percent']:9.1f} "
                     f"{r['us_per_real_token']:11.3f} {r['max_deviation_percent']:9.1f}  {ranks}")
    if any(any(r.get("peak_in_first_step") or []) for r in rows):
        lines.append("* the rank's peak was reached in iteration 1 (with CUDA graphs: the step "
                     "that records every bucket)")
    for a, b in REAL_RATIOS:
        if "real_tokens_per_s" in base.get(a, {}) and "real_tokens_per_s" in base.get(b, {}):
            ratio = base[a]["real_tokens_per_s"] / base[b]["real_tokens_per_s"]
            lines.append(f"{a} / {b}, real tokens/s: {ratio:.3f}x")
    return lines


def write_csv(path: Path, results: list[dict]) -> None:
    """One flat row per configuration (failed ones with their error)."""
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--configs", default="local,sdpa,dpp-torch")
    parser.add_argument("--microbatches", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2, help="pipeline stages")
    parser.add_argument("--port", type=int, default=29533)
    parser.add_argument("--timeout", type=float, default=300, help="seconds per configuration")
    parser.add_argument("--trace", action="store_true", help="--trace the last iteration")
    parser.add_argument("--profile", action="store_true",
                        help="torch.profiler over the measured iterations, every rank")
    parser.add_argument("--memory-snapshots", action="store_true",
                        help="every rank records the CUDA allocator's history; memory.txt: "
                             "what was live at each rank's peak, and the differences between "
                             "the pairs compared (a snapshot is written every iteration: "
                             "take throughput from a run without it)")
    parser.add_argument("--find-syncs", action="store_true",
                        help="count device syncs per call site (slows the run)")
    parser.add_argument("--installed", action="store_true",
                        help="run the pip-installed pretrain_gpt module, not the checkout's "
                             "(not with --find-syncs)")
    parser.add_argument("--corpus", default=None,
                        help="prefix of the tokenized documents the docs-* configurations "
                             "train (tools/build_length_corpus.py)")
    parser.add_argument("--extra", default="",
                        help="flags added to every configuration (write --extra='--flag value')")
    args = parser.parse_args()
    if args.installed and args.find_syncs:
        parser.error("--installed and --find-syncs: find_syncs.py runs the checkout's trainer")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out = Path(args.out).resolve()  # the runs' working directory may differ
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for name in args.configs.split(","):
        flags = data_flags(CONFIGS[name] + args.extra.split(), args.corpus)
        results.append(run(name, flags, args, out))
        log.info(json.dumps(results[-1]))
        (out / "results.json").write_text(json.dumps(results, indent=1))
    base = {r["name"]: r for r in results if "error" not in r}
    header = (f"{'config':16s} {'ms/iter':>9s} {'tokens/s':>10s} {'TFLOP/s/GPU':>12s} "
              f"{'MFU%':>6s} {'peak MB':>9s}")
    lines = [header]
    for r in results:
        if "error" in r:
            lines.append(f"{r['name']:16s} FAILED ({r['error']})")
            continue
        lines.append(f"{r['name']:16s} {r['ms_per_iter']:9.1f} {r['tokens_per_s']:10.0f} "
                     f"{r['tflops_per_gpu']:12.1f} {r['mfu_percent'] or 0:6.1f} "
                     f"{r['peak_mb'] or 0:9.0f}")
    for a, b in RATIOS:
        if a in base and b in base:
            lines.append(f"{a} / {b}: {base[a]['tokens_per_s'] / base[b]['tokens_per_s']:.3f}x")
    lines += variable_length_lines(results, base)
    for name, (fastest, share, mfu) in TARGETS.items():
        if name in base and fastest in base:
            ratio = base[name]["tokens_per_s"] / base[fastest]["tokens_per_s"]
            got = base[name]["mfu_percent"] or 0
            lines.append(f"target {name}: {ratio:.3f}x {fastest} (>= {share}: "
                         f"{'met' if ratio >= share else 'NOT met'}), MFU {got:.1f} % (>= {mfu}: "
                         f"{'met' if got >= mfu else 'NOT met'})")
    if args.memory_snapshots:
        memory = memory_lines([r["name"] for r in base.values()], out, args.gpus)
        (out / "memory.txt").write_text("\n".join(memory) + "\n")
    write_csv(out / "results.csv", results)
    table = "\n".join(lines)
    (out / "table.txt").write_text(table + "\n")
    sys.stdout.write(table + "\n")
    if len(base) < len(results):
        sys.exit(1)


if __name__ == "__main__":
    main()
