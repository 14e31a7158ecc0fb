"""Runs megatron.core on CPU processes (tests, the demo on machines without a GPU).

megatron.core hard-codes CUDA in many places (`device="cuda"`, `.cuda()`,
`torch.cuda.current_device()`, `torch.cuda.synchronize()`, `torch.cuda.current_stream()`,
type strings such as "torch.cuda.FloatTensor"). `CpuCompat` maps all of them onto the CPU
for the thread that enters it. It is only ever entered when no GPU is used, so the GPU path
never pays for it.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from megatron.trainer.core_compat import core_overrides

_CPU = torch.device("cpu")
_NO_CUDA_GENERATOR = torch.empty(0, dtype=torch.uint8)


def _as_cpu(device):
    if device is None:
        return None
    if isinstance(device, int):
        return _CPU
    if isinstance(device, str) and device.startswith("cuda"):
        return _CPU
    if isinstance(device, torch.device) and device.type == "cuda":
        return _CPU
    return device


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA devices in torch calls to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1)
        if "device" in kwargs:
            kwargs["device"] = _as_cpu(kwargs["device"])
        if func is torch.device and len(args) == 1 and isinstance(args[0], int):
            # torch.device(torch.cuda.current_device()), entered as the default device by
            # MLA's YaRN rotary embedding
            return _CPU
        if func in (torch.Tensor.to,) and args:
            args = tuple(_as_cpu(a) if isinstance(a, (str, torch.device)) else a for a in args)
        return func(*args, **kwargs)

    def __exit__(self, exc_type, exc_val, exc_tb):
        # a Ctrl-C that lands inside torch's dispatch to this mode, after torch took the mode
        # off the stack and before it put it back, unwinds with the mode already off: popping
        # again would pop another mode or raise, replacing the KeyboardInterrupt
        if exc_type is not None and self not in _get_current_function_mode_stack():
            return None
        return super().__exit__(exc_type, exc_val, exc_tb)


def _backward_in_mode(apply):
    """The autograd engine runs backward without the caller's function modes: megatron.core's
    custom backwards (the linear layers' placeholder weight gradient, sequence parallelism's
    reduce-scatter buffer) would still ask for CUDA tensors."""

    def backward_apply(ctx, *grads):
        with _CudaToCpuMode():
            return apply(ctx, *grads)

    return backward_apply


class _HostStream:
    """The current "CUDA stream" of a CPU rank: work is done when it is issued, so there is
    never anything to wait for (megatron-core 0.19's DDP waits on it before reducing)."""

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def synchronize(self) -> None:
        pass


class CpuCompat(contextlib.ExitStack):
    """Enter in every CPU rank (the function mode is thread-local)."""

    def __enter__(self):
        super().__enter__()
        self.enter_context(_CudaToCpuMode())
        backward = torch.autograd.function.BackwardCFunction
        self.enter_context(mock.patch.object(backward, "apply", _backward_in_mode(backward.apply)))
        host_stream = _HostStream()
        for name, value in (
            ("current_device", lambda: 0),
            ("synchronize", lambda *a, **k: None),
            ("device_count", lambda: 0),
            ("current_stream", lambda *a, **k: host_stream),
            # megatron-core's rerun state machine saves and restores the CUDA generator
            # with the CPU one before re-running an iteration; there is none on CPU
            ("get_rng_state", lambda *a, **k: _NO_CUDA_GENERATOR),
            ("set_rng_state", lambda *a, **k: None),
        ):
            self.enter_context(mock.patch.object(torch.cuda, name, value))
        # activation recomputation saves and restores the CUDA generator next to the CPU one;
        # on CPU every draw comes from the CPU generator, which it restores as well
        self.enter_context(core_overrides.GET_CUDA_RNG_STATE.swapped(lambda *a, **k: None))
        self.enter_context(core_overrides.SET_CUDA_RNG_STATE.swapped(lambda *a, **k: None))
        return self

