"""Model flags: shape, precision, multi-latent attention, deferred output-layer wgrads."""

from __future__ import annotations

import importlib.util

from megatron.trainer.config.args_common import add_flags
from megatron.trainer.config.configs import PrecisionConfig


def model_args(g):
    add_flags(g, {
        "--num-layers int": None,
        "--hidden-size int": None,
        "--ffn-hidden-size int": None,
        "--num-attention-heads int": None,
        "--kv-channels int": None,
        "--group-query-attention": None,
        "--num-query-groups int": None,
        "--seq-length int": None,
        "--max-position-embeddings int": None,
        "--position-embedding-type {learned_absolute,rope,none} = learned_absolute": None,
        "--use-rotary-position-embeddings": None,
        "--rotary-percent float = 1.0": None,
        "--rotary-base int = 10000": None,
        "--normalization {LayerNorm,RMSNorm} = LayerNorm": None,
        "--norm-epsilon float = 1e-5": None,
        "--swiglu": None,
        "--disable-bias-linear": None,
        "--untie-embeddings-and-output-weights": None,
        "--hidden-dropout float = 0.1": None,
        "--attention-dropout float = 0.1": None,
        "--init-method-std float = 0.02": None,
        "--make-vocab-size-divisible-by int = 128": None,
        "--apply-residual-connection-post-layernorm": None,
        "--attention-softmax-in-fp32": None,
        "--no-masked-softmax-fusion": None,
        "--no-bias-gelu-fusion": None,
        "--no-bias-dropout-fusion": None,
        "--cross-entropy-loss-fusion": dict(
            default=None, help="fused cross-entropy; which one: --cross-entropy-fusion-impl "
            "(default: on with triton on a GPU with Triton, see fast_path.py)"),
        "--cross-entropy-fusion-impl {native,te,triton}":
            "native: megatron-core's torch.compile'd version (--bf16 only); te: Transformer "
            "Engine's; triton: the project's one pass forward, one pass backward (Triton "
            "kernels on GPU, torch ops elsewhere; any dtype). Default: native with "
            "--cross-entropy-loss-fusion, else triton",
        "--use-flash-attn": "FlashAttention: Transformer Engine's flash backend, or torch's "
                            "flash SDPA kernel with the local layers (CUDA only)",
        "--attention-backend {auto,flash,fused,unfused,local} = auto": None,
        "--transformer-impl {auto,local,transformer_engine} = auto":
            "auto: Transformer Engine on GPU when importable, else the project's SDPA spec",
        "--use-mcore-models": "megatron-core's models, the only ones here (deprecated in "
                              "Megatron-LM, where they are the default); contradicts "
                              "--use-legacy-models",
        "--bert-no-binary-head": None,
        "--num-tokentypes int = 2": None,
        "--mask-prob float = 0.15": None,
        "--short-seq-prob float = 0.1": None,
    })


def precision_args(g):
    add_flags(g, {
        "--fp16": None,
        "--bf16": None,
        "--loss-scale float": None,
        "--initial-loss-scale float = 4294967296.0": None,  # 2**32
        "--min-loss-scale float = 1.0": None,
        "--loss-scale-window float = 1000": None,
        "--hysteresis int = 2": None,
        "--accumulate-allreduce-grads-in-fp32": None,
        "--fp32-residual-connection": None,
    })


def validate_precision(args, need):
    PrecisionConfig.rules(args, need)
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


def add_embedding_wgrad_args(g):
    add_flags(g, {
        "--defer-embedding-wgrad-compute":
            "the last stage's output layer defers its weight-gradient GEMMs to the end of the "
            "iteration (the pipeline flush) instead of each backward",
        "--wgrad-deferral-limit int":
            "defer the output layer's weight gradient of this many microbatches per "
            "iteration; the later ones run in their backward (default 0: all)",
    })


def validate_embedding_wgrad(args, need):
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


def add_mla_args(g):
    add_flags(g, {
        "--multi-latent-attention":
            "multi-latent attention (DeepSeek-V2): queries, keys and values projected "
            "through low-rank latents (megatron-core's MLA, GPT only)",
        "--q-lora-rank int": "rank of the queries' latent (default: no query compression)",
        "--kv-lora-rank int = 32": "rank of the keys' and values' latent",
        "--qk-head-dim int = 128": "query/key head dim without position embedding (q/k heads "
                                   "are qk-head-dim + qk-pos-emb-head-dim)",
        "--qk-pos-emb-head-dim int = 64":
            "query/key head channels that carry the rotary position embedding",
        "--v-head-dim int = 128": "value head dim",
        "--rope-type {rope,yarn}": "MLA's rotary embedding (default yarn, as Megatron-LM)",
        "--rotary-scaling-factor float":
            "YaRN: context extension factor of MLA's rotary embedding (default 1)",
        "--mscale float": "YaRN: attention scale coefficient of MLA (default 1)",
        "--mscale-all-dim float":
            "YaRN: the same over all dims, divides the scale (default 0: off)",
    })


def validate_mla(args, need):
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
