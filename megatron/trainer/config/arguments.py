"""Command-line flags with Megatron-LM's names, and their validation.

`parse_args()` returns an argparse Namespace, as Megatron users expect; `validate_args`
fills derived values and stops with one message naming every inconsistent flag.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os

from megatron.trainer.config.addresses import is_ip_address
from megatron.trainer.core_compat.reruns import INJECTION_TYPES, MODES
from megatron.trainer.data.batch_schedule import (
    BatchScheduleError,
    StepSchedule,
    batch_size_schedule,
)
from megatron.trainer.data.documents import split_document_ranges
from megatron.trainer.data.tokenizer import TOKENIZER_TYPES

# --pad-to-multiple's default on GPU: at --seq-length 2048, 16 shapes (buckets)
GPU_PAD_TO_MULTIPLE = 128


class ArgumentError(ValueError):
    """Inconsistent or unsupported flags; the message names each flag and value."""


def one_line(problems: list[str]) -> str:
    """The flag problems as one line: every rank of a job prints it, and the launch scripts
    show a repeated line once."""
    return problems[0] if len(problems) == 1 else "invalid arguments: " + "; ".join(problems)


def build_parser(extra_args_provider=None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="MegatronDPP trainer", allow_abbrev=False, conflict_handler="error"
    )
    _model_args(parser.add_argument_group("model"))
    _batch_and_schedule_args(parser.add_argument_group("training"))
    _precision_args(parser.add_argument_group("precision"))
    _parallel_args(parser.add_argument_group("parallelism"))
    _data_args(parser.add_argument_group("data"))
    _io_args(parser.add_argument_group("checkpoints and logging"))
    _add_checkpoint_args(parser.add_argument_group("checkpoint format and behaviour"))
    _dpp_args(parser.add_argument_group("dynamic pipeline (DPP)"))
    _fast_path_args(parser.add_argument_group("fast path defaults (fast_path.py)"))
    _add_logging_args(parser.add_argument_group("logging: TensorBoard and W&B"))
    _add_megatron_lm_args(parser.add_argument_group("further Megatron-LM flags"))
    _add_variable_length_args(parser)
    _add_batch_schedule_args(parser.add_argument_group("step batch-size schedule"))
    _add_core_extras_args(parser.add_argument_group(
        "megatron-core settings and checks of Megatron-LM's functional tests"))
    _add_fim_args(parser.add_argument_group("fill-in-the-middle data (GPT)"))
    _add_rerun_args(parser.add_argument_group("rerun state machine (result validation)"))
    _add_checkpoint_args_and_eval_args(parser.add_argument_group(
        "checkpoint arguments, format detection and evaluation batch size"))
    _add_embedding_wgrad_args(parser.add_argument_group("deferred output-layer weight gradients"))
    _add_mla_args(parser.add_argument_group("multi-latent attention (MLA)"))
    if extra_args_provider is not None:
        extra_args_provider(parser)
    return parser


def _model_args(g):
    g.add_argument("--num-layers", type=int, default=None)
    g.add_argument("--hidden-size", type=int, default=None)
    g.add_argument("--ffn-hidden-size", type=int, default=None)
    g.add_argument("--num-attention-heads", type=int, default=None)
    g.add_argument("--kv-channels", type=int, default=None)
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=None)
    g.add_argument("--seq-length", type=int, default=None)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument(
        "--position-embedding-type", default="learned_absolute",
        choices=["learned_absolute", "rope", "none"],
    )
    g.add_argument("--use-rotary-position-embeddings", action="store_true")
    g.add_argument("--rotary-percent", type=float, default=1.0)
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--normalization", default="LayerNorm", choices=["LayerNorm", "RMSNorm"])
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--disable-bias-linear", action="store_true")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--apply-residual-connection-post-layernorm", action="store_true")
    g.add_argument("--attention-softmax-in-fp32", action="store_true")
    g.add_argument("--no-masked-softmax-fusion", action="store_true")
    g.add_argument("--no-bias-gelu-fusion", action="store_true")
    g.add_argument("--no-bias-dropout-fusion", action="store_true")
    g.add_argument("--cross-entropy-loss-fusion", action="store_true", default=None,
                   help="fused cross-entropy; which one: --cross-entropy-fusion-impl (default: "
                        "on with triton on a GPU with Triton, see fast_path.py)")
    g.add_argument("--cross-entropy-fusion-impl", default=None,
                   choices=["native", "te", "triton"],
                   help="native: megatron-core's torch.compile'd version (--bf16 only); te: "
                        "Transformer Engine's; triton: the project's one pass forward, one "
                        "pass backward (Triton kernels on GPU, torch ops elsewhere; any dtype). "
                        "Default: native with --cross-entropy-loss-fusion, else triton")
    g.add_argument("--use-flash-attn", action="store_true",
                   help="FlashAttention: Transformer Engine's flash backend, or torch's flash "
                        "SDPA kernel with the local layers (CUDA only)")
    g.add_argument(
        "--attention-backend", default="auto",
        choices=["auto", "flash", "fused", "unfused", "local"],
    )
    g.add_argument(
        "--transformer-impl", default="auto", choices=["auto", "local", "transformer_engine"],
        help="auto: Transformer Engine on GPU when importable, else the project's SDPA spec",
    )
    g.add_argument("--use-mcore-models", action="store_true",
                   help="megatron-core's models, the only ones here (deprecated in Megatron-LM, "
                        "where they are the default); contradicts --use-legacy-models")
    g.add_argument("--bert-no-binary-head", action="store_true")
    g.add_argument("--num-tokentypes", type=int, default=2)
    g.add_argument("--mask-prob", type=float, default=0.15)
    g.add_argument("--short-seq-prob", type=float, default=0.1)


def _batch_and_schedule_args(g):
    g.add_argument("--micro-batch-size", type=int, default=1)
    g.add_argument("--global-batch-size", type=int, default=None)
    g.add_argument("--rampup-batch-size", nargs=3, type=int, default=None,
                   metavar=("START", "INCREMENT", "SAMPLES"))
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--train-samples", type=int, default=None)
    g.add_argument("--exit-interval", type=int, default=None)
    g.add_argument("--optimizer", default="adam", choices=["adam", "sgd"])
    g.add_argument("--lr", type=float, default=None)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument(
        "--lr-decay-style", default="linear",
        choices=["constant", "linear", "cosine", "inverse-square-root"],
    )
    g.add_argument("--lr-decay-iters", type=int, default=None)
    g.add_argument("--lr-decay-samples", type=int, default=None)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-fraction", type=float, default=None)
    g.add_argument("--lr-warmup-samples", type=int, default=0)
    g.add_argument("--lr-warmup-init", type=float, default=0.0)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--start-weight-decay", type=float, default=None)
    g.add_argument("--end-weight-decay", type=float, default=None)
    g.add_argument("--weight-decay-incr-style", default="constant",
                   choices=["constant", "linear", "cosine"])
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--megatron-optimizer-fallbacks", action="store_true",
                   help="keep megatron-core's no-apex grad-norm/scale loops and foreach Adam "
                        "(default: torch foreach norm/scale, fused Adam on GPU)")
    g.add_argument("--sgd-momentum", type=float, default=0.9)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--recompute-activations", action="store_true")
    g.add_argument("--recompute-granularity", default=None, choices=["full", "selective"])
    g.add_argument("--recompute-method", default=None, choices=["uniform", "block"])
    g.add_argument("--recompute-num-layers", type=int, default=None)
    g.add_argument("--no-gradient-accumulation-fusion", dest="gradient_accumulation_fusion",
                   action="store_false",
                   help="add each weight gradient to main_grad in a second kernel instead of "
                        "in the GEMM (the fusion runs on GPU only)")
    g.add_argument("--cuda-graph-impl", default="auto",
                   choices=["auto", "none", "block", "local", "transformer_engine"],
                   help="block: CUDA graphs of each chunk's transformer block, one pair per "
                        "microbatch in flight, replayed in any order (also with --use-dpp); "
                        "megatron-core's local / transformer_engine graphs are not supported. "
                        "auto (default): block where the run allows it, else none")
    g.add_argument("--cuda-graph-memory-limit", type=float, default=None, metavar="GIB",
                   help="--cuda-graph-impl block with variable lengths: the GiB one rank's "
                        "graph recordings (one set of slots per length bucket) may hold; a "
                        "bucket past it runs eagerly, with one log line (default: no bound)")


def _precision_args(g):
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--loss-scale", type=float, default=None)
    g.add_argument("--initial-loss-scale", type=float, default=2.0**32)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=float, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true")
    g.add_argument("--fp32-residual-connection", action="store_true")


def _parallel_args(g):
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    g.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=None)
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None,
                   help="transformer layers on the first pipeline stage; the others share "
                        "the rest evenly (default: even split over all stages)")
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None,
                   help="transformer layers on the last pipeline stage; the others share "
                        "the rest evenly (default: even split over all stages)")
    g.add_argument("--account-for-embedding-in-pipeline-split", action="store_true",
                   help="count the embedding as one layer when splitting layers over stages")
    g.add_argument("--account-for-loss-in-pipeline-split", action="store_true",
                   help="count the output layer and loss as one layer when splitting layers "
                        "over stages")
    g.add_argument("--context-parallel-size", type=int, default=1)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--overlap-param-gather", action="store_true")
    g.add_argument("--distributed-backend", default=None, choices=["nccl", "gloo"])
    g.add_argument("--distributed-timeout-minutes", type=float, default=10)
    g.add_argument("--local-rank", "--local_rank", type=int, default=None)
    g.add_argument("--no-batch-p2p-comm", action="store_true",
                   help="megatron-core schedules: unbatched p2p (chosen automatically at PP=2 with "
                        "virtual stages, where batched p2p gives wrong gradients)")
    g.add_argument("--batch-p2p-sync", action="store_true",
                   help="megatron-core schedules: synchronise the device after each batched "
                        "p2p exchange (an old PyTorch workaround; it stalls the host each time)")


def _data_args(g):
    g.add_argument("--data-path", nargs="*", default=None,
                   help="prefixes written by tools/preprocess_data.py, optionally weighted: "
                        "'0.3 a_text_document 0.7 b_text_document'")
    g.add_argument("--split", default="969,30,1")
    g.add_argument("--mock-data", action="store_true")
    g.add_argument("--data-cache-path", default=None)
    g.add_argument("--num-workers", type=int, default=0,
                   help="processes that read and collate the samples ahead of the step (0: the "
                        "training process reads them itself)")
    g.add_argument("--tokenizer-type", default=None, choices=TOKENIZER_TYPES)
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument("--vocab-size", type=int, default=None)
    g.add_argument("--reset-position-ids", action="store_true")
    g.add_argument("--reset-attention-mask", action="store_true")
    g.add_argument("--eod-mask-loss", action="store_true")
    g.add_argument("--seq-length-cv", type=float, default=0.0,
                   help="synthetic variable-length microbatches (mock data too): lognormal "
                        "CV of each microbatch's token count, mean half of --seq-length; "
                        "0 = fixed length")


def _io_args(g):
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--no-save-optim", action="store_true")
    g.add_argument("--finetune", action="store_true")
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--log-throughput", action="store_true")
    g.add_argument("--timing-log-level", type=int, default=0, choices=[0, 1, 2],
                   help="timers recorded: 0 the iteration time; 1 also forward-backward, "
                        "optimizer and megatron-core's level-1 timers; 2 also its per-"
                        "microbatch compute and p2p timers (each timer synchronises the GPU)")
    g.add_argument("--trace", action="store_true",
                   help="record per-rank pipeline spans (docs/profiling.md)")
    g.add_argument("--trace-dir", default=None,
                   help="where --trace writes trace-rank<R>.jsonl (default: traces)")
    g.add_argument("--trace-iters", type=int, nargs="+", default=None, metavar="N",
                   help="iterations to trace, counted from 1 (default: all)")
    g.add_argument("--manual-gc", action="store_true",
                   help="Python's garbage collector only at start, every "
                        "--manual-gc-interval iterations and around evaluation")
    g.add_argument("--manual-gc-interval", type=int, default=0,
                   help="iterations between collections with --manual-gc (0: none)")
    g.add_argument("--no-manual-gc-eval", dest="manual_gc_eval", action="store_false",
                   help="with --manual-gc, no collection around evaluation")
    g.add_argument("--profile", action="store_true",
                   help="profile iterations [--profile-step-start, --profile-step-end)")
    g.add_argument("--use-pytorch-profiler", action="store_true",
                   help="--profile with torch.profiler (else cudaProfilerStart/Stop for nsys)")
    g.add_argument("--profile-step-start", type=int, default=10)
    g.add_argument("--profile-step-end", type=int, default=12)
    g.add_argument("--profile-ranks", type=int, nargs="+", default=[0])
    g.add_argument("--profile-dir", default=None,
                   help="torch.profiler output (default: --tensorboard-dir, else profile)")


def _dpp_args(g):
    g.add_argument("--use-dpp", action="store_true",
                   help="dynamic pipeline schedule instead of megatron-core's static one")
    g.add_argument("--dpp-max-inflight", type=int, default=None,
                   help="extra microbatches in flight beyond the static schedule's count")
    g.add_argument("--dpp-transport", default="auto", choices=["auto", "torch", "shm", "rdma"])
    g.add_argument("--dpp-timeout", type=float, default=60.0,
                   help="seconds a stage waits for a pipeline peer before raising")
    g.add_argument("--dpp-split-backward", action=argparse.BooleanOptionalAction, default=None,
                   help="split each backward into input gradients (B) and deferred weight "
                        "gradients (W): with --use-dpp the dynamic schedule places the W "
                        "tasks; at PP=1 each W runs right after its B (default: on with "
                        "--use-dpp on GPUs where the layers allow it, fast_path.py)")
    g.add_argument("--dpp-static", action=argparse.BooleanOptionalAction, default=None,
                   help="with --use-dpp: run the DPP plan (1F1B, interleaved, ZB-H1 with the "
                        "split) in order, never deviating: the static schedule on the same "
                        "runtime (default: on for one model chunk of uniform lengths on GPUs, "
                        "where it measured faster; fast_path.py)")
    g.add_argument("--multi-node", action="store_true",
                   help="the job spans nodes: checked against torchrun's WORLD_SIZE and "
                        "LOCAL_WORLD_SIZE at start-up")
    g.add_argument("--node-ips", nargs="+", default=None,
                   help="one address per node, in node-rank order; checked against the node "
                        "count and MASTER_ADDR (node 0)")
    g.add_argument("--workload", type=int, default=None, help=argparse.SUPPRESS)
    g.add_argument("--num-gpus", type=int, default=None, help=argparse.SUPPRESS)


def _fast_path_args(g):
    g.add_argument("--no-cross-entropy-loss-fusion", dest="cross_entropy_loss_fusion",
                   action="store_false", default=None,
                   help="megatron-core's unfused cross-entropy even where the fused one is "
                        "the default")
    g.add_argument("--no-triton-fusions", dest="triton_fusions", action="store_false",
                   default=None,
                   help="torch's layer norm and megatron-core's torch.compile'd "
                        "bias-dropout-add and bias-GeLU, not the project's Triton kernels "
                        "(the default on a GPU with Triton; fast_path.py)")
    g.add_argument("--no-gelu-gemm-epilogue", dest="gelu_gemm_epilogue", action="store_false",
                   default=None,
                   help="fc1's GEMM then a separate bias-GeLU kernel, not cuBLASLt's "
                        "bias-GeLU epilogue (the default on a GPU for the local layers' MLP; "
                        "fast_path.py)")


CKPT_FORMATS = ("torch_dist", "torch")
DIST_CKPT_STRICTNESS = (
    "assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected", "raise_all",
    "return_unexpected", "return_all", "ignore_all",
)


def _add_checkpoint_args(g):
    """Megatron-LM's checkpoint flags; megatron/trainer/checkpoint/checkpoint_config.py says
    what each does here."""
    g.add_argument("--ckpt-format", default="torch_dist",
                   choices=[*CKPT_FORMATS, "torch_dcp", "fsdp_dtensor"],
                   help="torch_dist: megatron.core.dist_checkpointing (sharded, reshardable); "
                        "torch: one torch.save file per model-parallel rank (Megatron-LM's "
                        "legacy layout). --load reads either")
    g.add_argument("--async-save", action="store_true",
                   help="write torch_dist checkpoints in a background process "
                        "(megatron.core's AsyncCallsQueue); published once every rank is done")
    g.add_argument("--use-persistent-ckpt-worker", action="store_true",
                   help="--async-save through one long-lived writer process per rank (GPU only)")
    g.add_argument("--dist-ckpt-strictness", default="assume_ok_unexpected",
                   choices=DIST_CKPT_STRICTNESS,
                   help="key mismatches between a torch_dist checkpoint and the model "
                        "(megatron.core's StrictHandling; 'unexpected': asked for but absent "
                        "from the checkpoint, 'missing': in the checkpoint but not asked for)")
    g.add_argument("--ckpt-fully-parallel-save", dest="ckpt_fully_parallel_save",
                   action="store_true", default=True,
                   help="spread the writes of replicated tensors over the data-parallel ranks "
                        "(the default)")
    g.add_argument("--no-ckpt-fully-parallel-save", dest="ckpt_fully_parallel_save",
                   action="store_false",
                   help="data-parallel rank 0 writes every replicated tensor")
    g.add_argument("--ckpt-fully-parallel-load", action="store_true",
                   help="each data-parallel rank reads a share of a torch_dist checkpoint and "
                        "they exchange the rest")
    g.add_argument("--dist-ckpt-optim-fully-reshardable", action="store_true",
                   help="distributed optimizer state saved fully reshardable (TP/PP/DP) "
                        "instead of data-parallel reshardable")
    g.add_argument("--use-checkpoint-opt_param-scheduler", action="store_true",
                   help="take the lr / weight-decay schedule from the checkpoint")
    g.add_argument("--override-opt_param-scheduler", action="store_true",
                   help="take the lr / weight-decay schedule from the flags, not the checkpoint")
    g.add_argument("--save-retain-interval", type=int, default=None,
                   help="after each save, delete the previous checkpoint unless its iteration "
                        "is a multiple of this")
    g.add_argument("--non-persistent-save-interval", type=int, default=None,
                   help="iterations between non-persistent saves (only the latest is kept)")
    g.add_argument("--non-persistent-ckpt-type", default=None,
                   choices=["global", "local", "in_memory"])
    g.add_argument("--non-persistent-global-ckpt-dir", default=None,
                   help="where non-persistent global checkpoints go (default: SAVE/non_persistent)")


def parse_args(argv=None, extra_args_provider=None, world_size=None,
               model: str = "gpt") -> argparse.Namespace:
    """`model` ("gpt" or "bert", the entry point) picks the defaults that differ by model,
    as Megatron-LM's pretrain_gpt.py and pretrain_bert.py do (the tokenizer)."""
    parser = build_parser(extra_args_provider)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        raise ArgumentError(f"unknown flags: {' '.join(unknown)}")
    _apply_checkpoint_args(args)
    world = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    validate_args(args, world, model)
    return args


