"""The DPP flags in Megatron-LM's spelling, and what `--use-dpp` refuses in its trainer.

The refusals read Megatron-LM's parsed arguments by their `dest` names with a default where
a release lacks the flag, so one table serves megatron.training 0.17 to 0.19. Each entry
says why, so the user sees every problem of a command line in one message.
"""

from __future__ import annotations

import argparse

from megatron.dpp.config import DEFAULTS, TRANSPORTS, slack_flag_problems


def add_dpp_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """--use-dpp and the --dpp-* flags, as our trainer spells them (megatron/trainer)."""
    group = parser.add_argument_group("dynamic pipeline schedule (megatron.dpp)")
    group.add_argument("--use-dpp", action="store_true",
                       help="the dynamic pipeline schedule instead of megatron-core's static one")
    group.add_argument("--dpp-max-inflight", type=int, default=None,
                       help="forces the microbatches a stage may hold in flight beyond the "
                            "static schedule's count (default: chosen from 0-"
                            f"{DEFAULTS.slack} by what the first iterations measure)")
    group.add_argument("--dpp-memory-budget", default=None,
                       help="the activations a stage may hold while DPP chooses its slack: a "
                            "factor of 1F1B's busiest stage (1.15x) or a size per stage "
                            "(12GB, 800MB); default: no cap beyond the slack's "
                            f"{DEFAULTS.slack}")
    group.add_argument("--dpp-transport", default=DEFAULTS.transport, choices=TRANSPORTS,
                       help="how activations and gradients move between pipeline stages")
    group.add_argument("--dpp-timeout", type=float, default=DEFAULTS.timeout,
                       help="seconds a stage waits for a pipeline peer before raising")
    # the split and the static plan: off unless asked for (our trainer turns them on where
    # its fast path measured them faster; Megatron-LM's default layers are Transformer
    # Engine's, which the split does not support)
    group.add_argument("--dpp-split-backward", action=argparse.BooleanOptionalAction,
                       default=False,
                       help="split each backward into input gradients (B) and deferred weight "
                            "gradients (W) that the dynamic schedule places (needs --use-dpp, "
                            "--transformer-impl local and the gradient-accumulation fusion)")
    group.add_argument("--dpp-defer-weights", action=argparse.BooleanOptionalAction,
                       default=DEFAULTS.defer_weights,
                       help="with --dpp-split-backward: defer each W as ZB-H1 does (every "
                            "stage holds up to stage 0's microbatches); default: each W right "
                            "after its B, 1F1B's memory on every stage")
    group.add_argument("--dpp-static", action=argparse.BooleanOptionalAction, default=False,
                       help="with --use-dpp: run the DPP plan (1F1B, interleaved, their "
                            "split with W tasks) in order, never deviating: the static "
                            "schedule on the same runtime, to compare the dynamic one with")
    return parser


def _get(args, name, default=None):
    return getattr(args, name, default)


def problems(args) -> list[str]:
    """Why Megatron-LM's trainer cannot run these arguments with the DPP plugin (empty:
    it can). Only the DPP flags' own bounds are checked without --use-dpp."""
    found = []

    def need(ok, why):
        if not ok:
            found.append(why)

    found += slack_flag_problems(_get(args, "dpp_max_inflight"),
                                 _get(args, "dpp_memory_budget"))
    timeout = _get(args, "dpp_timeout", DEFAULTS.timeout)
    need(timeout > 0, f"--dpp-timeout {timeout} must be > 0 seconds")
    if not _get(args, "use_dpp", False):
        need(not _get(args, "dpp_split_backward", False),
             "--dpp-split-backward needs --use-dpp in Megatron-LM's trainer (its own "
             "schedules cannot place W tasks)")
        need(not _get(args, "dpp_static", False), "--dpp-static needs --use-dpp")
        need(not _get(args, "dpp_defer_weights", False), "--dpp-defer-weights needs --use-dpp "
             "with --dpp-split-backward")
        return found
    pp = _get(args, "pipeline_model_parallel_size", 1)
    need(pp > 1, "--use-dpp needs --pipeline-model-parallel-size > 1 (nothing to schedule "
         "otherwise)")
    experts = _get(args, "num_experts")
    need(not experts, f"--num-experts {experts}: mixture-of-experts layers are not supported "
         "by --use-dpp (their all-to-all would cross between stages running different tasks)")
    cp = _get(args, "context_parallel_size", 1)
    need(cp == 1, f"--context-parallel-size {cp}: context parallelism is not supported by "
         "--use-dpp (the schedule runs forward_step with one context-parallel rank)")
    need(not _get(args, "overlap_param_gather", False),
         "--overlap-param-gather is not supported with --use-dpp (the dynamic order has no "
         "fixed first forward per chunk to gather parameters before)")
    graphs = _get(args, "cuda_graph_impl", "none")
    need(graphs != "full_iteration", "--cuda-graph-impl full_iteration captures the static "
         "schedule's whole iteration: not with --use-dpp")
    need(not _get(args, "use_torch_fsdp2", False) and not _get(args, "use_megatron_fsdp", False),
         "--use-torch-fsdp2 / --use-megatron-fsdp: --use-dpp works with megatron-core's DDP "
         "(and its distributed optimizer), not FSDP")
    need(not _get(args, "deterministic_mode", False),
         "--deterministic-mode: --use-dpp runs each stage's backwards in the order their "
         "gradients arrive, so weight gradients accumulate in a varying order")
    need(_get(args, "yaml_cfg") is None, "--yaml-cfg: the DPP plugin reads its flags from "
         "the command line; pass them there")
    group = _get(args, "microbatch_group_size_per_vp_stage")
    need(group is None or group == pp, f"--microbatch-group-size-per-vp-stage "
         f"{group}: --use-dpp runs the microbatches of a virtual stage in groups of "
         f"--pipeline-model-parallel-size {pp}")
    if _get(args, "dpp_split_backward", False):
        impl = _get(args, "transformer_impl", "transformer_engine")
        need(impl == "local", f"--dpp-split-backward with --transformer-impl {impl}: only "
             "megatron-core's local layers defer their weight gradients (use "
             "--transformer-impl local)")
        need(_get(args, "gradient_accumulation_fusion", True),
             "--dpp-split-backward defers the fused weight-gradient accumulation: drop "
             "--no-gradient-accumulation-fusion (the plugin supplies the kernel where apex "
             "is absent)")
        need(not _get(args, "defer_embedding_wgrad_compute", False),
             "--defer-embedding-wgrad-compute with --dpp-split-backward: the split already "
             "defers the output layer's weight gradient")
        need(not _get(args, "delay_wgrad_compute", False),
             "--delay-wgrad-compute is Transformer Engine's own B/W split: use "
             "--dpp-split-backward alone")
        need(not _get(args, "overlap_grad_reduce", False) or _get(args, "align_grad_reduce",
                                                                  True),
             "--dpp-split-backward with --overlap-grad-reduce needs the trainer's "
             "grad_sync_func (drop --no-align-grad-reduce): each chunk's reduction starts "
             "after its last W")
    else:
        need(not _get(args, "dpp_defer_weights", False), "--dpp-defer-weights places the W "
             "tasks of the split backward: it needs --dpp-split-backward")
    return found
