"""--rerun-mode: megatron-core's rerun state machine around the training step, as in
Megatron-LM.

validate_results: each microbatch's loss is checked for NaN and Inf (and, with
--check-for-spiky-loss, for ten times the largest of the first 100 losses), and DDP checks each
gradient bucket's norm before reducing it. A rejected result from the second iteration on
re-runs the iteration in place: the state machine restores the RNG states, the data iterators
replay the same microbatches (megatron-core's RerunDataIterator) and ForwardRng keys dropout by
microbatch, so a healthy device computes the same numbers again. Then:
* not reproduced (a transient fault): a fatal check (NaN, Inf) stops the run with exit status
  17; a non-fatal one (spiky loss) continues with the re-run's result;
* reproduced: a checkpoint of the last completed iteration is saved and the run stops with
  status 16, to be resumed on another GPU to tell a persistent fault from a correct result.
report_stats: every iteration runs twice and the relative differences between the two runs'
results are logged every two iterations (non-determinism of the kernels).
disabled: no re-runs; the check below still applies.

Whatever the mode, a non-finite loss or gradient norm stops the run after the iteration
(`stop_on_non_finite`, on by default as in Megatron-LM; --no-check-for-nan-in-loss-and-grad
trains on): the optimizer step has then already spread it into the parameters, so nothing
is saved, and the last checkpoint stays the one to resume from.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import rerun_state_machine as core_reruns

from megatron.trainer.core_compat import core_overrides

log = logging.getLogger(__name__)

MODES = ("disabled", "validate_results", "report_stats")
INJECTION_TYPES = ("correct_result", "transient_error", "persistent_error")
# Megatron-LM's pretrain_gpt.py: a spiky loss is ten times the largest loss seen
SPIKY_LOSS_FACTOR = 10
# megatron-core's names of the modes (its report mode is spelled differently)
_CORE_MODES = {
    "disabled": core_reruns.RerunMode.DISABLED,
    "validate_results": core_reruns.RerunMode.VALIDATE_RESULTS,
    "report_stats": core_reruns.RerunMode.REPORT_DETERMINISM_STATS,
}
_STATUS_MEANING = {
    core_reruns.EXIT_CODE_RESUME_TO_DISAMBIGUATE:
        "the rejected result was reproduced by re-running the iteration on this device; "
        "resume on another GPU to tell a persistent fault from a correct result",
    core_reruns.EXIT_CODE_FAILED_ON_RESULT_VALIDATION:
        "the rejected result was not reproduced by re-running the iteration: a transient "
        "fault of this device",
}


@dataclass(frozen=True)
class RerunConfig:
    mode: str = "disabled"
    error_injection_rate: int = 0  # inject into one in this many validations (0: none)
    error_injection_type: str = "transient_error"
    check_for_nan: bool = True  # NaN / Inf losses and gradient norms (fatal)
    check_for_spiky_loss: bool = False  # non-fatal

    @classmethod
    def from_args(cls, args) -> RerunConfig:
        return cls(args.rerun_mode, args.error_injection_rate, args.error_injection_type,
                   args.check_for_nan_in_loss_and_grad, args.check_for_spiky_loss)

    @property
    def enabled(self) -> bool:
        return self.mode != "disabled"

    @property
    def checks_gradients(self) -> bool:
        """megatron-core's DDP validates each bucket's gradient norm through the machine."""
        return self.enabled and self.check_for_nan


class ResultValidationStop(RuntimeError):
    """The state machine ended the run; `status` is Megatron-LM's exit status for it."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class NonFiniteResult(RuntimeError):
    """An iteration's loss or gradient norm is NaN or Inf."""


def stop_on_non_finite(iteration: int, losses: dict[str, float],
                       grad_norm: float | None) -> None:
    """Raise NonFiniteResult where this rank's reduced losses (the last pipeline stage's)
    or the gradient norm (the same on every rank) are NaN or Inf."""
    bad = [f"{name} {value}" for name, value in losses.items() if not math.isfinite(value)]
    if grad_norm is not None and not math.isfinite(grad_norm):
        bad.append(f"grad norm {grad_norm}")
    if bad:
        raise NonFiniteResult(
            f"iteration {iteration}: non-finite {', '.join(bad)}; stopped without saving (the "
            "parameters are no longer finite); resume from the last checkpoint, e.g. with a "
            "lower --lr (--no-check-for-nan-in-loss-and-grad trains on)")


@dataclass(frozen=True)
class Verdict:
    """What the state machine decided after an iteration's forward-backward passes."""

    checkpoint: bool
    status: int
    message: str


