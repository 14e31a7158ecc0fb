"""--deterministic-mode: what makes two runs of the same flags give bitwise-equal results,
as Megatron-LM sets it up. Argument validation refuses the options that would not
(megatron/trainer/config/args_megatron_lm.py `_validate_deterministic_mode`)."""

from __future__ import annotations

import contextlib
import logging
import os

import torch

log = logging.getLogger(__name__)

# set where unset (validation refuses other values): NCCL's reduction algorithm must not
# vary between runs (NVLS reduces in the switches), cuBLAS needs a fixed workspace for
# deterministic GEMMs, and TE's attention must pick its deterministic kernels
ENVIRONMENT = {
    "NCCL_ALGO": "Ring",
    "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
    "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0",
}


@contextlib.contextmanager
def deterministic_mode(enabled: bool):
    """For the run's duration (before NCCL starts: it reads NCCL_ALGO once); the previous
    settings come back afterwards, which lets tests run several configurations in one
    process."""
    if not enabled:
        yield
        return
    saved_env = {name: os.environ.get(name) for name in ENVIRONMENT}
    saved_torch = (torch.are_deterministic_algorithms_enabled(),
                   torch.is_deterministic_algorithms_warn_only_enabled(),
                   torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    for name, value in ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    log.info("deterministic mode: torch's deterministic algorithms, %s",
             ", ".join(f"{name}={os.environ[name]}" for name in ENVIRONMENT))
    try:
        yield
    finally:
        enabled_before, warn_only, cudnn_deterministic, cudnn_benchmark = saved_torch
        torch.use_deterministic_algorithms(enabled_before, warn_only=warn_only)
        torch.backends.cudnn.deterministic = cudnn_deterministic
        torch.backends.cudnn.benchmark = cudnn_benchmark
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
