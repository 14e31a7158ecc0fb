"""What `--use-dpp` installs in Megatron-LM's trainer (megatron.training), and undoes.

Megatron-LM's train() and evaluate() ask `get_forward_backward_func()` for the schedule of
every call; megatron.training.training imported that name from megatron.core.pipeline_parallel
when it was loaded, so the plugin replaces it there (and in megatron.core.pipeline_parallel,
for code that asks later) with a function that returns the one DppSchedule of the run. With
--dpp-split-backward it also puts the weight-gradient accumulation kernel where megatron-core's
local linear layers call it (apex's, if installed, stays), so that the model is built with the
gradient-accumulation fusion and a WeightGradStore can defer those calls to W tasks.

Every name patched or relied on is declared below (the schedule's own in
megatron/dpp/compat/core_internals.py) and checked before anything is patched.
"""

from __future__ import annotations

import contextlib
import logging

from megatron.dpp.compat import core_internals
from megatron.dpp.compat.core_internals import Internal
from megatron.dpp.config import DppOptions
from megatron.dpp.weight_grad_accumulation import weight_grad_accumulation_fusion

log = logging.getLogger(__name__)

_TRAINING = "megatron.training.training"
_USER = "dpp/megatron_lm/plugin.py DppPlugin.activate"

# the name Megatron-LM's train() and evaluate() call for their schedule
TRAINER_SCHEDULE = Internal(
    f"{_TRAINING}:get_forward_backward_func", "patched", _USER,
    read_by=("get_forward_backward_func(",), read_in=f"{_TRAINING}:train")
EVALUATE_SCHEDULE = Internal(
    f"{_TRAINING}:evaluate", "private", _USER, read_by=("get_forward_backward_func(",),
    read_in=f"{_TRAINING}:evaluate")
# the same function where megatron-core exports it (code that imports it after start-up)
CORE_SCHEDULE = Internal(
    "megatron.core.pipeline_parallel:get_forward_backward_func", "patched", _USER,
    keywords=("pp_size", "vp_size"))

PLUGIN_INTERNALS = (TRAINER_SCHEDULE, EVALUATE_SCHEDULE, CORE_SCHEDULE)


class DppPlugin:
    """The DPP schedule in Megatron-LM's trainer for one run (`args`: Megatron-LM's parsed
    arguments with the plugin's flags). `activate()` checks and patches, `close()` restores
    megatron's functions and closes the schedule's channels."""

    def __init__(self, args):
        self.options = DppOptions.from_args(args)
        self.split_backward = bool(getattr(args, "dpp_split_backward", False))
        self._stack = contextlib.ExitStack()
        self._schedule = None

    def activate(self) -> None:
        core_internals.verify(PLUGIN_INTERNALS + core_internals.INTERNALS)
        with contextlib.ExitStack() as stack:
            if self.split_backward:
                stack.enter_context(weight_grad_accumulation_fusion())
            stack.enter_context(TRAINER_SCHEDULE.swapped(self.get_forward_backward_func))
            stack.enter_context(CORE_SCHEDULE.swapped(self.get_forward_backward_func))
            stack.callback(self._close_schedule)
            self._stack = stack.pop_all()
        log.info("DPP plugin: Megatron-LM's trainer runs the dynamic pipeline schedule (%s%s)",
                 self.options, ", each backward split into B and W" if self.split_backward
                 else "")

    def close(self) -> None:
        self._stack.close()

    def get_forward_backward_func(self, pp_size=None, vp_size=None,
                                  schedule_pg_collection=None):
        """Stands in for megatron-core's function of the same parameters: the run's one
        DppSchedule, which reads the pipeline from megatron-core's parallel_state (a
        multi-module collection, as multimodal models pass, is refused)."""
        if type(schedule_pg_collection).__name__ == "MultiModuleProcessGroupCollection":
            raise ValueError("--use-dpp: models of several modules with their own process "
                             "groups (MultiModuleProcessGroupCollection) are not supported")
        if self._schedule is None:
            from megatron.dpp.schedule import DppSchedule
            from megatron.dpp.weight_grad import WeightGradStore

            store = WeightGradStore() if self.split_backward else None
            self._schedule = DppSchedule(self.options, store)
        return self._schedule

    def _close_schedule(self) -> None:
        if self._schedule is not None:
            self._schedule.close()
            self._schedule = None
