"""MegatronDPP: the dynamic pipeline-parallel schedule and its transports."""

from __future__ import annotations


def get_forward_backward_func(args=None, weight_grads=None, pod=None, emulation=None):
    """The DPP schedule when `args.use_dpp`, megatron.core's schedule otherwise.
    `weight_grads` (a WeightGradStore): DPP splits each backward into B and W tasks; `pod`
    and `emulation`: this rank's pod and the emulated links (transport/pipeline.py)."""
    if args is not None and not getattr(args, "use_dpp", False):
        from megatron.core.pipeline_parallel import get_forward_backward_func as core_func

        return core_func()
    from megatron.dpp.config import DppOptions
    from megatron.dpp.schedule import DppSchedule

    if args is None:
        return DppSchedule(weight_grads=weight_grads)
    return DppSchedule(DppOptions.from_args(args), weight_grads, pod, emulation)
