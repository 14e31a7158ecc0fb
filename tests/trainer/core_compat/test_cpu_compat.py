"""CpuCompat's exit when a Ctrl-C lands inside torch's dispatch to its function mode."""

import pytest
import torch
from torch.overrides import _get_current_function_mode_stack

from megatron.trainer.core_compat.cpu_compat import CpuCompat


def test_interrupt_between_torchs_pop_and_push_of_the_mode_stays_an_interrupt():
    """torch takes a function mode off its stack while it runs the mode's handler and puts it
    back afterwards; a KeyboardInterrupt between the two unwinds with the mode already off.
    The interrupt must reach the caller as itself (exit status 130, one line), not as
    "trying to pop from empty mode stack", and nothing of CpuCompat may stay installed."""
    current_device = torch.cuda.current_device
    with pytest.raises(KeyboardInterrupt):
        with CpuCompat():
            assert torch.empty(1, device="cuda").device.type == "cpu"
            torch._C._pop_torch_function_stack()  # where torch's dispatch stood
            raise KeyboardInterrupt
    assert _get_current_function_mode_stack() == []
    assert torch.cuda.current_device is current_device
