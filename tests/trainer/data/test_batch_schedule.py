"""megatron/trainer/data/batch_schedule.py: the trainer's own batch-size calculator gives the
batch sizes megatron-core's calculators gave (0.16's ramp-up, 0.18+'s step schedule), under
whichever megatron-core is installed."""

import json

import pytest

from megatron.trainer.data.batch_schedule import (
    BatchScheduleError,
    BatchSizeSchedule,
    RampUp,
    StepSchedule,
    batch_size_schedule,
)
from tests import TESTS

GOLDEN = TESTS / "golden"


def _core_calculator(name: str):
    """megatron-core's own calculator, where the installed release has it."""
    import megatron.core.num_microbatches_calculator as calculators

    return getattr(calculators, name, None)


def _same_steps(ours, theirs, consumed_samples, check: bool):
    """Both calculators updated after each count of consumed samples: the same global batch
    size and microbatch count, or both refusing the size."""
    for consumed in consumed_samples:
        try:
            theirs.update(consumed, check)
        except AssertionError:
            with pytest.raises(BatchScheduleError, match="is not divisible by"):
                ours.update(consumed, check)
            continue
        ours.update(consumed, check)
        assert (ours.get_current_global_batch_size(), ours.get()) == (
            theirs.get_current_global_batch_size(), theirs.get()), consumed


def test_ramp_up_gives_megatron_core_0_16s_batch_sizes():
    """At every consumed-sample count: the sizes megatron-core 0.16.1 gave (recorded by
    tests/golden/record_batch_sizes.py), and, where the installed megatron-core still has
    the ramp-up calculator (<= 0.17), the live one's sizes and microbatch counts."""
    golden = json.loads((GOLDEN / "megatron_core_0.16.1" / "rampup_batch_sizes.json").read_text())
    live = _core_calculator("RampupBatchsizeNumMicroBatchesCalculator")
    assert len(golden) > 50
    for key, changes in golden.items():
        start, increment, samples, end = map(int, key.split())
        ours = RampUp(start, increment, samples, end)
        for consumed in range(samples + 3):
            expected = [size for first, size in changes if first <= consumed][-1]
            assert ours.size_at(consumed) == expected, (key, consumed)
        if live is None:
            continue
        counts = range(samples + 3)
        for micro_batch_size, data_parallel_size in ((1, 1), (2, 1), (1, 4), (2, 3)):
            theirs = live(end, micro_batch_size, data_parallel_size, False, 0, start, increment,
                          samples)
            schedule = BatchSizeSchedule(ours, micro_batch_size, data_parallel_size)
            assert (schedule.get_current_global_batch_size(), schedule.get()) == (
                theirs.get_current_global_batch_size(), theirs.get())
            _same_steps(schedule, theirs, counts, check=False)
            _same_steps(schedule, theirs, counts, check=True)


def test_step_schedule_gives_megatron_cores_batch_sizes():
    """Megatron-LM's --step-batch-size-schedule as megatron-core 0.19.2's calculator reads
    it (recorded), and as the installed one does where it has it (>= 0.18)."""
    golden = json.loads((GOLDEN / "megatron_core_0.19.2" / "step_batch_sizes.json").read_text())
    live = _core_calculator("StepBatchsizeNumMicroBatchesCalculator")
    for key, sizes in golden.items():
        text, _, seq_length = key.partition("|")
        seq_length = int(seq_length) if seq_length else None
        ours = StepSchedule.parse(text, seq_length)
        assert [[consumed, ours.size_at(consumed)] for consumed, _ in sizes] == sizes, key
        if live is None:
            continue
        theirs = live(2, 2, False, 0, text, seq_length)
        schedule = BatchSizeSchedule(ours, 2, 2)
        consumed = [consumed for consumed, _ in sizes]
        _same_steps(schedule, theirs, consumed, check=False)
        _same_steps(schedule, theirs, consumed, check=True)


def test_ramp_up_steps_by_the_increment_then_stays_at_the_global_batch_size():
    schedule = batch_size_schedule(8, 1, 1, [2, 2, 12])  # 3 increments, 4 samples each
    sizes = []
    for consumed in (0, 3, 4, 7, 8, 11, 12, 13, 10**6):
        schedule.update(consumed, True)
        sizes.append(schedule.get_current_global_batch_size())
    assert sizes == [2, 2, 4, 4, 6, 6, 8, 8, 8]
    # a run consumes 2, 2, 4, 6, 8 ...: the steps at which each size starts
    assert schedule.first_iterations(100) == {2: 1, 4: 3, 6: 4, 8: 5}
    assert schedule.iterations_for_samples(14 + 80) == 4 + 10


def test_step_schedule_thresholds_count_tokens_with_suffixes():
    steps = StepSchedule.parse("0:16 2.4B:320 4.8B:624", seq_length=2048)
    assert steps.steps == ((0, 16), (2_400_000_000 // 2048, 320), (4_800_000_000 // 2048, 624))
    schedule = BatchSizeSchedule(steps, 1, 16)
    schedule.update(2_400_000_000 // 2048 - 1, True)
    assert (schedule.get_current_global_batch_size(), schedule.get()) == (16, 1)
    schedule.update(2_400_000_000 // 2048, True)
    assert (schedule.get_current_global_batch_size(), schedule.get()) == (320, 20)
    assert StepSchedule.parse("0:8 1k:16", None).steps == ((0, 8), (1000, 16))


@pytest.mark.parametrize("text, seq_length, problem", [
    ("16:8 32:16", None, "the first threshold must be 0"),
    ("0:8 130:16 150:32", 64, "two thresholds fall on 2 samples of --seq-length 64"),
    ("0:8 x:16", None, "'X' is not a number"),
    ("0:8 2.5:16", None, "'2.5' is not a whole count"),
    ("0:8 10", None, "entry '10' is not THRESHOLD:BATCH_SIZE"),
    ("0:0", None, "batch size 0 must be >= 1"),
])
def test_bad_step_schedule_is_named(text, seq_length, problem):
    with pytest.raises(BatchScheduleError, match="--step-batch-size-schedule") as error:
        StepSchedule.parse(text, seq_length)
    assert problem in str(error.value)


@pytest.mark.parametrize("ramp, end, problem", [
    ((8, 2, 16), 8, "the start must be below --global-batch-size 8"),
    ((2, 4, 16), 8, "--global-batch-size 8 minus the start is not a multiple of the increment"),
    ((2, 2, 0), 8, "start, increment and samples must be >= 1"),
])
def test_bad_ramp_up_is_named(ramp, end, problem):
    with pytest.raises(BatchScheduleError) as error:
        RampUp(*ramp, end=end)
    assert str(error.value) == f"--rampup-batch-size {' '.join(map(str, ramp))}: {problem}"


def test_a_size_that_does_not_split_into_microbatches_is_named_when_checked():
    schedule = batch_size_schedule(8, 2, 1, [2, 1, 40])
    schedule.update(9, False)  # size 3: rounds down without the check, as megatron-core did
    assert (schedule.get_current_global_batch_size(), schedule.get()) == (3, 1)
    with pytest.raises(BatchScheduleError, match=r"--rampup-batch-size 2 1 40: global batch "
                                                 r"size 3 \(after 9 samples\) is not divisible "
                                                 r"by --micro-batch-size 2 x data-parallel size 1"):
        schedule.update(9, True)
