"""MegatronDPP: the dynamic pipeline-parallel schedule and its transports."""

from __future__ import annotations


def get_forward_backward_func(args=None):
    """The DPP schedule when `args.use_dpp`, megatron.core's schedule otherwise."""
    if args is not None and not getattr(args, "use_dpp", False):
        from megatron.core.pipeline_parallel import get_forward_backward_func as core_func

        return core_func()
    from megatron.dpp.schedule import DEFAULT_SLACK, DppOptions, DppSchedule

    if args is None:
        return DppSchedule()
    slack = DEFAULT_SLACK if args.dpp_max_inflight is None else args.dpp_max_inflight
    return DppSchedule(DppOptions(slack=slack, transport=args.dpp_transport,
                                  timeout=args.dpp_timeout))
