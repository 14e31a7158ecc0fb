"""Emulated variability flags: a slow or jittery link between pipeline stages, straggling
compute tasks (megatron/dpp/variability.py, megatron/dpp/transport/emulation.py;
docs/two_pods.md)."""

from __future__ import annotations

from megatron.trainer.config.args_common import add_flags, cuda_available
from megatron.trainer.config.configs import EmulationConfig


def emulation_args(g):
    add_flags(g, {
        "--emulate-link-ms str": dict(
            metavar="D[,J]",
            help="emulated link: each message on an emulated edge becomes usable D ms (plus a "
                 "uniform 0..J ms) after it was sent; time only, values untouched (off by "
                 "default)"),
        "--emulate-link-gbps float": dict(
            metavar="G", help="emulated link: add each message's size / G GB/s to its delay"),
        "--emulate-link-edges {pods,all} = pods":
            "the edges the emulated link delays: those between pods (--node-ips) or every "
            "pipeline edge",
        "--emulate-straggler str": dict(
            metavar="STAGES:PROB:FACTOR",
            help="emulated stragglers: with probability PROB a forward or backward on STAGES "
                 "(a stage number, a comma list or all) takes FACTOR times as long; the draw "
                 "is keyed by (seed, iteration, microbatch, stage, chunk, task), the same for "
                 "every schedule and the simulator"),
    })


def validate_emulation(args, need) -> None:
    EmulationConfig.rules(args, need)
    if args.emulate_link_ms is not None and args.emulate_link_edges == "pods":
        pods = len(args.node_ips or ()) if args.multi_node else 0
        need(pods >= 2, f"--emulate-link-ms {args.emulate_link_ms} with --emulate-link-edges "
             "pods: this job has one pod, so no edge would be emulated; run across pods "
             "(--multi-node --node-ips) or emulate every edge with --emulate-link-edges all")
    if args.emulate_link_ms is not None and not args.use_dpp and cuda_available():
        need(not args.overlap_p2p_communication_warmup_flush,
             "--emulate-link-ms on GPUs delays megatron-core's messages once it waited for "
             "them; --overlap-p2p-communication-warmup-flush leaves them unwaited")
    if args.emulate_link_ms is not None or args.emulate_straggler is not None:
        need(args.pipeline_model_parallel_size > 1, "--emulate-link-ms and "
             "--emulate-straggler emulate a pipeline: they need "
             "--pipeline-model-parallel-size > 1")
    text = args.emulate_straggler
    if text is not None:
        try:
            stages = EmulationConfig.from_args(args).emulation().straggler.stages
        except ValueError:
            return  # the rules named the problem
        pp = args.pipeline_model_parallel_size
        need(stages is None or all(stage < pp for stage in stages),
             f"--emulate-straggler {text}: stages are 0..{pp - 1} at "
             f"--pipeline-model-parallel-size {pp}")
