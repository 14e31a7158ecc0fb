"""Dynamic pipeline (DPP) flags and the fast path's defaults (fused kernels, CUDA graphs)."""

from __future__ import annotations

import argparse
import os

from megatron.trainer.config.addresses import is_ip_address
from megatron.trainer.config.args_common import add_flags, cuda_available
from megatron.trainer.config.configs import FastPathConfig, ScheduleConfig


def dpp_args(g):
    add_flags(g, {
        "--use-dpp": "dynamic pipeline schedule instead of megatron-core's static one",
        "--dpp-max-inflight int":
            "forces the extra microbatches in flight beyond the static schedule's count "
            "(default: chosen from 0-2 by what the first iterations measure: the message time "
            "between stages, the task times, the activations; logged once)",
        "--dpp-memory-budget str": (
            "the activations a stage may hold while DPP chooses its slack: a factor of "
            "megatron-core 1F1B's busiest stage (1.15x) or a size per stage (12GB, "
            "800MB); default 1.15x on GPUs, no cap beyond the slack's 2 elsewhere"),
        "--dpp-transport {auto,torch,shm,rdma} = auto": None,
        "--dpp-timeout float = 60.0":
            "seconds a stage waits for a pipeline peer before raising",
        "--dpp-split-backward": dict(
            action=argparse.BooleanOptionalAction, default=None,
            help="split each backward into input gradients (B) and deferred weight gradients "
                 "(W): with --use-dpp the dynamic schedule places the W tasks; at PP=1 each W "
                 "runs right after its B (default: on with --use-dpp on GPUs where the layers "
                 "allow it, fast_path.py)"),
        "--dpp-defer-weights": dict(
            action=argparse.BooleanOptionalAction, default=None,
            help="with the split backward: defer each W as ZB-H1 does, up to p - 1 backwards "
                 "after its B, so that every stage holds up to stage 0's microbatches (faster "
                 "where lengths are uniform, more memory on the later stages); default off: "
                 "each W right after its B, megatron-core 1F1B's memory on every stage"),
        "--dpp-static": dict(
            action=argparse.BooleanOptionalAction, default=None,
            help="with --use-dpp: run the DPP plan (1F1B, interleaved, their split with W "
                 "tasks) in order, never deviating: the static schedule on the same runtime "
                 "(default: on for one model chunk of uniform lengths on GPUs, where it "
                 "measured faster; fast_path.py)"),
        "--multi-node": "the job spans nodes: checked against torchrun's WORLD_SIZE and "
                        "LOCAL_WORLD_SIZE at start-up",
        "--node-ips str": dict(nargs="+", help="one address per node, in node-rank order; "
                               "checked against the node count and MASTER_ADDR (node 0)"),
        # retired flags, named in the error that refuses them
        "--workload int": argparse.SUPPRESS,
        "--num-gpus int": argparse.SUPPRESS,
    })


def fast_path_args(g):
    """The fast path's features are on by default where they apply; these turn them off."""
    off = dict(action="store_false", default=None)
    add_flags(g, {
        "--no-cross-entropy-loss-fusion": dict(
            off, dest="cross_entropy_loss_fusion",
            help="megatron-core's unfused cross-entropy even where the fused one is the "
                 "default"),
        "--no-triton-fusions": dict(
            off, dest="triton_fusions",
            help="torch's layer norm and megatron-core's torch.compile'd bias-dropout-add and "
                 "bias-GeLU, not the project's Triton kernels (the default on a GPU with "
                 "Triton; fast_path.py)"),
        "--no-gelu-gemm-epilogue": dict(
            off, dest="gelu_gemm_epilogue",
            help="fc1's GEMM then a separate bias-GeLU kernel, not cuBLASLt's bias-GeLU "
                 "epilogue (the default on a GPU for the local layers' MLP; fast_path.py)"),
    })


def validate_dpp(args, need):
    if args.workload is not None:
        need(False, f"--workload {args.workload}: no longer used; the native transport sizes its "
             "copies itself (see --dpp-transport)")
    if args.num_gpus is not None:
        need(False, f"--num-gpus {args.num_gpus}: no longer used; torchrun's --nproc_per_node "
             "sets the GPUs per node")
    ScheduleConfig.rules(args, need)
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


def validate_cuda_graphs(args, need):
    impl = args.cuda_graph_impl
    if impl in ("local", "transformer_engine"):
        need(False, f"--cuda-graph-impl {impl}: " + (
            "megatron-core's graphs replay one fixed microbatch order, which --use-dpp does "
            "not follow" if args.use_dpp else
            "megatron-core's graphs are captured by Megatron-LM's training loop (its CUDA graph "
            "manager / Transformer Engine's), which this trainer does not run") +
            "; use --cuda-graph-impl block")
    limit = args.cuda_graph_memory_limit
    need(limit is None or impl == "block",
         f"--cuda-graph-memory-limit {limit} needs --cuda-graph-impl block")
    FastPathConfig.rules(args, need)
    if impl != "block":
        return
    # by default only where fast_path.Machine found CUDA
    need(args.cuda_graphs_by_default or cuda_available(),
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


def resolve_fast_path(args) -> None:
    """The defaults of the fast path for this machine, before the flags are validated;
    `args.fast_path_fallbacks` keeps the lines that the trainer logs (fast_path.py)."""
    from megatron.trainer.config import fast_path

    args.cuda_graphs_by_default = args.cuda_graph_impl == "auto"
    args.fast_path_fallbacks = fast_path.resolve(args, fast_path.Machine.detect())
