"""Further Megatron-LM flags: aliases, determinism and the rerun state machine."""

from __future__ import annotations

import os

from megatron.trainer.config.args_common import add_flags, cuda_available
from megatron.trainer.core_compat.reruns import INJECTION_TYPES, MODES


def add_megatron_lm_args(g):
    """Model, loss, data, optimizer and layout flags of Megatron-LM's scripts."""
    add_flags(g, {
        "--deterministic-mode":
            "bitwise-reproducible runs: torch's deterministic algorithms, a fixed NCCL "
            "algorithm (NCCL_ALGO, default Ring), cuBLAS workspace (CUBLAS_WORKSPACE_CONFIG, "
            "default :4096:8), deterministic TE attention",
        "--calculate-per-token-loss":
            "normalise the loss by the tokens of the whole global batch instead of averaging "
            "per-microbatch means",
        "--apply-query-key-layer-scaling":
            "scale Q K^T by 1 / layer number before the (fp32) softmax and back inside it: "
            "keeps fp16 scores in range",
        "--apply-layernorm-1p": "norm weights stored as offsets from 1 (zero-centred gamma)",
        "--no-rope-fusion": "unfused rotary embeddings (the fused kernel, Transformer Engine's, "
                            "is used on GPU when importable)",
        "--rotary-interleaved":
            "rotate interleaved pairs of each head's channels instead of its halves",
        "--squared-relu": "relu(x)^2 as MLP activation",
        "--no-persist-layer-norm": "no apex persistent layer-norm kernel (none is used here: "
                                   "the norms are torch's or Transformer Engine's)",
        "--use-legacy-models": "refused: only megatron-core's models exist here",
        "--no-create-attention-mask-in-dataloader": dict(
            action="store_false", dest="create_attention_mask_in_dataloader",
            help="GPT: the dataset makes no [s, s] attention mask per sample (the causal mask "
                 "is implicit in attention)"),
        "--no-mmap-bin-files": dict(
            action="store_false", dest="mmap_bin_files",
            help="read the .bin token files with file reads instead of memory maps"),
        "--decoupled-lr float": "learning rate of the input embedding and the output layer",
        "--decoupled-min-lr float": "their minimum learning rate (needs --decoupled-lr)",
        "--use-tp-pp-dp-mapping": "ranks ordered tensor, then pipeline, then data parallel "
                                  "(default: tensor, data, pipeline)",
        "--num-virtual-stages-per-pipeline-rank int":
            "the same as --virtual-pipeline-model-parallel-size",
        "--ddp-average-in-collective":
            "average the gradients over data-parallel ranks inside the reduction instead of "
            "scaling them before it",
        "--exit-signal-handler":
            "SIGTERM and SIGINT end the run after the iteration in progress, the same one on "
            "every rank, with a checkpoint when --save is given; exit status 128 + the "
            "signal's number (143, 130)",
        "--spec str": dict(nargs="+", help="'local': megatron-core's local layer spec, the same "
                           "as --transformer-impl local (other module specs are refused)"),
    })


# NCCL_ALGO values that Megatron-LM accepts in --deterministic-mode (NVLS reduces in switches)
DETERMINISTIC_NCCL_ALGOS = ("Tree", "Ring", "CollnetDirect", "CollnetChain", "^NVLS")


DETERMINISTIC_CUBLAS_WORKSPACES = (":4096:8", ":16:8")


def resolve_megatron_lm_aliases(args, need):
    """Flags that spell another flag's value differently; before anything reads it."""
    stages = args.num_virtual_stages_per_pipeline_rank
    if stages is None:
        return
    vpp = args.virtual_pipeline_model_parallel_size
    need(vpp is None or vpp == stages,
         f"--num-virtual-stages-per-pipeline-rank {stages} contradicts "
         f"--virtual-pipeline-model-parallel-size {vpp}")
    args.virtual_pipeline_model_parallel_size = stages


def validate_megatron_lm_flags(args, need):
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
    if args.use_flash_attn:
        need(args.attention_backend in ("auto", "flash"),
             f"--use-flash-attn contradicts --attention-backend {args.attention_backend}")
        need(cuda_available(), "--use-flash-attn needs a CUDA GPU; this machine has none")
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


def add_rerun_args(g):
    add_flags(g, {
        "--rerun-mode str = disabled": dict(
            choices=MODES,
            help="megatron-core's rerun state machine (megatron/trainer/core_compat/reruns.py): "
                 "validate_results checks losses and gradient norms and re-runs an iteration "
                 "whose result is rejected, to tell a transient fault (exit 17) from a "
                 "reproducible result (checkpoint, exit 16); report_stats runs every iteration "
                 "twice and logs how much the results differ"),
        "--error-injection-rate int = 0":
            "validate_results: reject one in this many validated results on purpose (0: "
            "never), to exercise the re-runs",
        "--error-injection-type str = transient_error": dict(
            choices=INJECTION_TYPES,
            help="how the re-run of an injected rejection behaves: transient_error (not "
                 "reproduced), persistent_error or correct_result (reproduced)"),
        "--no-check-for-nan-in-loss-and-grad": dict(
            action="store_false", dest="check_for_nan_in_loss_and_grad",
            help="train on through NaN/Inf losses and gradient norms: without it a non-finite "
                 "one stops the run (and --rerun-mode validate_results|report_stats also "
                 "re-runs the iteration)"),
        "--check-for-spiky-loss":
            "with --rerun-mode validate_results|report_stats: also reject a loss ten times the "
            "largest of the first 100 (not fatal)",
    })


def validate_reruns(args, need):
    rate, mode = args.error_injection_rate, args.rerun_mode
    need(rate >= 0, f"--error-injection-rate {rate} must be >= 0")
    need(rate == 0 or mode == "validate_results",
         f"--error-injection-rate {rate} injects rejections for --rerun-mode validate_results "
         f"to re-run; with --rerun-mode {mode} nothing would re-run them")
    need(not args.check_for_spiky_loss or mode != "disabled",
         "--check-for-spiky-loss needs --rerun-mode validate_results or report_stats (disabled "
         "checks no result)")
