"""--defer-embedding-wgrad-compute: the last stage's output layer runs its weight-gradient
GEMMs at the end of the iteration, under megatron-core's 1F1B schedule and under DPP, with
the losses and gradients of the run without it."""

from __future__ import annotations

import contextlib
import re
from unittest import mock

import pytest
import torch

from megatron.trainer.config.arguments import ArgumentError, parse_args
from tests.distributed import run_ranks
from tests.pipeline_runs import TINY_GPT, one_step, unwrap
from tests.trainer_runs import with_flags

PP2 = [*TINY_GPT, "--pipeline-model-parallel-size", "2", "--global-batch-size", "8"]
MICROBATCHES = 4
DEFER = ["--defer-embedding-wgrad-compute"]


def _core_drain(recorded: list):
    from megatron.core.pipeline_parallel import schedules

    original = schedules.drain_embedding_wgrad_compute

    def drain(config, inputs, grad_outputs, weight, tp_group):
        recorded.append((len(inputs), bool(weight.main_grad.count_nonzero() == 0)))
        return original(config, inputs, grad_outputs, weight, tp_group)

    return mock.patch.object(schedules, "drain_embedding_wgrad_compute", drain)


def _dpp_drain(recorded: list):
    from megatron.dpp.output_weight_grad import DeferredOutputWeightGrads

    original = DeferredOutputWeightGrads._accumulate

    def accumulate(self, pairs):
        if pairs:
            weight = self.module.shared_embedding_or_output_weight()
            recorded.append((len(pairs), bool(weight.main_grad.count_nonzero() == 0)))
        return original(self, pairs)

    return mock.patch.object(DeferredOutputWeightGrads, "_accumulate", accumulate)


def _steps(rank, flag_sets, world_size):
    """Rank function: per flag list, one step of megatron-core's schedule and one of DPP on
    the same model and batch; their (losses, grads) and the drains each ran."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron.dpp.config import DppOptions
    from megatron.dpp.schedule import DppSchedule
    from megatron.trainer.run import initialize
    from megatron.trainer.run.training import setup
    from megatron.trainer.tasks.gpt import GPT_TASK
    from tests.trainer_runs import _destroy_model_parallel_only

    initialize._shutdown = _destroy_model_parallel_only  # several set-ups in one process
    results = []
    for flags in flag_sets:
        args = parse_args(flags, world_size=world_size)
        result = {}
        with contextlib.ExitStack() as stack:
            trainer = setup(GPT_TASK, args, stack)
            dpp = DppSchedule(DppOptions(transport="torch"))
            stack.callback(dpp.close)
            for name, schedule, recording in (("core", get_forward_backward_func(), _core_drain),
                                              ("dpp", dpp, _dpp_drain)):
                drains = []
                with recording(drains):
                    result[name] = one_step(trainer, schedule, MICROBATCHES)
                    # evaluation in between leaves nothing behind for the next step
                    one_step(trainer, schedule, MICROBATCHES, forward_only=True)
                result[f"{name}_drains"] = drains
            output = unwrap(trainer.model[-1])
            result["buffers_left"] = tuple(len(getattr(output, name, None) or ()) for name in
                                           ("embedding_activation_buffer", "grad_output_buffer"))
        results.append(result)
    return results


def _assert_same(result, reference):
    ref_losses, ref_grads = reference
    losses, grads = result
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), atol=1e-5,
                               rtol=1e-6)
    assert set(grads) == set(ref_grads)
    for name, (grad, _) in grads.items():
        torch.testing.assert_close(grad, ref_grads[name][0], atol=2e-6, rtol=1e-5, msg=name)


def test_deferred_output_weight_grads_equal_the_plain_backward():
    limited = DEFER + ["--wgrad-deferral-limit", "3"]
    untied = [*PP2, "--untie-embeddings-and-output-weights"]
    runs = [PP2, PP2 + DEFER, PP2 + limited, untied, untied + limited]
    plain, every, limited, untied_plain, untied_limited = zip(*run_ranks(2, _steps, runs, 2),
                                                              strict=True)
    for rank in (0, 1):
        for reference, results in ((plain[rank], (plain, every, limited)),
                                   (untied_plain[rank], (untied_plain, untied_limited))):
            for result in results:
                _assert_same(result[rank]["core"], reference["core"])
                _assert_same(result[rank]["dpp"], reference["core"])
    last = 1
    # the GEMMs really waited: one drain at the end, before any had run (limit 0); with
    # --wgrad-deferral-limit 3 the fourth microbatch's ran in its backward (DPP: right after
    # it, the first to reach main_grad)
    assert every[last]["core_drains"] == every[last]["dpp_drains"] == [(MICROBATCHES, True)]
    for result in (limited[last], untied_limited[last]):
        assert result["core_drains"] == [(3, False)]
        assert result["dpp_drains"] == [(1, True), (3, False)]
    assert plain[last]["core_drains"] == plain[last]["dpp_drains"] == []
    for result in (every[last], limited[last], untied_limited[last]):
        assert result["buffers_left"] == (0, 0)


@pytest.mark.parametrize("extra, message", [
    (["--wgrad-deferral-limit", "2"], "--wgrad-deferral-limit 2 needs "
     "--defer-embedding-wgrad-compute"),
    (DEFER + ["--wgrad-deferral-limit", "-1"], "must be >= 0"),
    (DEFER + ["--pipeline-model-parallel-size", "1"], "needs --pipeline-model-parallel-size > 1"),
    (DEFER + ["--no-gradient-accumulation-fusion"], "drop --no-gradient-accumulation-fusion"),
    (DEFER + ["--overlap-grad-reduce"], "before the flush adds the deferred"),
    (DEFER + ["--use-dpp", "--dpp-split-backward"], "the split already defers the output "
     "layer's weight gradient"),
    (DEFER + ["--wgrad-deferral-limit", "1"], "fails on a single deferred microbatch"),
    (DEFER + ["--global-batch-size", "2"], "one microbatch per iteration"),
])
def test_combinations_it_cannot_honour_are_refused(extra, message):
    with pytest.raises(ArgumentError, match=re.escape(message)):
        parse_args(with_flags(PP2, **_as_overrides(extra)), world_size=2)


def test_a_single_deferred_microbatch_is_fine_under_dpp():
    parse_args(PP2 + DEFER + ["--wgrad-deferral-limit", "1", "--use-dpp"], world_size=2)


def _as_overrides(flags: list[str]) -> dict:
    """["--a", "1", "--b"] -> {"a": "1", "b": True} for with_flags."""
    overrides, key = {}, None
    for item in flags:
        if item.startswith("--"):
            key = item[2:].replace("-", "_")
            overrides[key] = True
        else:
            overrides[key] = item
    return overrides