class _StateMachine(core_reruns.RerunStateMachine):
    """megatron-core's machine, reporting report_stats' figures through this trainer's log
    on the last rank (0.16's own report reads fields its Caller does not have, and
    megatron.core's INFO lines are muted here)."""

    first_unreported = 1  # iteration, counted from 1

    def _maybe_report_stats(self) -> None:
        if self.current_iteration % self.REPORTING_INTERVAL_ITERATIONS != 0:
            return
        reporter = dist.get_world_size() - 1
        gathered = [None] * dist.get_world_size() if dist.get_rank() == reporter else None
        dist.gather_object({caller.message: stats for caller, stats in self.stats.items()},
                           gathered, dst=reporter)
        self.stats.clear()
        first, self.first_unreported = self.first_unreported, self.current_iteration + 2
        if gathered is None:
            return
        combined: dict[str, core_reruns.QuickStats] = {}
        for stats_of_rank in gathered:
            for message, stats in stats_of_rank.items():
                combined.setdefault(message, core_reruns.QuickStats()).combine([stats])
        for message in sorted(combined):
            log.info("determinism of iterations %d-%d (each run twice) | %s | %s", first,
                     self.current_iteration + 1, message, combined[message].print_stats())


class ResultValidation:
    """One per run: installs megatron-core's state machine and gives the training step its
    loop, data iterators and checked loss functions."""

    def __init__(self, config: RerunConfig):
        self.config = config

    def start(self, stack: contextlib.ExitStack, completed_iterations: int = 0) -> None:
        """Install the machine (megatron-core's DDP and RerunDataIterator find it through its
        global) for a run that has `completed_iterations` (a loaded checkpoint's); removed
        when `stack` closes."""
        core_reruns.destroy_rerun_state_machine()
        injector = core_reruns.RerunErrorInjector(
            error_injection_rate=self.config.error_injection_rate,
            error_injection_type=core_reruns.RerunDiagnostic(self.config.error_injection_type))
        machine = _StateMachine(mode=_CORE_MODES[self.config.mode], error_injector=injector)
        # its count goes up as each iteration starts, from 0 for the first (as in Megatron-LM)
        machine.current_iteration = completed_iterations - 1
        machine.first_unreported = completed_iterations + 1
        core_overrides.SET_RERUN_STATE_MACHINE.resolve()(machine)
        stack.callback(core_reruns.destroy_rerun_state_machine)

    def data_iterators(self, iterators):
        """Each iterator able to replay the microbatches of the iteration (as is, when
        disabled: nothing is ever replayed)."""
        if not self.config.enabled:
            return iterators
        if isinstance(iterators, list):
            return [self.data_iterators(it) for it in iterators]
        return None if iterators is None else core_reruns.RerunDataIterator(iterators)

    def runs(self, data_iterator, iteration: int) -> Iterator[int]:
        """Yields once per forward-backward run of `iteration`: once, or again when the
        machine re-runs it (`data_iterator` rewound)."""
        machine = core_reruns.get_rerun_state_machine()
        run = 0
        while machine.should_run_forward_backward(data_iterator):
            if run:
                log.warning("iteration %d: running it again (--rerun-mode %s)", iteration,
                            self.config.mode)
            yield run
            run += 1

    def verdict(self, iteration: int) -> Verdict | None:
        """None to go on with the optimizer step; else the checkpoint and exit the machine
        asks for."""
        machine = core_reruns.get_rerun_state_machine()
        checkpoint, stop, status = machine.should_checkpoint_and_exit()
        if not stop:
            return None
        failed = machine.failed_validation_call
        check = failed.caller.message if failed is not None else "a check"
        meaning = _STATUS_MEANING.get(status, "stopped by the rerun state machine")
        return Verdict(checkpoint, status, f"result validation at iteration {iteration}: "
                       f"{check} (on rank {failed.caller.rank if failed else '?'}); {meaning} "
                       f"(exit status {status})")

    def checked(self, forward_step_func: Callable) -> Callable:
        """The forward step whose loss function reports its result to the machine."""
        if not self.config.enabled:
            return forward_step_func

        def forward_step(data_iterator, model, *args):
            output, loss_func = forward_step_func(data_iterator, model, *args)
            return output, functools.partial(self._checked_loss, loss_func)

        return forward_step

    def _checked_loss(self, loss_func, output):
        result = loss_func(output)
        # a copy: the schedules divide the loss in place afterwards, and the machine keeps
        # the first run's result to compare with the re-run's
        loss = result[0].detach().clone()
        machine = core_reruns.get_rerun_state_machine()
        if self.config.check_for_nan:
            # the forward pass is deterministic: a re-run must give the very same loss
            machine.validate_result(result=loss, rejection_func=torch.isnan, tolerance=0.0,
                                    message="found NaN in local forward loss calculation")
            machine.validate_result(result=loss, rejection_func=torch.isinf, tolerance=0.0,
                                    message="found Inf in local forward loss calculation")
        if self.config.check_for_spiky_loss:
            spiky = functools.partial(machine.is_unexpectedly_large,
                                      threshold=SPIKY_LOSS_FACTOR, context="loss")
            machine.validate_result(result=loss, rejection_func=spiky, message="Spiky loss",
                                    tolerance=0.0, fatal=False)
        return result
