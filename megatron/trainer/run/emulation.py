"""The trainer's side of the emulated variability (megatron/dpp/variability.py's draws,
megatron/dpp/transport/emulation.py's machinery):
each rank's pod, the emulated links under megatron-core's schedules, and the stragglers
around both schedules' forward and backward tasks (the same hook for megatron-core's
schedules and DPP's, so the same tasks straggle under each)."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.distributed as dist

from megatron.dpp.actions import BACKWARD, FORWARD
from megatron.dpp.transport.emulation import CudaSleep, StretchedTask
from megatron.dpp.variability import Emulation
from megatron.trainer.config.configs import ProcessConfig
from megatron.trainer.run.rng import ForwardRng


def pod_of(process: ProcessConfig) -> str | None:
    """This rank's pod: its node's address under --multi-node --node-ips (the node is
    torchrun's GROUP_RANK), else None (its host name decides)."""
    if not (process.multi_node and process.node_ips):
        return None
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    node = int(os.environ.get("GROUP_RANK", dist.get_rank() // max(local, 1)))
    return process.node_ips[node]


def gather_pods(pod: str | None) -> list[str]:
    """Every rank's pod, by global rank (collective)."""
    pods: list = [None] * dist.get_world_size()
    dist.all_gather_object(pods, pod or os.uname().nodename)
    return pods


class Stragglers:
    """Wraps a schedule's forward step (inside ForwardRng's, whose key it reads): a
    straggling forward is stretched after it ran; a straggling backward, from the moment
    its output's gradient arrives to the end of that backward pass (an autograd callback).
    Each task's factor is Emulation.straggle_factor of (iteration, microbatch, pipeline
    stage, local chunk, kind), the simulator's draw."""

    def __init__(self, emulation: Emulation, rng: ForwardRng, device: torch.device):
        self.emulation = emulation
        self.rng = rng
        self.device = device
        self.sleeper = CudaSleep() if device.type == "cuda" else None

    def wrap(self, forward_step: Callable) -> Callable:
        def straggling_forward_step(data_iterator, model, *args):
            task = StretchedTask(self.device)
            output, loss_func = forward_step(data_iterator, model, *args)
            # the step just run set the key (ForwardRng's wrapper runs inside this one)
            forward_factor = self._factor(FORWARD)
            if forward_factor > 1:
                task.finish(forward_factor, self.sleeper, FORWARD)
            backward_factor = self._factor(BACKWARD)
            if isinstance(output, torch.Tensor) and output.requires_grad and backward_factor > 1:
                output.register_hook(lambda grad: self._stretch_backward(grad, backward_factor))
            return output, loss_func

        return straggling_forward_step

    def _factor(self, kind: str) -> float:
        """The straggle factor of the task of `kind` of the forward step last run."""
        iteration, microbatch, virtual_stage = self.rng.current_key
        chunk = virtual_stage // self.rng.pp_size
        return self.emulation.straggle_factor(iteration, microbatch, self.rng.pp_rank, chunk,
                                              kind)

    def _stretch_backward(self, grad, factor: float):
        task = StretchedTask(self.device)
        torch.autograd.Variable._execution_engine.queue_callback(
            lambda: task.finish(factor, self.sleeper, BACKWARD))
        return grad
