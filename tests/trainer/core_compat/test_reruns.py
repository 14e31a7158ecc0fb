"""--rerun-mode (megatron/trainer/core_compat/reruns.py): megatron-core's rerun state machine
around the training step, under megatron-core's schedule and DPP. Validating changes no loss; an
iteration whose result is rejected (injected here, as Megatron-LM's functional tests do)
runs again on the replayed microbatches and gives the clean run's losses; a reproduced
rejection saves a checkpoint and stops with Megatron-LM's status 16, an unreproduced fatal
one with 17; report_stats logs how much two runs of each iteration differ."""

from __future__ import annotations

import pytest
import torch

from megatron.trainer.config.arguments import ArgumentError, parse_args
from megatron.trainer.core_compat.reruns import ResultValidationStop
from megatron.trainer.run.failures import known_failure
from tests.distributed import run_ranks
from tests.trainer_runs import TINY, train_runs, with_flags

# 4 microbatches per iteration on two pipeline stages
PP2 = with_flags(TINY, pipeline_model_parallel_size=2, train_iters=4, global_batch_size=8)
VALIDATE = with_flags(PP2, rerun_mode="validate_results")
# every validated result is rejected once (from iteration 2: the machine validates nothing
# before the first optimizer step); only the spiky-loss check, which is not fatal
TRANSIENT_SPIKES = with_flags(VALIDATE, error_injection_rate=1, check_for_spiky_loss=True,
                              no_check_for_nan_in_loss_and_grad=True)
LOSS_CHECK = "found NaN in local forward loss calculation"
AGAIN = "running it again"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    save = tmp_path_factory.mktemp("rerun_checkpoint")
    flags = [
        PP2,
        VALIDATE,
        TRANSIENT_SPIKES,
        with_flags(TRANSIENT_SPIKES, use_dpp=True),
        with_flags(PP2, rerun_mode="report_stats"),
        with_flags(VALIDATE, error_injection_rate=1, error_injection_type="persistent_error",
                   save=str(save)),
        with_flags(PP2, rerun_mode="report_stats", load=str(save)),  # resumes from it
        with_flags(VALIDATE, error_injection_rate=1, error_injection_type="transient_error"),
    ]
    by_rank = run_ranks(2, train_runs, flags, 2, "gpt", None, (ResultValidationStop,))
    return by_rank[1], save  # the last stage: losses and the loss checks


def _lines(run, text):
    return [message for _, message in run["logs"] if text in message]


@pytest.mark.slow
def test_validation_without_faults_trains_as_disabled(runs):
    (clean, validated, *_), _ = runs
    assert len(clean["losses"]) == 4
    assert validated["losses"] == clean["losses"]
    assert not _lines(validated, AGAIN)


@pytest.mark.slow
@pytest.mark.parametrize("which", [2, 3], ids=["megatron-core-schedule", "dpp"])
def test_transient_rejection_reruns_the_iteration_and_training_goes_on(runs, which):
    (clean, *_), _ = runs
    run = runs[0][which]
    assert run["losses"] == clean["losses"]  # the re-run's microbatches are the same ones
    assert _lines(run, AGAIN) == [f"iteration {i}: {AGAIN} (--rerun-mode validate_results)"
                                  for i in (2, 3, 4)]
    assert run["state"]["iteration"] == 4


@pytest.mark.slow
def test_report_stats_runs_each_iteration_twice_and_logs_the_differences(runs):
    (clean, *_), _ = runs
    report = runs[0][4]
    assert report["losses"] == clean["losses"]
    assert len(_lines(report, AGAIN)) == 4
    # after iterations 1 and 3 (Megatron-LM reports every two); 4 microbatches each, run
    # twice with the same dropout keys and data: no difference
    stats = _lines(report, f"| {LOSS_CHECK} |")
    assert [line.split(" (")[0] for line in stats] == [
        "determinism of iterations 1-1", "determinism of iterations 2-3"]
    assert stats[0].endswith("| 4 samples, all identical"), stats
    assert stats[1].endswith("| 8 samples, all identical"), stats


@pytest.mark.slow
def test_reproduced_rejection_saves_a_checkpoint_and_stops_with_status_16(runs):
    _, save = runs
    persistent = runs[0][5]
    message, status = persistent["stopped"]
    assert status == 16
    assert message.startswith(f"result validation at iteration 2: {LOSS_CHECK} (on rank 1); "
                              "the rejected result was reproduced"), message
    assert "resume on another GPU" in message
    # iteration 2's optimizer step did not run: the checkpoint is iteration 1's
    assert f"saved {save / 'iter_0000001'}" in message
    assert (save / "iter_0000001").is_dir()
    assert persistent["losses"] == runs[0][0]["losses"][:1]
    # resumed from it, the run trains on as the clean run did; report_stats' count of
    # iterations goes on from the checkpoint's (a report after iteration 3, Megatron-LM's)
    resumed = runs[0][6]
    assert resumed["losses"] == runs[0][0]["losses"][1:]
    assert [line.split(" (")[0] for line in _lines(resumed, f"| {LOSS_CHECK} |")] == [
        "determinism of iterations 2-3"]


@pytest.mark.slow
def test_unreproduced_fatal_rejection_stops_with_status_17(runs):
    transient = runs[0][7]
    message, status = transient["stopped"]
    assert status == 17
    assert f"iteration 2: {LOSS_CHECK} (on rank 1); the rejected result was not reproduced" \
        in message
    # the pretrain entry point exits with that status, naming the fault in its one line
    assert known_failure(ResultValidationStop(message, status)) == (message, 17)


def _parse_error(flags) -> str:
    with pytest.raises(ArgumentError) as error:
        parse_args(flags, world_size=2)
    return str(error.value)


def test_flags_that_would_do_nothing_are_refused():
    assert "--error-injection-rate 5 injects rejections for --rerun-mode validate_results" \
        in _parse_error(with_flags(PP2, error_injection_rate=5))
    assert "with --rerun-mode report_stats nothing would re-run them" in _parse_error(
        with_flags(PP2, rerun_mode="report_stats", error_injection_rate=5))
    assert "--error-injection-rate -1 must be >= 0" in _parse_error(
        with_flags(VALIDATE, error_injection_rate=-1))
    assert "--check-for-spiky-loss needs --rerun-mode validate_results or report_stats" in \
        _parse_error(with_flags(PP2, check_for_spiky_loss=True))


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the state machine saves and restores "
                    "the CUDA generator and reduces its flags on CUDA tensors: needs a CUDA GPU")
@pytest.mark.long
def test_reruns_on_a_gpu():
    """One GPU, bf16, dropout on, the fast path's defaults (graphed blocks): the re-runs give
    the clean run's losses (bitwise: --deterministic-mode, as Megatron-LM's rerun tests)."""
    gpu = with_flags(TINY, bf16=True, hidden_dropout=0.1, train_iters=4, global_batch_size=8,
                     deterministic_mode=True)
    spikes = with_flags(gpu, rerun_mode="validate_results", error_injection_rate=1,
                        check_for_spiky_loss=True, no_check_for_nan_in_loss_and_grad=True)
    (results,) = run_ranks(1, train_runs, [gpu, spikes, with_flags(
        gpu, rerun_mode="report_stats")], 1, gpu=True)
    clean, transient, report = results
    assert transient["losses"] == clean["losses"] == report["losses"]
    assert len(_lines(transient, AGAIN)) == 3 and len(_lines(report, AGAIN)) == 4