def validate_args(args, world_size: int, model: str = "gpt") -> None:
    """Fill derived values; raise ArgumentError listing every problem found."""
    args.model = model
    _require_model_shape(args)
    _check_ranges(args)
    _resolve_fast_path(args)
    problems: list[str] = []

    def need(ok: bool, message: str):
        if not ok:
            problems.append(message)

    tp, pp, cp = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                  args.context_parallel_size)
    need(cp == 1, f"--context-parallel-size {cp}: only 1 is supported")
    model_parallel = tp * pp * cp
    need(world_size % model_parallel == 0,
         f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
         f"--pipeline-model-parallel-size {pp}")
    args.world_size = world_size
    args.data_parallel_size = max(1, world_size // model_parallel)

    need(args.num_attention_heads % tp == 0,
         f"--tensor-model-parallel-size {tp} does not divide --num-attention-heads "
         f"{args.num_attention_heads}")
    need(args.hidden_size % args.num_attention_heads == 0,
         f"--num-attention-heads {args.num_attention_heads} does not divide --hidden-size "
         f"{args.hidden_size}")
    if args.num_query_groups is None or not args.group_query_attention:
        args.num_query_groups = args.num_attention_heads
    need(args.num_attention_heads % args.num_query_groups == 0 and args.num_query_groups % tp == 0,
         f"--num-query-groups {args.num_query_groups} must divide --num-attention-heads "
         f"{args.num_attention_heads} and be divisible by --tensor-model-parallel-size {tp}")
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = (
            int(8 * args.hidden_size / 3 / 64 + 0.999) * 64 if args.swiglu else 4 * args.hidden_size
        )
    if args.kv_channels is None:
        args.kv_channels = args.hidden_size // args.num_attention_heads
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.use_rotary_position_embeddings:
        args.position_embedding_type = "rope"
    need(args.position_embedding_type != "learned_absolute"
         or args.seq_length <= args.max_position_embeddings,
         f"--seq-length {args.seq_length} exceeds --max-position-embeddings "
         f"{args.max_position_embeddings}")

    _resolve_megatron_lm_aliases(args, need)
    _validate_virtual_pipeline(args, need)
    _resolve_step_batch_schedule(args, need)
    ramp_sound = _validate_batch(args, need)
    _validate_precision(args, need)
    _validate_schedule(args, need)
    _validate_step_batch_schedule(args, need)
    if ramp_sound and args.train_iters is not None:
        _validate_microbatches(args, need)
    _validate_data(args, need)
    _validate_megatron_lm_flags(args, need)
    _validate_logging(args, need)
    _validate_core_extras(args, need)
    _validate_reruns(args, need)
    _validate_embedding_wgrad(args, need)
    _validate_mla(args, need)
    _validate_dpp(args, need)
    _validate_variable_lengths(args, need)
    _validate_trace(args, need)
    _validate_fim(args, need)

    if args.sequence_parallel and tp == 1:
        args.sequence_parallel = False
    if args.recompute_activations:
        args.recompute_granularity = "selective"
    need(args.recompute_granularity != "full" or args.recompute_method is not None,
         "--recompute-granularity full needs --recompute-method uniform|block")
    if args.distributed_backend is None:
        args.distributed_backend = "nccl" if _cuda_available() else "gloo"
    need(args.save_interval is None or args.save is not None,
         f"--save-interval {args.save_interval} needs --save DIR")
    _validate_cuda_graphs(args, need)
    _validate_checkpointing(args, need)
    _validate_checkpoint_args_and_eval(args, need)
    if problems:
        raise ArgumentError(one_line(problems))


def _validate_virtual_pipeline(args, need):
    pp = args.pipeline_model_parallel_size
    vpp = args.virtual_pipeline_model_parallel_size
    per_stage = args.num_layers_per_virtual_pipeline_stage
    uneven = {flag: value for flag, value in (
        ("--decoder-first-pipeline-num-layers", args.decoder_first_pipeline_num_layers),
        ("--decoder-last-pipeline-num-layers", args.decoder_last_pipeline_num_layers),
    ) if value is not None}
    if per_stage is not None:
        need(pp > 1, "--num-layers-per-virtual-pipeline-stage needs "
             "--pipeline-model-parallel-size > 1")
    if vpp is not None and vpp > 1:
        need(pp > 1, f"--virtual-pipeline-model-parallel-size {vpp} needs "
             "--pipeline-model-parallel-size > 1")
    if uneven:
        need(per_stage is None,
             f"--num-layers-per-virtual-pipeline-stage {per_stage} cannot be combined with "
             f"{' and '.join(uneven)} (the stages hold different numbers of layers); give "
             "--virtual-pipeline-model-parallel-size (chunks per stage) instead")
        _validate_uneven_split(args, need, uneven, vpp if vpp is not None and vpp > 1 else None)
        per_stage = None
    # the embedding and the output layer + loss count as one layer each where asked to
    accounted = [flag for flag, on in (
        ("--account-for-embedding-in-pipeline-split", args.account_for_embedding_in_pipeline_split),
        ("--account-for-loss-in-pipeline-split", args.account_for_loss_in_pipeline_split),
    ) if on]
    layers = args.num_layers + len(accounted)
    counted = f"--num-layers {args.num_layers}" + "".join(f" + 1 ({flag})" for flag in accounted)
    if not uneven:
        need(layers % pp == 0,
             f"{counted} is not divisible by --pipeline-model-parallel-size {pp}")
    if per_stage is not None:
        need(layers % (pp * per_stage) == 0,
             f"{counted} is not divisible by --pipeline-model-parallel-size {pp} x "
             f"--num-layers-per-virtual-pipeline-stage {per_stage}")
        derived = max(1, layers // (pp * per_stage))
        need(vpp is None or vpp == derived,
             f"--virtual-pipeline-model-parallel-size {vpp} contradicts "
             f"--num-layers-per-virtual-pipeline-stage {per_stage} ({derived} chunks)")
        vpp = derived
    elif vpp is not None and not uneven:
        need(layers % (pp * vpp) == 0,
             f"{counted} is not divisible by --pipeline-model-parallel-size {pp} x "
             f"--virtual-pipeline-model-parallel-size {vpp}")
    if vpp is not None and vpp <= 1:
        vpp = None
    args.virtual_pipeline_model_parallel_size = vpp


def _validate_uneven_split(args, need, uneven: dict, vpp):
    """--decoder-first/last-pipeline-num-layers: megatron-core's rules for an uneven split
    (TransformerConfig.__post_init__, get_num_layers_to_build, get_transformer_layer_offset).
    The stages without a given count share the remaining layers evenly, and with virtual
    stages every stage's count divides into `vpp` equal chunks."""
    pp, layers = args.pipeline_model_parallel_size, args.num_layers
    given = " and ".join(f"{flag} {value}" for flag, value in uneven.items())
    need(pp > 1, f"{given}: an uneven split needs --pipeline-model-parallel-size > 1")
    for flag, on in (
        ("--account-for-embedding-in-pipeline-split", args.account_for_embedding_in_pipeline_split),
        ("--account-for-loss-in-pipeline-split", args.account_for_loss_in_pipeline_split),
    ):
        need(not on, f"{given} and {flag} are mutually exclusive")
    for flag, value in uneven.items():
        need(value >= 1, f"{flag} {value} must be >= 1")
        need(vpp is None or value % vpp == 0,
             f"{flag} {value} is not divisible by --virtual-pipeline-model-parallel-size {vpp}")
    if pp <= 1 or min(uneven.values()) < 1:
        return
    rest_layers = layers - sum(uneven.values())
    rest_stages = pp - len(uneven)
    if rest_stages == 0:
        need(rest_layers == 0, f"{given} must add up to --num-layers {layers}: "
             f"--pipeline-model-parallel-size {pp} has no other stage")
        # megatron-core 0.16.1's layer offset then divides by the zero middle stages
        need(vpp is None, f"{given} with --virtual-pipeline-model-parallel-size {vpp} and "
             f"--pipeline-model-parallel-size {pp}: megatron-core cannot place the layers "
             "when both are given; give only one of the two")
        return
    minus = " minus ".join(f"{flag} {value}" for flag, value in uneven.items())
    left = (f"--num-layers {layers} minus {minus} leaves {rest_layers} layers for the "
            f"{rest_stages} remaining stages of --pipeline-model-parallel-size {pp}")
    even = rest_layers > 0 and rest_layers % rest_stages == 0
    need(even, f"{left}: they must divide evenly, at least one layer each")
    if even and vpp is not None:
        per_stage = rest_layers // rest_stages
        need(per_stage % vpp == 0, f"{left}: {per_stage} per stage is not divisible by "
             f"--virtual-pipeline-model-parallel-size {vpp}")


def _validate_batch(args, need) -> bool:
    """False where the ramp-up cannot be followed (its batch sizes are unknown)."""
    dp, mbs = args.data_parallel_size, args.micro_batch_size
    if args.global_batch_size is None:
        args.global_batch_size = mbs * dp
    gbs = args.global_batch_size
    need(gbs % (mbs * dp) == 0,
         f"--global-batch-size {gbs} is not divisible by --micro-batch-size {mbs} x "
         f"data-parallel size {dp}")
    args.num_microbatches = max(1, gbs // (mbs * dp))
    if args.rampup_batch_size is None:
        return True
    start, increment, _ = args.rampup_batch_size
    ramp = "--rampup-batch-size " + " ".join(map(str, args.rampup_batch_size))
    # megatron-core's ramp-up divides by the number of increments
    need(start < gbs, f"{ramp}: the start must be below --global-batch-size {gbs}")
    need((gbs - start) % increment == 0,
         f"{ramp}: --global-batch-size {gbs} minus the start is not a multiple of the "
         "increment")
    return start < gbs and (gbs - start) % increment == 0


def _validate_microbatches(args, need):
    """Every global batch size the run uses (the ramp-up's included) must split into
    micro-batches over the data-parallel ranks; with virtual stages, megatron-core's
    interleaved schedule and the DPP policy (StageConfig) both run the microbatches in
    groups of --pipeline-model-parallel-size and need a multiple of it."""
    dp, mbs = args.data_parallel_size, args.micro_batch_size
    interleaved = args.virtual_pipeline_model_parallel_size is not None
    for size, iteration in _global_batch_sizes(args).items():
        if args.rampup_batch_size is None:
            what = f"--global-batch-size {size}"
        else:
            what = (f"--rampup-batch-size {' '.join(map(str, args.rampup_batch_size))}: global "
                    f"batch size {size} (from iteration {iteration})")
        if size % (mbs * dp) != 0:
            # the full --global-batch-size has been named already (_validate_batch)
            need(size == args.global_batch_size, f"{what} is not divisible by "
                 f"--micro-batch-size {mbs} x data-parallel size {dp}")
            continue
        count = size // (mbs * dp)
        # --microbatch-group-size-per-virtual-pipeline-stage: megatron-core's own rule
        problem = _interleaved_group_problem(args, count) if interleaved else None
        need(problem is None,
             f"{what} gives {count} microbatches (--micro-batch-size {mbs} x data-parallel size "
             f"{dp}); with virtual pipeline stages megatron-core's interleaved schedule and "
             f"--use-dpp both need {problem}")


def _global_batch_sizes(args) -> dict[int, int]:
    """Each global batch size the run uses -> the first iteration (from 1) that uses it,
    following megatron-core's RampupBatchsizeNumMicroBatchesCalculator."""
    gbs = args.global_batch_size
    if args.rampup_batch_size is None:
        return {gbs: 1}
    start, increment, samples = args.rampup_batch_size
    samples_per_increment = samples / ((gbs - start) // increment)
    sizes, consumed = {}, 0
    for iteration in range(1, args.train_iters + 1):
        if consumed > samples:
            size = gbs
        else:
            size = start + int(consumed / samples_per_increment) * increment
        sizes.setdefault(size, iteration)
        if size == gbs:
            break
        consumed += size
    return sizes


# flags that take numbers within a range (None, not given, passes)
_AT_LEAST_ONE = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "kv_channels",
    "num_query_groups", "seq_length", "max_position_embeddings", "vocab_size",
    "make_vocab_size_divisible_by", "micro_batch_size", "global_batch_size", "train_iters",
    "train_samples", "lr_decay_iters", "lr_decay_samples", "tensor_model_parallel_size",
    "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
    "num_layers_per_virtual_pipeline_stage", "context_parallel_size", "recompute_num_layers",
    "log_interval", "save_interval", "exit_interval", "hysteresis", "rotary_base",
)
_AT_LEAST_ZERO = (
    "lr", "min_lr", "lr_warmup_iters", "lr_warmup_samples", "lr_warmup_init", "weight_decay",
    "start_weight_decay", "end_weight_decay", "clip_grad", "sgd_momentum", "seed",
    "eval_iters", "eval_interval", "num_workers", "min_loss_scale", "num_tokentypes",
)
_ABOVE_ZERO = (
    "dpp_timeout", "distributed_timeout_minutes", "adam_eps", "norm_epsilon",
    "init_method_std", "initial_loss_scale", "loss_scale", "loss_scale_window",
)
_FROM_ZERO_BELOW_ONE = ("hidden_dropout", "attention_dropout", "adam_beta1", "adam_beta2")
_FROM_ZERO_TO_ONE = ("lr_warmup_fraction", "mask_prob", "short_seq_prob")


def _check_ranges(args) -> None:
    """Numbers outside their range, all named at once, before anything divides by them."""
    problems = []
    for names, ok, wanted in (
        (_AT_LEAST_ONE, lambda v: v >= 1, "must be >= 1"),
        (_AT_LEAST_ZERO, lambda v: v >= 0, "must be >= 0"),
        (_ABOVE_ZERO, lambda v: v > 0, "must be > 0"),
        (_FROM_ZERO_BELOW_ONE, lambda v: 0 <= v < 1, "must be in [0, 1)"),
        (_FROM_ZERO_TO_ONE, lambda v: 0 <= v <= 1, "must be in [0, 1]"),
    ):
        for name in names:
            value = getattr(args, name)
            if value is not None and not ok(value):
                problems.append(f"--{name.replace('_', '-')} {value} {wanted}")
    if not 0 < args.rotary_percent <= 1:
        problems.append(f"--rotary-percent {args.rotary_percent} must be in (0, 1]")
    if args.rampup_batch_size is not None and min(args.rampup_batch_size) < 1:
        problems.append(f"--rampup-batch-size {' '.join(map(str, args.rampup_batch_size))}: "
                        "start, increment and samples must be >= 1")
    # numpy seeds each pipeline stage with --seed + 100 x its rank (initialize.set_seeds)
    top = 2**32 - 100 * args.pipeline_model_parallel_size
    if args.seed >= top:
        problems.append(f"--seed {args.seed} must be below {top} (numpy's seeds are 32-bit, and "
                        "each pipeline stage adds 100 x its rank)")
    if problems:
        raise ArgumentError(one_line(problems))


def _validate_precision(args, need):
    need(not (args.fp16 and args.bf16), "--fp16 and --bf16 are mutually exclusive")
    import torch

    args.params_dtype = torch.float16 if args.fp16 else torch.bfloat16 if args.bf16 else torch.float32
    if args.bf16:
        args.accumulate_allreduce_grads_in_fp32 = True
    # megatron-core's native fused cross-entropy hands back the logits' gradient in bf16
    need(not args.cross_entropy_loss_fusion or args.cross_entropy_fusion_impl != "native"
         or args.bf16,
         "--cross-entropy-loss-fusion (native) needs --bf16: megatron-core's fused "
         "cross-entropy returns the logits' gradient in bf16, which would round an fp32 or "
         "fp16 model's gradient silently")
    need(not args.cross_entropy_loss_fusion or args.cross_entropy_fusion_impl != "te"
         or importlib.util.find_spec("transformer_engine") is not None,
         "--cross-entropy-fusion-impl te needs Transformer Engine, which is not importable")


def _validate_schedule(args, need):
    need((args.train_iters is None) != (args.train_samples is None),
         "exactly one of --train-iters and --train-samples is needed")
    if args.train_iters is None and args.train_samples is not None:
        args.train_iters = args.train_samples // args.global_batch_size
        need(args.train_iters > 0, f"--train-samples {args.train_samples} is less than one "
             f"global batch (--global-batch-size {args.global_batch_size})")
    need(args.lr is not None, "--lr is required")
    need(args.lr_warmup_fraction is None or args.lr_warmup_iters == 0,
         f"--lr-warmup-fraction {args.lr_warmup_fraction} and --lr-warmup-iters "
         f"{args.lr_warmup_iters} are mutually exclusive")
    if args.start_weight_decay is None:
        args.start_weight_decay = args.weight_decay
    if args.end_weight_decay is None:
        args.end_weight_decay = args.weight_decay


def _validate_data(args, need):
    chosen = args.tokenizer_type is not None
    if not chosen:
        args.tokenizer_type = _default_tokenizer(args)
    need(args.mock_data or args.data_path,
         "no data: give --data-path PREFIX [...] or --mock-data")
    need(not (args.mock_data and args.data_path),
         "--mock-data and --data-path are mutually exclusive")
    if args.tokenizer_type == "NullTokenizer" and args.vocab_size is None:
        # name what the user typed: the tokenizer only where they chose it
        need(False, "--tokenizer-type NullTokenizer needs --vocab-size N" if chosen else
             f"{args.model.upper()} with --mock-data and no tokenizer files needs --vocab-size "
             "N (or give --vocab-file" + (")" if args.model == "bert" else
                                          " and --merge-file, or --tokenizer-type)"))
    if args.data_path:
        _parse_blend(args, need)
        try:
            split_document_ranges(args.split, 1)  # megatron.core reads "abc" as NaN weights
        except ValueError as error:
            need(False, str(error))
    need(args.seq_length_cv >= 0, f"--seq-length-cv {args.seq_length_cv} must be >= 0")
    # megatron-core exchanges the shapes of variable-length microbatches in one batched p2p
    # call, which at PP=2 with virtual stages swaps the activation's and the gradient's
    need(args.seq_length_cv == 0 or args.use_dpp or args.pipeline_model_parallel_size != 2
         or args.virtual_pipeline_model_parallel_size is None,
         f"--seq-length-cv {args.seq_length_cv} with megatron-core's interleaved schedule at "
         "--pipeline-model-parallel-size 2: its batched shape exchange with the one neighbour "
         "mixes up activation and gradient shapes; use --use-dpp (or more pipeline stages)")


def _parse_blend(args, need):
    items = args.data_path
    if len(items) > 1 and _is_number(items[0]):
        need(len(items) % 2 == 0,
             f"--data-path with weights needs WEIGHT PREFIX pairs, got {len(items)} items")
        weights = [float(w) for w in items[0::2] if _is_number(w)]
        need(len(weights) == len(items) // 2,
             f"--data-path {' '.join(items)}: every other item must be a weight")
        args.data_blend = (items[1::2], weights)
    else:
        args.data_blend = (items, None)


def _validate_dpp(args, need):
    if args.workload is not None:
        need(False, f"--workload {args.workload}: no longer used; the native transport sizes its "
             "copies itself (see --dpp-transport)")
    if args.num_gpus is not None:
        need(False, f"--num-gpus {args.num_gpus}: no longer used; torchrun's --nproc_per_node "
             "sets the GPUs per node")
    if args.dpp_max_inflight is not None:
        need(args.dpp_max_inflight >= 0,
             f"--dpp-max-inflight {args.dpp_max_inflight} must be >= 0")
    need(not args.dpp_static or args.use_dpp, "--dpp-static needs --use-dpp")
    if args.use_dpp:
        need(args.pipeline_model_parallel_size > 1,
             "--use-dpp needs --pipeline-model-parallel-size > 1 (nothing to schedule otherwise)")
        need(not args.overlap_param_gather,
             "--overlap-param-gather is not supported with --use-dpp (the dynamic order has no "
             "fixed first forward per chunk to gather parameters before)")
    if args.dpp_split_backward:
        need(args.pipeline_model_parallel_size == 1 or args.use_dpp,
             "--dpp-split-backward at --pipeline-model-parallel-size > 1 needs --use-dpp "
             "(megatron-core's pipeline schedules cannot place W tasks)")
        need(args.gradient_accumulation_fusion, "--dpp-split-backward defers the fused "
             "weight-gradient accumulation: drop --no-gradient-accumulation-fusion")
        need(args.transformer_impl != "transformer_engine", "--dpp-split-backward with "
             "Transformer Engine layers (their own weight-gradient path): use --transformer-impl local")
    if args.multi_node:
        need(bool(args.node_ips), "--multi-node needs --node-ips ADDR [ADDR ...]")
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
        need(local <= 0 or args.world_size > local,
             f"--multi-node but the job runs on one node (WORLD_SIZE {args.world_size}, "
             f"LOCAL_WORLD_SIZE {local})")
    if args.node_ips:
        for ip in args.node_ips:
            need(is_ip_address(ip), f"--node-ips: '{ip}' is not an IP address")
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
        if local > 0:
            nnodes = args.world_size // local
            need(nnodes == len(args.node_ips),
                 f"--node-ips lists {len(args.node_ips)} addresses but the job has {nnodes} "
                 f"nodes (WORLD_SIZE {args.world_size} / LOCAL_WORLD_SIZE {local})")


def _add_variable_length_args(parser):
    g = parser.add_argument_group("variable sequence lengths")
    g.add_argument("--variable-seq-lengths", action="store_true",
                   help="GPT: one document per sample (cut at --seq-length, never packed), "
                        "each microbatch padded to its own longest sample, padding out of "
                        "the loss; the loss is per token (calculate_per_token_loss)")
    g.add_argument("--group-by-length", action="store_true",
                   help="with --variable-seq-lengths: microbatches of samples of similar "
                        "length within each global batch (the same samples, less padding; "
                        "docs/variable_lengths.md)")
    g.add_argument("--pad-to-multiple", type=int, default=None,
                   help="with --variable-seq-lengths or --seq-length-cv: round each "
                        "microbatch's length up to this multiple, so that few shapes (buckets) "
                        f"occur (default {GPU_PAD_TO_MULTIPLE} on GPU, 1 on CPU; with "
                        "--sequence-parallel also a multiple of the tensor-parallel size)")
    g.add_argument("--microbatch-tokens", type=int, default=None,
                   help="with --variable-seq-lengths: form microbatches by this budget of "
                        "padded tokens (rows x length) instead of --micro-batch-size rows; "
                        "the number of microbatches then varies between iterations")
    g.add_argument("--microbatch-order", choices=("natural", "cost"), default=None,
                   help="the order an iteration's microbatches run in: cost = by their token "
                        "counts, cheap first and last (megatron-core's schedules too); "
                        "default cost with --use-dpp, natural otherwise")


def _validate_variable_lengths(args, need):
    variable = args.variable_seq_lengths
    if variable:
        for bad, why in (
            (args.mock_data or not args.data_path, "needs --data-path (documents of a "
             ".bin/.idx prefix; --mock-data has no documents)"),
            (args.seq_length_cv > 0, "and --seq-length-cv are two sources of lengths: give "
             "one"),
            (args.rampup_batch_size is not None, "with --rampup-batch-size: the microbatches "
             "of a global batch are planned from a fixed global batch size"),
            (args.reset_position_ids or args.reset_attention_mask, "with --reset-position-ids"
             " / --reset-attention-mask: each sample is one document already"),
            (not args.use_dpp and args.pipeline_model_parallel_size == 2
             and args.virtual_pipeline_model_parallel_size is not None,
             "with megatron-core's interleaved schedule at --pipeline-model-parallel-size 2: "
             "its batched shape exchange with the one neighbour mixes up activation and "
             "gradient shapes; use --use-dpp (or more pipeline stages)"),
        ):
            need(not bad, f"--variable-seq-lengths {why}")
    else:
        for flag, given in (("--group-by-length", args.group_by_length),
                            ("--microbatch-tokens", args.microbatch_tokens is not None)):
            need(not given, f"{flag} needs --variable-seq-lengths")
        need(args.pad_to_multiple is None or args.seq_length_cv > 0,
             "--pad-to-multiple needs --variable-seq-lengths or --seq-length-cv")
    if args.pad_to_multiple is None:
        # few shapes on GPU: each new one costs compilation, plans and graphs there
        args.pad_to_multiple = GPU_PAD_TO_MULTIPLE if _cuda_available() else 1
    need(args.pad_to_multiple >= 1, f"--pad-to-multiple {args.pad_to_multiple} must be >= 1")
    tp = args.tensor_model_parallel_size
    if variable and args.sequence_parallel and tp > 1 and args.pad_to_multiple >= 1:
        # sequence parallelism splits each microbatch's sequence across the TP ranks
        args.pad_to_multiple = math.lcm(args.pad_to_multiple, tp)
        need(args.seq_length % tp == 0, f"--variable-seq-lengths --sequence-parallel: "
             f"--seq-length {args.seq_length} must be a multiple of "
             f"--tensor-model-parallel-size {tp} (the longest microbatches are cut there)")
    if args.microbatch_tokens is not None:
        _validate_microbatch_tokens(args, need)
    lengths_vary = variable or args.seq_length_cv > 0
    if args.microbatch_order is None:
        args.microbatch_order = "cost" if args.use_dpp else "natural"
    elif args.microbatch_order == "cost":
        need(lengths_vary, "--microbatch-order cost needs --variable-seq-lengths or "
             "--seq-length-cv (with one length every order is the same)")


def _validate_microbatch_tokens(args, need):
    budget, longest = args.microbatch_tokens, args.seq_length
    need(budget >= longest, f"--microbatch-tokens {budget} is less than --seq-length "
         f"{longest}: a microbatch must hold the longest sample")
    need(args.global_batch_size % args.data_parallel_size == 0,
         f"--microbatch-tokens: --global-batch-size {args.global_batch_size} must be a "
         f"multiple of the data-parallel size {args.data_parallel_size}")
    need(args.virtual_pipeline_model_parallel_size is None,
         "--microbatch-tokens with virtual pipeline stages: the interleaved schedules need "
         "a multiple of --pipeline-model-parallel-size microbatches, which a token budget "
         "does not give")


def _validate_trace(args, need):
    for flag, value in (("--trace-dir", args.trace_dir), ("--trace-iters", args.trace_iters)):
        need(args.trace or value is None, f"{flag} needs --trace")
    bad = [n for n in args.trace_iters or [] if n < 1]
    need(not bad, f"--trace-iters {' '.join(map(str, bad))}: iterations count from 1")
    need(args.manual_gc_interval >= 0,
         f"--manual-gc-interval {args.manual_gc_interval} must be >= 0")
    need(1 <= args.profile_step_start < args.profile_step_end,
         f"--profile-step-start {args.profile_step_start} and --profile-step-end "
         f"{args.profile_step_end}: need 1 <= start < end (iterations count from 1)")


def _validate_cuda_graphs(args, need):
    impl = args.cuda_graph_impl
    if impl in ("local", "transformer_engine"):
        need(False, f"--cuda-graph-impl {impl}: " + (
            "megatron-core's graphs replay one fixed microbatch order, which --use-dpp does "
            "not follow" if args.use_dpp else
            "megatron-core's graphs are captured by Megatron-LM's training loop (its CUDA graph "
            "manager / Transformer Engine helper), which this trainer does not run") +
            "; use --cuda-graph-impl block")
    limit = args.cuda_graph_memory_limit
    need(limit is None or (impl == "block" and limit >= 0),
         f"--cuda-graph-memory-limit {limit} needs --cuda-graph-impl block and a bound >= 0")
    if impl != "block":
        return
    # by default only where fast_path.Machine found CUDA
    need(args.cuda_graphs_by_default or _cuda_available(),
         "--cuda-graph-impl block needs a CUDA GPU; this machine has none")
    for bad, what in (
        (args.tensor_model_parallel_size > 1, "--tensor-model-parallel-size > 1 (the graphs "
         "hold no tensor-parallel collectives)"),
        (args.sequence_parallel, "--sequence-parallel"),
        (args.recompute_granularity is not None, "activation recomputation (--recompute-*)"),
        (args.overlap_grad_reduce, "--overlap-grad-reduce (its bucket hooks are the "
         "per-parameter hooks the backward graph replaces)"),
        (args.overlap_param_gather, "--overlap-param-gather (its forward pre-hooks do not "
         "run inside a replay)"),
    ):
        need(not bad, f"--cuda-graph-impl block does not support {what}")


def _resolve_fast_path(args) -> None:
    """The defaults of the fast path for this machine, before the flags are validated;
    `args.fast_path_fallbacks` keeps the lines that the trainer logs (fast_path.py)."""
    from megatron.trainer.config import fast_path

    args.cuda_graphs_by_default = args.cuda_graph_impl == "auto"
    args.fast_path_fallbacks = fast_path.resolve(args, fast_path.Machine.detect())


def _validate_checkpointing(args, need):
    fmt = args.ckpt_format
    need(fmt in CKPT_FORMATS, f"--ckpt-format {fmt}: only torch_dist and torch are supported "
         f"({fmt} is Megatron-LM's format for its FSDP, which this trainer does not run)")
    need(not args.async_save or fmt == "torch_dist",
         f"--async-save needs --ckpt-format torch_dist (megatron.core writes only distributed "
         f"checkpoints asynchronously), not {fmt}")
    need(not args.use_persistent_ckpt_worker or args.async_save,
         "--use-persistent-ckpt-worker needs --async-save (the worker writes asynchronous saves)")
    need(not (args.use_checkpoint_opt_param_scheduler and args.override_opt_param_scheduler),
         "--use-checkpoint-opt_param-scheduler and --override-opt_param-scheduler are mutually "
         "exclusive")
    for flag, value in (("--save-retain-interval", args.save_retain_interval),
                        ("--non-persistent-save-interval", args.non_persistent_save_interval)):
        if value is not None:
            need(value >= 1, f"{flag} {value} must be >= 1")
            need(args.save is not None, f"{flag} {value} needs --save DIR")
    kind = args.non_persistent_ckpt_type
    need(kind in (None, "global"), f"--non-persistent-ckpt-type {kind}: only global is "
         "supported (local and in_memory need nvidia-resiliency-ext's checkpoint manager)")
    need(args.non_persistent_save_interval is None or kind is not None,
         "--non-persistent-save-interval needs --non-persistent-ckpt-type global")
    need(args.non_persistent_global_ckpt_dir is None or kind == "global",
         "--non-persistent-global-ckpt-dir needs --non-persistent-ckpt-type global")


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _add_logging_args(g):
    """Megatron-LM's logging flags; megatron/trainer/logging_config.py turns them into a
    LoggingConfig, megatron/trainer/run/metrics.py writes what they ask for."""
    g.add_argument("--log-timers-to-tensorboard", action="store_true",
                   help="the --timing-log-level timers as timers/<name> (ms per iteration)")
    g.add_argument("--log-memory-to-tensorboard", action="store_true",
                   help="the reporting rank's memory: CUDA allocator figures on GPU, the "
                        "process's peak resident set on CPU")
    g.add_argument("--log-num-zeros-in-grad", action="store_true",
                   help="count the zero entries of the gradient (iteration line and board)")
    g.add_argument("--log-params-norm", action="store_true",
                   help="L2 norm of all parameters, each counted once (iteration line and board)")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true",
                   help="validation perplexity exp(loss) next to each validation loss")
    g.add_argument("--wandb-project", default=None,
                   help="log the scalars to this Weights & Biases project too (needs wandb)")
    g.add_argument("--wandb-exp-name", default=None, help="the W&B run's name")
    g.add_argument("--wandb-entity", default=None, help="the W&B team or user")
    g.add_argument("--wandb-save-dir", default=None,
                   help="W&B's local files (default: --save/wandb, else wandb)")


def _add_megatron_lm_args(g):
    """Model, loss, data, optimizer and layout flags of Megatron-LM's scripts."""
    g.add_argument("--deterministic-mode", action="store_true",
                   help="bitwise-reproducible runs: torch's deterministic algorithms, a fixed "
                        "NCCL algorithm (NCCL_ALGO, default Ring), cuBLAS workspace "
                        "(CUBLAS_WORKSPACE_CONFIG, default :4096:8), deterministic TE attention")
    g.add_argument("--calculate-per-token-loss", action="store_true",
                   help="normalise the loss by the tokens of the whole global batch instead of "
                        "averaging per-microbatch means")
    g.add_argument("--apply-query-key-layer-scaling", action="store_true",
                   help="scale Q K^T by 1 / layer number before the (fp32) softmax and back "
                        "inside it: keeps fp16 scores in range")
    g.add_argument("--apply-layernorm-1p", action="store_true",
                   help="norm weights stored as offsets from 1 (zero-centred gamma)")
    g.add_argument("--no-rope-fusion", action="store_true",
                   help="unfused rotary embeddings (the fused kernel, Transformer Engine's, is "
                        "used on GPU when importable)")
    g.add_argument("--rotary-interleaved", action="store_true",
                   help="rotate interleaved pairs of each head's channels instead of its halves")
    g.add_argument("--squared-relu", action="store_true", help="relu(x)^2 as MLP activation")
    g.add_argument("--no-persist-layer-norm", action="store_true",
                   help="no apex persistent layer-norm kernel (none is used here: the norms "
                        "are torch's or Transformer Engine's)")
    g.add_argument("--use-legacy-models", action="store_true",
                   help="refused: only megatron-core's models exist here")
    g.add_argument("--no-create-attention-mask-in-dataloader", action="store_false",
                   dest="create_attention_mask_in_dataloader",
                   help="GPT: the dataset makes no [s, s] attention mask per sample (the "
                        "causal mask is implicit in attention)")
    g.add_argument("--no-mmap-bin-files", action="store_false", dest="mmap_bin_files",
                   help="read the .bin token files with file reads instead of memory maps")
    g.add_argument("--decoupled-lr", type=float, default=None,
                   help="learning rate of the input embedding and the output layer")
    g.add_argument("--decoupled-min-lr", type=float, default=None,
                   help="their minimum learning rate (needs --decoupled-lr)")
    g.add_argument("--use-tp-pp-dp-mapping", action="store_true",
                   help="ranks ordered tensor, then pipeline, then data parallel (default: "
                        "tensor, data, pipeline)")
    g.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=None,
                   help="the same as --virtual-pipeline-model-parallel-size")
    g.add_argument("--ddp-average-in-collective", action="store_true",
                   help="average the gradients over data-parallel ranks inside the reduction "
                        "instead of scaling them before it")
    g.add_argument("--spec", nargs="+", default=None,
                   help="'local': megatron-core's local layer spec, the same as "
                        "--transformer-impl local (other module specs are refused)")


# NCCL_ALGO values that Megatron-LM accepts in --deterministic-mode (NVLS reduces in switches)
DETERMINISTIC_NCCL_ALGOS = ("Tree", "Ring", "CollnetDirect", "CollnetChain", "^NVLS")
DETERMINISTIC_CUBLAS_WORKSPACES = (":4096:8", ":16:8")


def _default_tokenizer(args) -> str:
    """Megatron-LM's choice when --tokenizer-type is not given: the files say which."""
    if args.model == "bert":
        return "BertWordPieceLowerCase" if args.vocab_file is not None else "NullTokenizer"
    # Megatron-LM's GPT examples give --vocab-file/--merge-file and no --tokenizer-type;
    # they keep meaning GPT-2 BPE when --mock-data replaces --data-path
    bpe_files = args.vocab_file is not None and args.merge_file is not None
    return "NullTokenizer" if args.mock_data and not bpe_files else "GPT2BPETokenizer"


def _resolve_megatron_lm_aliases(args, need):
    """Flags that spell another flag's value differently; before anything reads it."""
    stages = args.num_virtual_stages_per_pipeline_rank
    if stages is None:
        return
    vpp = args.virtual_pipeline_model_parallel_size
    need(vpp is None or vpp == stages,
         f"--num-virtual-stages-per-pipeline-rank {stages} contradicts "
         f"--virtual-pipeline-model-parallel-size {vpp}")
    args.virtual_pipeline_model_parallel_size = stages


def _validate_megatron_lm_flags(args, need):
    if args.spec is not None:
        spec = " ".join(args.spec)
        need(spec == "local", f"--spec {spec}: only --spec local (megatron-core's local layers) "
             "is supported; a module path of your own is not loaded")
        need(spec != "local" or args.transformer_impl in ("auto", "local"),
             f"--spec local contradicts --transformer-impl {args.transformer_impl}")
        if spec == "local":
            args.transformer_impl = "local"
    need(not args.use_legacy_models, "--use-legacy-models: Megatron-LM's legacy models do not "
         "exist here; megatron-core's are always used")
    need(not (args.use_legacy_models and args.use_mcore_models),
         "--use-mcore-models and --use-legacy-models contradict each other")
    need(args.decoupled_min_lr is None or args.decoupled_lr is not None,
         f"--decoupled-min-lr {args.decoupled_min_lr} needs --decoupled-lr")
    for flag, value in (("--decoupled-lr", args.decoupled_lr),
                        ("--decoupled-min-lr", args.decoupled_min_lr)):
        need(value is None or value >= 0, f"{flag} {value} must be >= 0")
    need(not args.rotary_interleaved or args.position_embedding_type == "rope",
         "--rotary-interleaved needs --position-embedding-type rope")
    need(not (args.squared_relu and args.swiglu), "--squared-relu and --swiglu are mutually "
         "exclusive (two MLP activations)")
    # megatron-core's BERT head builds its own norm, which without apex or TE is torch's
    need(not (args.apply_layernorm_1p and args.model == "bert"
              and args.transformer_impl == "local"),
         "--apply-layernorm-1p with BERT and --transformer-impl local: megatron-core's BERT "
         "head norm (torch's without apex) has no zero-centred gamma; use Transformer Engine")
    if args.reset_attention_mask:
        need(args.create_attention_mask_in_dataloader, "--reset-attention-mask needs the "
             "dataset's attention mask (the document boundaries): drop "
             "--no-create-attention-mask-in-dataloader")
        middle = (args.pipeline_model_parallel_size > 2
                  or args.virtual_pipeline_model_parallel_size is not None)
        need(args.model != "gpt" or not middle, "--reset-attention-mask with more than two "
             "pipeline stages (virtual ones included): the middle stages read no batch and "
             "would not see the document boundaries")
    need(args.num_workers == 0 or args.seq_length_cv == 0,
         f"--num-workers {args.num_workers} with --seq-length-cv: the microbatches are cut "
         "to their lengths in the training process; use --num-workers 0")
    if args.use_flash_attn:
        need(args.attention_backend in ("auto", "flash"),
             f"--use-flash-attn contradicts --attention-backend {args.attention_backend}")
        need(_cuda_available(), "--use-flash-attn needs a CUDA GPU; this machine has none")
        need(not args.apply_query_key_layer_scaling or args.transformer_impl != "local",
             "--use-flash-attn and --apply-query-key-layer-scaling with --transformer-impl "
             "local: the layer scaling materialises the scores, FlashAttention never does")
    if args.deterministic_mode:
        _validate_deterministic_mode(args, need)


def _validate_deterministic_mode(args, need):
    """Refuse what would make two runs differ, by name (Megatron-LM refuses the same)."""
    for bad, what in (
        (args.use_flash_attn, "--use-flash-attn (its backward accumulates in a varying order)"),
        (args.attention_backend == "flash",
         "--attention-backend flash (its backward accumulates in a varying order)"),
        (args.cross_entropy_loss_fusion, "--cross-entropy-loss-fusion (not deterministic)"),
        (args.use_dpp, "--use-dpp (each stage runs the backward passes in the order their "
         "gradients arrive, so the weight gradients accumulate in a varying order)"),
    ):
        need(not bad, f"--deterministic-mode does not support {what}")
    for variable, allowed in (("NCCL_ALGO", DETERMINISTIC_NCCL_ALGOS),
                              ("CUBLAS_WORKSPACE_CONFIG", DETERMINISTIC_CUBLAS_WORKSPACES),
                              ("NVTE_ALLOW_NONDETERMINISTIC_ALGO", ("0",))):
        value = os.environ.get(variable)
        need(value is None or value in allowed,
             f"--deterministic-mode: the environment sets {variable}={value}; use one of "
             f"{', '.join(allowed)} or leave it unset")


def _validate_logging(args, need):
    board_flags = [flag for flag, on in (
        ("--log-timers-to-tensorboard", args.log_timers_to_tensorboard),
        ("--log-memory-to-tensorboard", args.log_memory_to_tensorboard),
        ("--log-validation-ppl-to-tensorboard", args.log_validation_ppl_to_tensorboard),
    ) if on]
    need(not board_flags or args.tensorboard_dir or args.wandb_project,
         f"{' '.join(board_flags)} need --tensorboard-dir DIR (or --wandb-project)")
    wandb_flags = [flag for flag, value in (
        ("--wandb-exp-name", args.wandb_exp_name), ("--wandb-entity", args.wandb_entity),
        ("--wandb-save-dir", args.wandb_save_dir)) if value is not None]
    if args.wandb_project is None:
        need(not wandb_flags, f"{' '.join(wandb_flags)} need --wandb-project")
        return
    need(bool(args.wandb_exp_name), f"--wandb-project {args.wandb_project} needs "
         "--wandb-exp-name NAME")
    # whether wandb is installed is checked at start-up (metrics.require_wandb), not here:
    # validation depends on the flags alone


def _add_batch_schedule_args(g):
    g.add_argument("--step-batch-size-schedule", default=None,
                   help='Megatron-LM\'s step schedule "THRESHOLD:SIZE ...": the global batch '
                        "size of the last threshold reached, thresholds in tokens (K, M, B, T "
                        "suffixes), e.g. \"0:16 2.4B:320\"")


def _resolve_step_batch_schedule(args, need):
    """--step-batch-size-schedule sets --global-batch-size to its final size. Megatron-LM
    refuses both flags together; here both are accepted where they agree."""
    if args.step_batch_size_schedule is None:
        return
    text = args.step_batch_size_schedule
    need(args.rampup_batch_size is None,
         "--step-batch-size-schedule and --rampup-batch-size exclude each other")
    try:
        final = StepSchedule.parse(text, args.seq_length).end
    except BatchScheduleError as error:
        need(False, str(error))
        args.step_batch_size_schedule = None  # the rest of validation uses the global size
        return
    need(args.global_batch_size in (None, final),
         f"--global-batch-size {args.global_batch_size} differs from the final size {final} "
         f"of --step-batch-size-schedule {text!r} (leave --global-batch-size out)")
    args.global_batch_size = final


def _validate_step_batch_schedule(args, need):
    """Each size the run reaches splits into microbatches (in groups of the pipeline size
    with virtual stages); --train-samples counts the steps through the schedule."""
    if args.step_batch_size_schedule is None or args.rampup_batch_size is not None:
        return
    schedule = batch_size_schedule(None, args.micro_batch_size, args.data_parallel_size,
                                   step_batch_size_schedule=args.step_batch_size_schedule,
                                   seq_length=args.seq_length)
    if args.train_samples is not None:
        args.train_iters = schedule.iterations_for_samples(args.train_samples)
    if args.train_iters is None:
        return
    per_round = args.micro_batch_size * args.data_parallel_size
    group = args.pipeline_model_parallel_size
    interleaved = args.virtual_pipeline_model_parallel_size is not None
    for size, iteration in schedule.first_iterations(args.train_iters).items():
        if size == args.global_batch_size:
            continue  # named by the --global-batch-size checks
        what = (f"--step-batch-size-schedule {args.step_batch_size_schedule!r}: global batch "
                f"size {size} (from iteration {iteration})")
        need(size % per_round == 0, f"{what} is not divisible by --micro-batch-size "
             f"{args.micro_batch_size} x data-parallel size {args.data_parallel_size}")
        need(not interleaved or size % per_round or (size // per_round) % group == 0,
             f"{what} gives {size // per_round} microbatches; with virtual pipeline stages "
             f"they must be a multiple of --pipeline-model-parallel-size {group}")


def _add_core_extras_args(g):
    g.add_argument("--check-weight-hash-across-dp-replicas-interval", type=int, default=None,
                   help="every N iterations compare a hash of the weights across data-parallel "
                        "replicas; stop naming the ranks if they differ")
    g.add_argument("--overlap-param-gather-with-optimizer-step", action="store_true",
                   help="start the first model chunk's parameter all-gather in the optimizer "
                        "step (distributed optimizer, --overlap-param-gather, virtual stages)")
    g.add_argument("--ckpt-assume-constant-structure", action="store_true",
                   help="torch_dist saves reuse the first save's plan and metadata (the model "
                        "and optimizer structure must not change during the run)")
    g.add_argument("--trust-checkpoint", action="store_true",
                   help="load a checkpoint that is world-writable or another user's, and legacy "
                        "files holding classes beyond the allowed ones (loading unpickles: a "
                        "crafted checkpoint runs code; megatron/trainer/checkpoint/checkpoint_trust.py)")
    g.add_argument("--verify-integrity", action="store_true",
                   help="write a SHA-256 manifest of each saved checkpoint and check the "
                        "loaded checkpoint against it")
    g.add_argument("--async-strategy", default="mcore", choices=["mcore", "nvrx"],
                   help="writer of --async-save: megatron-core's own (mcore)")
    g.add_argument("--qk-layernorm", action="store_true",
                   help="normalize queries and keys per head before the attention scores")
    g.add_argument("--test-mode", action="store_true",
                   help="megatron-core's real-time checks: every attention forward compares the "
                        "q/k norm weights across data- and tensor-parallel ranks")
    g.add_argument("--microbatch-group-size-per-virtual-pipeline-stage", type=int, default=None,
                   help="megatron-core's interleaved schedule runs this many consecutive "
                        "microbatches on each virtual stage (default: the pipeline size)")
    g.add_argument("--overlap-p2p-communication-warmup-flush", action="store_true",
                   help="megatron-core's interleaved schedule overlaps its p2p with compute "
                        "in warm-up and flush too (unbatched p2p)")
    g.add_argument("--disable-gloo-process-groups", action="store_true",
                   help="create no gloo twins of megatron-core's process groups")
    g.add_argument("--num-distributed-optimizer-instances", type=int, default=1,
                   help="split the data-parallel ranks into this many groups, each sharding "
                        "a whole copy of the optimizer state (megatron-core)")


def _validate_core_extras(args, need):
    interval = args.check_weight_hash_across_dp_replicas_interval
    need(interval is None or interval >= 1,
         f"--check-weight-hash-across-dp-replicas-interval {interval} must be >= 1")
    need(not (args.disable_gloo_process_groups and args.use_distributed_optimizer
              and args.ckpt_format == "torch" and (args.save or args.load)),
         "--disable-gloo-process-groups with --use-distributed-optimizer cannot save or load "
         "--ckpt-format torch (megatron-core gathers its optimizer state over gloo); use "
         "torch_dist")
    if args.overlap_param_gather_with_optimizer_step:
        missing = [what for what, ok in (
            ("--use-distributed-optimizer", args.use_distributed_optimizer),
            ("--overlap-param-gather", args.overlap_param_gather),
            ("virtual pipeline stages", args.virtual_pipeline_model_parallel_size is not None),
            ("--ckpt-format torch (megatron-core cannot save it in torch_dist yet)",
             args.ckpt_format == "torch" or not (args.save or args.load)),
            ("megatron-core's schedule (not --use-dpp)", not args.use_dpp)) if not ok]
        need(not missing, "--overlap-param-gather-with-optimizer-step needs "
             + ", ".join(missing))
    need(not args.qk_layernorm or args.model == "gpt",
         "--qk-layernorm: megatron-core's BERT layer specs have no query/key norms")
    if args.test_mode:
        why = [reason for reason, bad in (
            ("it checks only the q/k norms of --qk-layernorm", not args.qk_layernorm),
            ("its checks need the norms' biases (--normalization LayerNorm)",
             args.normalization != "LayerNorm"),
            ("its collectives inside each forward need the ranks in step, not --use-dpp",
             args.use_dpp)) if bad]
        need(not why, "--test-mode: " + "; ".join(why))
    _validate_interleaved_schedule_tuning(args, need)
    need(not args.verify_integrity or args.save or args.load,
         "--verify-integrity needs --save or --load")
    need(args.async_strategy == "mcore", f"--async-strategy {args.async_strategy}: only "
         "mcore (megatron-core's writer); nvrx needs nvidia-resiliency-ext's checkpointing")
    need(not args.ckpt_assume_constant_structure or args.ckpt_format == "torch_dist",
         f"--ckpt-assume-constant-structure caches megatron-core's torch_dist save plan; "
         f"--ckpt-format {args.ckpt_format} has none")
    instances, dp = args.num_distributed_optimizer_instances, args.data_parallel_size
    if instances != 1:
        need(instances >= 1, f"--num-distributed-optimizer-instances {instances} must be >= 1")
        need(args.use_distributed_optimizer,
             f"--num-distributed-optimizer-instances {instances} needs "
             "--use-distributed-optimizer")
        need(instances < 1 or dp % instances == 0,
             f"--num-distributed-optimizer-instances {instances} does not divide the "
             f"data-parallel size {dp}")


def _validate_interleaved_schedule_tuning(args, need):
    """Settings of megatron-core's interleaved schedule: virtual stages and that schedule
    (DPP orders its tasks by readiness, not in groups)."""
    pp, interleaved = args.pipeline_model_parallel_size, \
        args.virtual_pipeline_model_parallel_size is not None
    group = args.microbatch_group_size_per_virtual_pipeline_stage
    if group is not None:
        flag = f"--microbatch-group-size-per-virtual-pipeline-stage {group}"
        need(interleaved, f"{flag} needs virtual pipeline stages")
        need(not args.use_dpp or group == pp, f"{flag}: --use-dpp runs the microbatches of "
             f"a virtual stage in groups of --pipeline-model-parallel-size {pp}")
        need(group >= pp, f"{flag} is below --pipeline-model-parallel-size {pp}")
    if args.overlap_p2p_communication_warmup_flush:
        flag = "--overlap-p2p-communication-warmup-flush"
        need(interleaved and not args.use_dpp,
             f"{flag} tunes megatron-core's interleaved schedule: needs virtual pipeline "
             "stages and not --use-dpp")
        # overlapped unbatched p2p posts both directions to the one neighbour at once
        need(pp != 2, f"{flag} at --pipeline-model-parallel-size 2: the one neighbour would "
             "match activations and gradients by posting order")


def _interleaved_group_problem(args, count: int) -> str | None:
    """Why megatron-core's interleaved schedule refuses `count` microbatches, or None."""
    pp = args.pipeline_model_parallel_size
    group = args.microbatch_group_size_per_virtual_pipeline_stage
    if group is None or args.use_dpp:
        return None if count % pp == 0 else (
            f"a multiple of --pipeline-model-parallel-size {pp}")
    if count < group:
        return f"at least --microbatch-group-size-per-virtual-pipeline-stage {group}"
    if 0 < count % group < pp:
        return (f"a multiple of --microbatch-group-size-per-virtual-pipeline-stage {group} "
                f"or one whose last group has at least --pipeline-model-parallel-size {pp}")
    return None


def _add_fim_args(g):
    """Megatron-LM's fill-in-the-middle data; megatron/trainer/data/fim.py does it."""
    g.add_argument("--fim-data", action="store_true",
                   help="GPT: fill-in-the-middle samples: a piece of text between end-of-"
                        "document tokens becomes prefix/suffix/middle (docs/fim.md)")
    g.add_argument("--fim-rate", type=float, default=None,
                   help="probability that a piece becomes a FIM piece (default 0.5)")
    g.add_argument("--fim-spm-rate", type=float, default=None,
                   help="probability that a FIM piece is laid out suffix-prefix-middle instead "
                        "of prefix-suffix-middle (default 0.5)")
    g.add_argument("--fim-split-sample", default=None,
                   help="a token (e.g. a file separator) at which a FIM piece is cut into "
                        "fragments, each FIM'd with --fim-fragment-rate")
    g.add_argument("--fim-fragment-rate", type=float, default=None,
                   help="FIM probability of each fragment of --fim-split-sample")
    g.add_argument("--fim-no-prefix", default=None,
                   help="pieces whose text starts with this string are left as they are")
    for name, default in (("prefix", "<fim_prefix>"), ("middle", "<fim_middle>"),
                          ("suffix", "<fim_suffix>"), ("pad", "<fim_pad>")):
        g.add_argument(f"--fim-{name}-token", default=default,
                       help=f"the FIM {name} token (default {default}; GPT-2 BPE and HF "
                            "tokenizers get it added when their files lack it)")
    g.add_argument("--fim-eod-token", default=None,
                   help="the token between documents (default: the tokenizer's end-of-document "
                        "token, <|endoftext|> for GPT-2 BPE)")


def _validate_fim(args, need):
    dependent = [flag for flag, value in (
        ("--fim-rate", args.fim_rate), ("--fim-spm-rate", args.fim_spm_rate),
        ("--fim-split-sample", args.fim_split_sample),
        ("--fim-fragment-rate", args.fim_fragment_rate),
        ("--fim-no-prefix", args.fim_no_prefix), ("--fim-eod-token", args.fim_eod_token),
    ) if value is not None]
    if not args.fim_data:
        need(not dependent, f"{' '.join(dependent)} need{'s' * (len(dependent) == 1)} "
             "--fim-data")
        return
    # Megatron-LM's defaults
    args.fim_rate = 0.5 if args.fim_rate is None else args.fim_rate
    args.fim_spm_rate = 0.5 if args.fim_spm_rate is None else args.fim_spm_rate
    for flag, value in (("--fim-rate", args.fim_rate), ("--fim-spm-rate", args.fim_spm_rate),
                        ("--fim-fragment-rate", args.fim_fragment_rate)):
        need(value is None or 0 <= value <= 1, f"{flag} {value} must be in [0, 1]")
    need((args.fim_split_sample is None) == (args.fim_fragment_rate is None),
         "--fim-split-sample and --fim-fragment-rate go together (the fragments' FIM "
         "probability)")
    need(args.model == "gpt", "--fim-data makes GPT samples; BERT's masked-LM samples have "
         "no FIM form")
    need(not args.variable_seq_lengths, "--fim-data with --variable-seq-lengths: FIM works on "
         "megatron-core's packed GPT samples, not on the one-document samples")
    sentinels = [args.fim_prefix_token, args.fim_middle_token, args.fim_suffix_token,
                 args.fim_pad_token]
    need(len(set(sentinels)) == 4 and all(sentinels),
         f"--fim-prefix/middle/suffix/pad-token {' '.join(sentinels)}: four different tokens "
         "are needed")
    need(args.tokenizer_type != "NullTokenizer",
         f"--fim-data needs a tokenizer with the tokens {' '.join(sentinels)}: NullTokenizer "
         "(--mock-data without tokenizer files) has only numbered tokens and no text to "
         "split; give --vocab-file and --merge-file (GPT-2 BPE) or --tokenizer-model")
def _add_rerun_args(g):
    g.add_argument("--rerun-mode", default="disabled", choices=MODES,
                   help="megatron-core's rerun state machine "
                        "(megatron/trainer/core_compat/reruns.py): "
                        "validate_results checks losses and gradient norms and re-runs an "
                        "iteration whose result is rejected, to tell a transient fault (exit "
                        "17) from a reproducible result (checkpoint, exit 16); report_stats runs "
                        "every iteration twice and logs how much the results differ")
    g.add_argument("--error-injection-rate", type=int, default=0,
                   help="validate_results: reject one in this many validated results on "
                        "purpose (0: never), to exercise the re-runs")
    g.add_argument("--error-injection-type", default="transient_error", choices=INJECTION_TYPES,
                   help="how the re-run of an injected rejection behaves: transient_error (not "
                        "reproduced), persistent_error or correct_result (reproduced)")
    g.add_argument("--no-check-for-nan-in-loss-and-grad", action="store_false",
                   dest="check_for_nan_in_loss_and_grad",
                   help="train on through NaN/Inf losses and gradient norms: without it a "
                        "non-finite one stops the run (and --rerun-mode validate_results|"
                        "report_stats also re-runs the iteration)")
    g.add_argument("--check-for-spiky-loss", action="store_true",
                   help="with --rerun-mode validate_results|report_stats: also reject a loss "
                        "ten times the largest of the first 100 (not fatal)")


def _validate_reruns(args, need):
    rate, mode = args.error_injection_rate, args.rerun_mode
    need(rate >= 0, f"--error-injection-rate {rate} must be >= 0")
    need(rate == 0 or mode == "validate_results",
         f"--error-injection-rate {rate} injects rejections for --rerun-mode validate_results "
         f"to re-run; with --rerun-mode {mode} nothing would re-run them")
    need(not args.check_for_spiky_loss or mode != "disabled",
         "--check-for-spiky-loss needs --rerun-mode validate_results or report_stats (disabled "
         "checks no result)")
# without --use-checkpoint-args the command line must give these (Megatron-LM checks them in
# validation too, so that a checkpoint can supply them)
_MODEL_SHAPE_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "seq_length")


def _require_model_shape(args) -> None:
    missing = [f"--{name.replace('_', '-')}" for name in _MODEL_SHAPE_FLAGS
               if getattr(args, name) is None]
    if missing:
        source = (f" (--use-checkpoint-args found no checkpoint holding them under --load "
                  f"{args.load})" if args.use_checkpoint_args and args.load else
                  " (or --use-checkpoint-args with a --load checkpoint that holds them)")
        raise ArgumentError(f"the following arguments are required: {', '.join(missing)}"
                            + source)


def _add_checkpoint_args_and_eval_args(g):
    """Megatron-LM's flags for taking the model's arguments from the checkpoint
    (megatron/trainer/checkpoint/checkpoint_args.py), detecting the checkpoint format on load,
    staging asynchronous saves in shared memory, and evaluation's batch size."""
    g.add_argument("--use-checkpoint-args", action="store_true",
                   help="on --load, the checkpoint's model arguments (layers, sizes, heads, "
                        "normalization, position embedding, ...) replace or fill in the "
                        "command line's, as in Megatron-LM; each change is logged")
    g.add_argument("--use-mp-args-from-checkpoint-args", action="store_true",
                   help="with --use-checkpoint-args, also the tensor, pipeline and virtual "
                        "pipeline sizes")
    g.add_argument("--no-use-tokenizer-model-from-checkpoint-args", action="store_false",
                   dest="use_tokenizer_model_from_checkpoint_args",
                   help="with --use-checkpoint-args, keep the command line's tokenizer type "
                        "and model (default: the checkpoint's)")
    g.add_argument("--auto-detect-ckpt-format", action="store_true",
                   help="--load reads a checkpoint in either format; without it "
                        "--ckpt-format torch reads only torch-format checkpoints (torch_dist, "
                        "the default, detects either, as in Megatron-LM)")
    g.add_argument("--async-ckpt-use-cpu-shm", action="store_true",
                   help="--async-save: copy the tensors to write into CPU shared memory in "
                        "the training process, so the writer process gets no CUDA IPC handles")
    g.add_argument("--eval-global-batch-size", type=int, default=None,
                   help="samples per evaluation iteration (default: --global-batch-size)")


def _apply_checkpoint_args(args) -> None:
    """--use-checkpoint-args: before validation, as in Megatron-LM."""
    if args.use_checkpoint_args and args.load is not None:
        from megatron.trainer.checkpoint.checkpoint_args import apply_checkpoint_args

        apply_checkpoint_args(args)


def _validate_checkpoint_args_and_eval(args, need):
    need(not args.use_checkpoint_args or args.load is not None,
         "--use-checkpoint-args needs --load DIR (the checkpoint holding the arguments)")
    need(not args.use_mp_args_from_checkpoint_args or args.use_checkpoint_args,
         "--use-mp-args-from-checkpoint-args needs --use-checkpoint-args")
    need(not args.async_ckpt_use_cpu_shm or args.async_save,
         "--async-ckpt-use-cpu-shm stages the tensors of --async-save; give --async-save "
         "(a synchronous save writes from the training process itself)")
    batch = args.eval_global_batch_size
    if batch is None:
        return
    rows = args.micro_batch_size * args.data_parallel_size
    need(batch >= 1 and batch % rows == 0,
         f"--eval-global-batch-size {batch} is not a multiple of --micro-batch-size "
         f"{args.micro_batch_size} x data-parallel size {args.data_parallel_size}")
    pp = args.pipeline_model_parallel_size
    if args.virtual_pipeline_model_parallel_size is not None and batch % rows == 0:
        need((batch // rows) % pp == 0,
             f"--eval-global-batch-size {batch}: {batch // rows} microbatches, not a multiple "
             f"of --pipeline-model-parallel-size {pp} (virtual stages run them in groups of it)")
    need(not args.variable_seq_lengths,
         "--eval-global-batch-size with --variable-seq-lengths: evaluation reads the "
         "documents in the training global batch's plan")
def _add_embedding_wgrad_args(g):
    g.add_argument("--defer-embedding-wgrad-compute", action="store_true",
                   help="the last stage's output layer defers its weight-gradient GEMMs to the "
                        "end of the iteration (the pipeline flush) instead of each backward")
    g.add_argument("--wgrad-deferral-limit", type=int, default=None,
                   help="defer the output layer's weight gradient of this many microbatches "
                        "per iteration; the later ones run in their backward (default 0: all)")


def _validate_embedding_wgrad(args, need):
    limit = args.wgrad_deferral_limit
    if not args.defer_embedding_wgrad_compute:
        need(limit is None, f"--wgrad-deferral-limit {limit} needs "
             "--defer-embedding-wgrad-compute")
        return
    flag = "--defer-embedding-wgrad-compute"
    if limit is None:
        args.wgrad_deferral_limit = 0
    need(limit is None or limit >= 0, f"--wgrad-deferral-limit {limit} must be >= 0 (0: all)")
    need(args.pipeline_model_parallel_size > 1, f"{flag} needs --pipeline-model-parallel-size "
         "> 1 (the GEMMs wait for the pipeline flush; without pipelining there is none)")
    need(args.model == "gpt", f"{flag}: megatron-core's BERT output layer has no buffers to "
         "defer into (GPT only)")
    need(args.gradient_accumulation_fusion, f"{flag} defers the fused weight-gradient "
         "accumulation: drop --no-gradient-accumulation-fusion")
    # DDP's hook marks the output weight ready in the last backward: with overlapped
    # reduction its bucket would be reduced before the flush adds the deferred gradients
    need(not args.overlap_grad_reduce, f"{flag} with --overlap-grad-reduce: the output "
         "layer's gradient bucket would be reduced in the last backward, before the flush "
         "adds the deferred weight gradients")
    # megatron-core's drain_embedding_wgrad_compute fails on exactly one deferred
    # microbatch (DPP drains its own way)
    one = [what for what, bad in (
        ("--wgrad-deferral-limit 1", limit == 1),
        ("one microbatch per iteration", args.num_microbatches == 1
         and args.rampup_batch_size is None)) if bad]
    need(args.use_dpp or not one, f"{flag} with {' and '.join(one)}: megatron-core's drain "
         "(drain_embedding_wgrad_compute) fails on a single deferred microbatch; defer more, "
         "or use --use-dpp")
    need(not args.dpp_split_backward, f"{flag} with --dpp-split-backward: the split already "
         "defers the output layer's weight gradient to W tasks that the schedule places in "
         "the bubbles (the flush among them) under its memory caps; the flag would hold "
         "every microbatch's logits gradient outside those caps until the end. Use one")


def _add_mla_args(g):
    g.add_argument("--multi-latent-attention", action="store_true",
                   help="multi-latent attention (DeepSeek-V2): queries, keys and values "
                        "projected through low-rank latents (megatron-core's MLA, GPT only)")
    g.add_argument("--q-lora-rank", type=int, default=None,
                   help="rank of the queries' latent (default: no query compression)")
    g.add_argument("--kv-lora-rank", type=int, default=32,
                   help="rank of the keys' and values' latent")
    g.add_argument("--qk-head-dim", type=int, default=128,
                   help="query/key head dim without position embedding (q/k heads are "
                        "qk-head-dim + qk-pos-emb-head-dim)")
    g.add_argument("--qk-pos-emb-head-dim", type=int, default=64,
                   help="query/key head channels that carry the rotary position embedding")
    g.add_argument("--v-head-dim", type=int, default=128, help="value head dim")
    g.add_argument("--rope-type", default=None, choices=["rope", "yarn"],
                   help="MLA's rotary embedding (default yarn, as Megatron-LM)")
    g.add_argument("--rotary-scaling-factor", type=float, default=None,
                   help="YaRN: context extension factor of MLA's rotary embedding (default 1)")
    g.add_argument("--mscale", type=float, default=None,
                   help="YaRN: attention scale coefficient of MLA (default 1)")
    g.add_argument("--mscale-all-dim", type=float, default=None,
                   help="YaRN: the same over all dims, divides the scale (default 0: off)")


def _validate_mla(args, need):
    yarn = {"--rotary-scaling-factor": args.rotary_scaling_factor, "--mscale": args.mscale,
            "--mscale-all-dim": args.mscale_all_dim}
    if not args.multi_latent_attention:
        given = [f"{flag} {value}" for flag, value in
                 (("--rope-type", args.rope_type), *yarn.items()) if value is not None]
        need(not given, f"{', '.join(given)}: MLA's rotary embedding, needs "
             "--multi-latent-attention (the standard attention's is --position-embedding-type "
             "rope)")
        return
    flag = "--multi-latent-attention"
    need(args.model == "gpt", f"{flag}: megatron-core's BERT has no MLA layer spec (GPT only)")
    need(not args.group_query_attention, f"{flag} and --group-query-attention are mutually "
         "exclusive (MLA's keys and values come from one shared latent)")
    for name, value in (("--q-lora-rank", args.q_lora_rank), ("--kv-lora-rank", args.kv_lora_rank),
                        ("--qk-head-dim", args.qk_head_dim), ("--v-head-dim", args.v_head_dim)):
        need(value is None or value >= 1, f"{name} {value} must be >= 1")
    pos = args.qk_pos_emb_head_dim
    need(pos >= 2 and pos % 2 == 0, f"--qk-pos-emb-head-dim {pos} must be even and >= 2 (the "
         "rotary embedding turns pairs of channels)")
    if args.rope_type is None:
        args.rope_type = "yarn"
    need(args.rope_type == "yarn" or not any(v is not None for v in yarn.values()),
         f"{', '.join(f for f, v in yarn.items() if v is not None)} with --rope-type rope: "
         "YaRN's settings (use --rope-type yarn)")
    for name, value, default in (("rotary_scaling_factor", args.rotary_scaling_factor, 1.0),
                                 ("mscale", args.mscale, 1.0),
                                 ("mscale_all_dim", args.mscale_all_dim, 0.0)):
        setattr(args, name, default if value is None else value)
    need(args.rotary_scaling_factor > 0,
         f"--rotary-scaling-factor {args.rotary_scaling_factor} must be > 0")
