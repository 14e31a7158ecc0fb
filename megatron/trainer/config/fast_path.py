"""The fast path, on by default where its conditions hold.

Five speed features are on unless the run rules them out: CUDA graphs of the transformer
blocks (`--cuda-graph-impl block`, cuda_graphs.py), the single-pass cross-entropy
(`--cross-entropy-loss-fusion --cross-entropy-fusion-impl triton`, cross_entropy.py), the
gradient-accumulation fusion (the weight-gradient GEMM adds into main_grad, no_apex.py),
the project's Triton kernels for the local layers' norms, bias-dropout-add and bias-GeLU
(triton_norm.py, triton_dropout.py, triton_gelu.py) and the MLP's bias-GeLU inside its
GEMMs (gelu_mlp.py, gemm_epilogues.py).
Each is a default only: given explicitly, a flag is the user's choice and is validated as
such (arguments.py); switched off (`--cuda-graph-impl none`, `--no-cross-entropy-loss-fusion`,
`--no-gradient-accumulation-fusion`, `--no-triton-fusions`, `--no-gelu-gemm-epilogue`) it
stays off. Where a default
cannot hold, the run falls back and `log_fallbacks` says, in one line per feature, every
reason that applies.

`resolve` is a pure function of the flags and of what the machine offers (`Machine`), so
each condition is testable on a machine without a GPU.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import re

from megatron.trainer.config.args_common import GPU_PAD_TO_MULTIPLE
from megatron.trainer.data.microbatches import MAX_WARM_SHAPES, shapes_by_length

log = logging.getLogger(__name__)

CUDA_GRAPHS = "CUDA-graph blocks (--cuda-graph-impl block)"
CROSS_ENTROPY = "single-pass cross-entropy (--cross-entropy-loss-fusion)"
GRAD_ACCUMULATION = "gradient-accumulation fusion"
TRITON_FUSIONS = "Triton layer norm, bias-dropout-add and bias-GeLU"
GELU_EPILOGUE = "bias-GeLU in the MLP's GEMM epilogues (cuBLASLt)"

NO_GPU = "no CUDA GPU on this machine"
GLOO_ON_GPU = "--distributed-backend gloo runs the ranks on the CPU"
SPLIT_BACKWARD = "DPP's split backward (--dpp-split-backward: B and W tasks)"
# docs/benchmarks/gpu_pp4_h200_2026-11-27.md and variable_lengths_h200_2026-11-27.md (4 H200s,
# PP=4, 16 microbatches)
# the activations DPP's chosen slack may hold on a GPU, of megatron-core 1F1B's busiest stage
GPU_MEMORY_BUDGET = "1.15x"
MEASURED_STATIC = ("with one model chunk the plan in order measured faster than the dynamic "
                   "rule's deviations (W deferred: 289.3 against 300.5 ms an iteration at "
                   "PP=4; with --seq-length-cv 0.5, in the cost order, 196,953 against "
                   "191,682 real tokens/s)")
# docs/benchmarks/variable_lengths_h200_2026-11-27.md, "2026-11-28 00:00 UTC" (4 H200s, PP=4, one machine)
MEASURED_DEFERRAL = ("measured at PP=4: 288.0 ms an iteration against 283.2 with the W "
                     "deferred, the last stage holding 6,227 MB against 7,697 (1F1B: 303.4 "
                     "ms, 6,243 MB); on variable lengths under --microbatch-tokens 183,889 "
                     "against 182,618 real tokens/s")
MEASURED_CHUNKS = ("two model chunks per stage (--virtual-pipeline-model-parallel-size 2, "
                   "where each stage's layers divide by 2) measured 1.10x megatron-core's "
                   "1F1B at PP=4 (one chunk 1.07x), but 0.96x at PP=2, where one chunk with "
                   "--dpp-max-inflight 1 measured 1.04x at 0.6 % more memory; chunks change "
                   "the model's layout and its checkpoints, so they stay your choice")

# Graphs per length bucket (graph_slots.py) are on by default where the shapes are known
# before the first step, so each lane records them by its end: 4 x H200, PP=4,
# --seq-length-cv 0.5: 0.935x the real tokens/s of fixed 1,024-token microbatches; 4 x H100,
# a corpus at --microbatch-tokens 2048 (50 shapes, a row count per length): 0.90x, every
# iteration from the 5th within 4.3 % of the median time per real token. Past
# MAX_WARM_SHAPES shapes each would be recorded when it first comes: graphs stay off.


@dataclasses.dataclass(frozen=True)
class Machine:
    """What the fast path needs from this machine and its Python environment."""

    cuda: bool
    triton: bool
    transformer_engine: bool
    gemm_epilogues: bool  # the native module megatron.trainer.kernels._gemm_epilogues was built

    @classmethod
    def detect(cls) -> Machine:
        import torch

        from megatron.trainer.kernels import gemm_epilogues

        cuda = torch.cuda.is_available()
        return cls(cuda=cuda,
                   triton=cuda and importlib.util.find_spec("triton") is not None,
                   transformer_engine=cuda and importlib.util.find_spec(
                       "transformer_engine") is not None,
                   gemm_epilogues=cuda and gemm_epilogues.built())


class GraphsRefused(ValueError):
    """An explicit --cuda-graph-impl block that the model cannot replay (the trainer reports
    it as a flag error)."""


def on_gpu(args, machine: Machine) -> bool:
    """Whether this run's ranks compute on GPUs (gloo on a GPU machine runs on the CPU)."""
    return machine.cuda and args.distributed_backend in (None, "nccl")


