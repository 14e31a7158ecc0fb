"""Process start-up: torch.distributed from torchrun's environment, megatron.core's
parallel groups, seeds, and the CPU compatibility layer when there is no GPU."""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import random

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from megatron.dpp.transport.pipeline import EDGE_LOGGER
from megatron.trainer.config.arguments import ArgumentError
from megatron.trainer.core_compat.cpu_compat import CpuCompat
from megatron.trainer.run.determinism import deterministic_mode
from megatron.trainer.run.settings_agreement import check_settings_agree

log = logging.getLogger(__name__)


# megatron.core's WARNINGs at every start that ask nothing of a user: the rerun machine's
# default (off), and 0.19's notice that GPTModel takes bug fixes only (the trainer builds it)
_CORE_NOISE = (("megatron.core.rerun_state_machine", "RerunStateMachine initialized"),
               ("megatron.core.models.gpt.gpt_model", "GPTModel IS DEPRECATED"))


def setup_logging(rank: int, world_size: int) -> None:
    """INFO from rank 0 (set-up) and from the last rank (it holds the losses, as in
    Megatron), and each rank's pipeline edges; warnings from everyone. megatron.core's own chatter only at DEBUG."""
    level = logging.getLevelName(os.environ.get("MEGATRON_LOG_LEVEL", "INFO").upper())
    logging.basicConfig(
        level=level if rank == 0 else max(logging.WARNING, level),
        format=f"[%(asctime)s rank{rank}] %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )
    if rank == world_size - 1:
        logging.getLogger("megatron.trainer").setLevel(level)
        logging.getLogger("megatron.dpp").setLevel(level)
    # every rank names the transport of each pipeline edge it owns
    logging.getLogger(EDGE_LOGGER).setLevel(level)
    if level > logging.DEBUG:
        logging.getLogger("megatron.core").setLevel(logging.WARNING)
        for name, start in _CORE_NOISE:
            logging.getLogger(name).addFilter(
                lambda record, start=start: not record.getMessage().startswith(start))


def initialize_distributed(configs, stack: contextlib.ExitStack) -> torch.device:
    """Join the job (torchrun's env:// rendezvous), create megatron.core's groups and
    return this rank's device. CPU runs enter `CpuCompat` on `stack`."""
    parallel, process = configs.parallel, configs.process
    use_gpu = parallel.distributed_backend == "nccl"
    if use_gpu and not torch.cuda.is_available():
        raise ArgumentError("--distributed-backend nccl needs a GPU; use gloo on CPU")
    local_rank = int(os.environ.get("LOCAL_RANK", process.local_rank or 0))
    if use_gpu:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        stack.enter_context(CpuCompat())
    stack.enter_context(deterministic_mode(configs.layers.deterministic_mode))
    if not dist.is_initialized():
        # no device_id: bound to a device, torch creates every group's NCCL communicator at
        # once, and megatron-core's groups then held 7.8 GB of an H100 in a one-GPU job
        # (1.0 GB for two groups created at their first collective, torch's default). The
        # device is the one set above either way
        dist.init_process_group(
            backend=parallel.distributed_backend,
            timeout=datetime.timedelta(minutes=parallel.distributed_timeout_minutes),
        )
    if dist.get_world_size() != parallel.world_size:
        raise RuntimeError(
            f"world size changed between argument parsing ({parallel.world_size}) and "
            f"rendezvous ({dist.get_world_size()})"
        )
    stack.push(_shutdown)
    # before megatron-core's groups: their sizes come from the settings compared here
    check_settings_agree(configs)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size,
        context_parallel_size=parallel.context_parallel_size,
        distributed_timeout_minutes=int(max(1, parallel.distributed_timeout_minutes)),
        order=process.rank_order,
        num_distributed_optimizer_instances=parallel.num_distributed_optimizer_instances,
        create_gloo_process_groups=not configs.optimizer.disable_gloo_process_groups,
    )
    set_seeds(process.seed, use_gpu)
    return device


def set_seeds(seed: int, use_gpu: bool) -> None:
    """Data-order and dropout seeds differ per pipeline stage, as in Megatron; weights do
    not depend on them (see models.initialize_layout_independent)."""
    stage_seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(stage_seed)
    np.random.seed(stage_seed)
    torch.manual_seed(stage_seed)
    tensor_parallel.model_parallel_cuda_manual_seed(
        stage_seed, inference_rng_tracker=not use_gpu
    )


def _shutdown(exc_type, exc, traceback) -> bool:
    """Leave the job cleanly after success. After an error, skip it: tearing down NCCL
    while a peer still waits in a collective hangs, and the launcher ends the peers."""
    if exc_type is None and dist.is_initialized():
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    return False