def resolve(args, machine: Machine) -> list[str]:
    """Settle the defaults of `args` (`cuda_graph_impl` "auto", `cross_entropy_loss_fusion`
    None, `gradient_accumulation_fusion` True, `triton_fusions` and `gelu_gemm_epilogue`
    None) for this machine;
    returns one line per default that fell back, naming its reasons. Explicit choices are
    left as given."""
    gpu = on_gpu(args, machine)
    no_gpu = NO_GPU if not machine.cuda else GLOO_ON_GPU
    fallbacks = _resolve_dpp(args, machine, gpu)

    if args.cuda_graph_impl == "auto":
        reasons = _graph_conflicts(args, machine) + ([] if gpu else [no_gpu])
        args.cuda_graph_impl = "none" if reasons else "block"
        if reasons:
            fallbacks.append(_line(CUDA_GRAPHS, reasons, "--cuda-graph-impl none"))

    impl_given = args.cross_entropy_fusion_impl is not None
    if args.cross_entropy_loss_fusion is None:
        impl = args.cross_entropy_fusion_impl or "triton"
        reasons = ([] if gpu else [no_gpu]) + _cross_entropy_conflicts(args, impl, machine)
        args.cross_entropy_loss_fusion = not reasons
        if reasons:
            fallbacks.append(_line(CROSS_ENTROPY, reasons, "--no-cross-entropy-loss-fusion"))
        args.cross_entropy_fusion_impl = impl
    elif not impl_given:
        args.cross_entropy_fusion_impl = "native"  # Megatron-LM's default with the flag given

    if args.triton_fusions is None:
        reasons = [no_gpu] if not gpu else [] if machine.triton else ["Triton is not importable"]
        if _transformer_engine_layers(args, machine):
            reasons.append("Transformer Engine layers (they bring their own fused norms)")
        args.triton_fusions = not reasons
        if reasons:
            fallbacks.append(_line(TRITON_FUSIONS, reasons, "--no-triton-fusions"))

    if args.gelu_gemm_epilogue is None:
        reasons = ([] if gpu else [no_gpu]) + _gelu_epilogue_conflicts(args, machine)
        args.gelu_gemm_epilogue = not reasons
        if reasons:
            fallbacks.append(_line(GELU_EPILOGUE, reasons, "--no-gelu-gemm-epilogue"))

    # the B/W split and the deferred output layer defer exactly these GEMMs, so they keep
    # them on the CPU as well
    if (args.gradient_accumulation_fusion and not gpu and not args.dpp_split_backward
            and not args.defer_embedding_wgrad_compute):
        args.gradient_accumulation_fusion = False
        fallbacks.append(_line(GRAD_ACCUMULATION, [no_gpu + " (it saves a kernel only there)"],
                               "--no-gradient-accumulation-fusion"))
    return fallbacks


def _resolve_dpp(args, machine: Machine, gpu: bool) -> list[str]:
    """`--use-dpp` alone runs the fastest variant measured (docs/benchmarks/): the split
    backward, each W right after its B (`--dpp-defer-weights` defers them as ZB-H1 does, for
    more memory on the later stages), at the slack chosen from the first iterations'
    measurements (on GPUs within 1.15x the activations of megatron-core 1F1B's busiest
    stage; slack 0 where the link is fast). On GPUs with one model chunk it runs its plan in
    order (in the cost order where lengths vary); elsewhere the slack's measurements choose
    the rule too. The split is the default on CPU as well: there it gives the dynamic rule
    its fillers under stragglers and costs nothing calm
    (docs/benchmarks/two_pods_cpu_2026-11-29.md). Returns the lines that say what was
    chosen and why."""
    if not args.use_dpp or args.pipeline_model_parallel_size == 1:
        if args.dpp_split_backward is None:
            args.dpp_split_backward = False
        return []
    lines = []
    if gpu and args.dpp_max_inflight is None and args.dpp_memory_budget is None:
        args.dpp_memory_budget = GPU_MEMORY_BUDGET
        lines.append(f"DPP chooses its slack within {GPU_MEMORY_BUDGET} the activations of "
                     "megatron-core 1F1B's busiest stage (--dpp-memory-budget to change it, "
                     "--dpp-max-inflight N to force a slack)")
    if args.dpp_split_backward is None:
        reasons = _split_conflicts(args, machine)
        args.dpp_split_backward = not reasons
        if reasons:
            return [*lines, _line(SPLIT_BACKWARD, reasons, "--no-dpp-split-backward")]
        lines.append(f"{SPLIT_BACKWARD} on by default with --use-dpp "
                     "(--no-dpp-split-backward for the unsplit backward)")
    if args.dpp_split_backward and args.dpp_defer_weights is None:
        args.dpp_defer_weights = False
        lines.append("DPP runs each W right after its B: every stage holds what megatron-core's "
                     f"1F1B holds there ({MEASURED_DEFERRAL}; --dpp-defer-weights defers them "
                     "as ZB-H1 does, every stage then holding up to stage 0's microbatches)")
    chunks = args.virtual_pipeline_model_parallel_size or 1
    if args.dpp_static is None and gpu and args.dpp_split_backward and chunks == 1:
        args.dpp_static = True
        lines.append(f"DPP runs its plan in order (--dpp-static): {MEASURED_STATIC} "
                     "(--no-dpp-static for the dynamic rule)")
    if gpu and chunks == 1:
        lines.append(f"DPP: {MEASURED_CHUNKS}")
    return lines


def _split_conflicts(args, machine: Machine) -> list[str]:
    checks = (
        (not args.gradient_accumulation_fusion, "--no-gradient-accumulation-fusion (the "
         "split defers the fused weight-gradient GEMMs)"),
        (_transformer_engine_layers(args, machine), "Transformer Engine layers (their own "
         "weight-gradient path)"),
        (args.defer_embedding_wgrad_compute, "--defer-embedding-wgrad-compute (it defers the "
         "output layer's weight gradient itself)"),
    )
    return [reason for bad, reason in checks if bad]


@dataclasses.dataclass(frozen=True)
class ModelFastPath:
    """What the model family changes on the settled fast path: flag values that replace the
    parsed ones in its configurations, and the lines saying why."""

    settings: dict = dataclasses.field(default_factory=dict)
    fallbacks: tuple[str, ...] = ()


def resolve_for_model(args, masked_attention: bool) -> ModelFastPath:
    """The model's part: a model whose blocks take an attention mask (BERT's padding mask)
    would never replay the graphs, which record unmasked blocks only."""
    if not masked_attention or args.cuda_graph_impl != "block":
        return ModelFastPath()
    if not args.cuda_graphs_by_default:
        raise GraphsRefused("--cuda-graph-impl block does not support a model whose blocks "
                            "take an attention mask (BERT's padding mask): use "
                            "--cuda-graph-impl none")
    return ModelFastPath({"cuda_graph_impl": "none"}, (
        _line(CUDA_GRAPHS, ["the model's blocks take an attention mask (BERT's padding mask); "
                            "the graphs record unmasked blocks only"], "--cuda-graph-impl none"),))


_FALLBACK = re.compile(r"^(?P<feature>.+?) off: (?P<reasons>.+) \((?P<switch>--\S+(?: \S+)?) "
                       r"turns it off without this line\)$")


def log_fallbacks(lines: list[str]) -> None:
    """One line per fallback, except that the defaults every CPU run drops for the same
    reason (no GPU) share one line: they say nothing new to someone training on a CPU."""
    by_reason: dict[str, list[str]] = {}
    for line in lines:
        fallback = _FALLBACK.match(line)
        reason = next((shared for shared in (NO_GPU, GLOO_ON_GPU)
                       if fallback and fallback["reasons"].startswith(shared)), None)
        if reason:
            by_reason.setdefault(reason, []).append(fallback["feature"])
        else:
            log.info(line)
    for reason, features in by_reason.items():
        log.info("%s: the GPU defaults are off (%s)", reason, "; ".join(features))


def _graph_conflicts(args, machine: Machine) -> list[str]:
    tp = args.tensor_model_parallel_size
    recompute = args.recompute_activations or args.recompute_granularity is not None
    shapes = _too_many_shapes(args)
    checks = (
        (tp > 1, f"--tensor-model-parallel-size {tp} (the graphs hold no tensor-parallel "
         "collectives)"),
        (recompute, "activation recomputation (--recompute-*)"),
        (args.overlap_grad_reduce, "--overlap-grad-reduce (the backward graph replaces its "
         "per-parameter hooks)"),
        (args.overlap_param_gather, "--overlap-param-gather (its forward pre-hooks do not run "
         "inside a replay)"),
        (shapes is not None, shapes),
        (_transformer_engine_layers(args, machine), "Transformer Engine layers (the graphs "
         "are checked with megatron.core's local layers)"),
        (args.attention_backend == "local", "--attention-backend local (megatron-core's "
         "DotProductAttention is not checked under the graphs)"),
    )
    return [reason for bad, reason in checks if bad]


def _too_many_shapes(args) -> str | None:
    """Why a run of variable lengths has more microbatch shapes than its graphs record by the
    end of the first step (--pad-to-multiple not given: the GPU default), or None."""
    if not (args.seq_length_cv > 0 or args.variable_seq_lengths):
        return None
    multiple = args.pad_to_multiple or GPU_PAD_TO_MULTIPLE
    if args.seq_length / multiple > MAX_WARM_SHAPES:
        return (f"--pad-to-multiple {multiple} leaves more than {MAX_WARM_SHAPES} lengths up "
                f"to --seq-length {args.seq_length} (each would be recorded when it first "
                "comes; a larger multiple buckets them)")
    # a global batch's samples cap the rows; not given, the budget alone bounds them
    samples = args.global_batch_size or args.microbatch_tokens or args.micro_batch_size
    if shapes_by_length(args.seq_length, multiple, args.micro_batch_size,
                        args.microbatch_tokens, samples) is None:
        return (f"--microbatch-tokens {args.microbatch_tokens} allows more than "
                f"{MAX_WARM_SHAPES} shapes (a row count per length in buckets of {multiple}; "
                "each would be recorded when it first comes; a smaller budget or a larger "
                "--pad-to-multiple gives fewer)")
    return None


def _gelu_epilogue_conflicts(args, machine: Machine) -> list[str]:
    """What keeps the MLP off the epilogue GEMMs (gelu_mlp.applies_to, per run)."""
    tp = args.tensor_model_parallel_size
    activation = "--swiglu" if args.swiglu else "--squared-relu" if args.squared_relu else None
    checks = (
        (not machine.gemm_epilogues and machine.cuda, "megatron.trainer.kernels._gemm_epilogues is "
         "not built (installed without CUDA or cuBLASLt's headers: bash prerequisite.sh where "
         "they are)"),
        (_transformer_engine_layers(args, machine), "Transformer Engine layers (their MLP "
         "runs its own GEMMs)"),
        (tp > 1, f"--tensor-model-parallel-size {tp} (the epilogue GEMMs are for one "
         "tensor-parallel rank)"),
        (activation is not None, f"{activation} (the epilogues compute the tanh GeLU)"),
        (args.no_bias_gelu_fusion, "--no-bias-gelu-fusion (the MLP's exact GeLU, not the tanh "
         "one of the epilogues)"),
        (args.disable_bias_linear, "--disable-bias-linear (no fc1 bias for the epilogue)"),
        (args.overlap_param_gather, "--overlap-param-gather (fc1's and fc2's forward "
         "pre-hooks, which wait for their parameters, would be skipped)"),
    )
    return [reason for bad, reason in checks if bad]


def _transformer_engine_layers(args, machine: Machine) -> bool:
    return args.transformer_impl == "transformer_engine" or (
        args.transformer_impl == "auto" and machine.transformer_engine)


def _cross_entropy_conflicts(args, impl: str, machine: Machine) -> list[str]:
    if args.deterministic_mode:  # validation refuses the fused cross-entropy there
        return ["--deterministic-mode (the fused cross-entropy is not among its paths)"]
    if impl == "triton":
        return [] if machine.triton or not machine.cuda else ["Triton is not importable"]
    if impl == "native":  # megatron-core's rounds the logits' gradient to bf16
        return [] if args.bf16 else ["--cross-entropy-fusion-impl native needs --bf16"]
    return [] if machine.transformer_engine else [
        "--cross-entropy-fusion-impl te needs Transformer Engine, which is not importable"]


def _line(feature: str, reasons: list[str], switch_off: str) -> str:
    return f"{feature} off: {'; '.join(reasons)} ({switch_off} turns it off without this line)"
