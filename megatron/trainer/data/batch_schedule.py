"""The global batch size over a run, and the microbatches each training step takes.

megatron-core 0.18 removed the ramp-up calculator the trainer used, and 0.18's step
schedule does not exist in 0.16, so the trainer keeps its own (all megatron-core releases
it supports then behave alike). Three ways to size the global batch:

* constant: `--global-batch-size`;
* ramp-up, `--rampup-batch-size START INCREMENT SAMPLES`: START, then INCREMENT more each
  time another SAMPLES / ((GLOBAL - START) / INCREMENT) samples have been consumed, and
  GLOBAL once more than SAMPLES have. The arithmetic (a float quotient, truncated) is
  megatron-core 0.16's, so a run sees the same batch sizes as before;
* steps, Megatron-LM's `--step-batch-size-schedule "0:16 2.4B:320 ..."`: the batch size of
  the last threshold reached, thresholds counted in tokens (suffixes K, M, B, T) and turned
  into samples by the sequence length (rounded down), as Megatron-LM does.

`BatchSizeSchedule` has the interface the training loop uses (that of megatron-core's
calculators): `get()` (microbatches per step), `get_current_global_batch_size()`,
`update(consumed_samples, consistency_check)`.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

log = logging.getLogger(__name__)

_SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


class BatchScheduleError(ValueError):
    """A batch-size schedule that cannot be followed; the message names the flag."""


@dataclass(frozen=True)
class ConstantBatchSize:
    size: int

    def __post_init__(self):
        if self.size < 1:
            raise BatchScheduleError(f"--global-batch-size {self.size} must be >= 1")

    @property
    def flag(self) -> str:
        return f"--global-batch-size {self.size}"

    @property
    def end(self) -> int:
        return self.size

    @property
    def final_from(self) -> int:
        """Consumed samples from which the size is `end`."""
        return 0

    def size_at(self, consumed_samples: int) -> int:
        return self.size


@dataclass(frozen=True)
class RampUp:
    """`--rampup-batch-size start increment samples` up to `--global-batch-size end`."""

    start: int
    increment: int
    samples: int
    end: int

    def __post_init__(self):
        if min(self.start, self.increment, self.samples) < 1:
            raise BatchScheduleError(f"{self.flag}: start, increment and samples must be >= 1")
        if self.start >= self.end:
            raise BatchScheduleError(f"{self.flag}: the start must be below "
                                     f"--global-batch-size {self.end}")
        if (self.end - self.start) % self.increment:
            raise BatchScheduleError(f"{self.flag}: --global-batch-size {self.end} minus the "
                                     "start is not a multiple of the increment")

    @property
    def flag(self) -> str:
        return f"--rampup-batch-size {self.start} {self.increment} {self.samples}"

    @property
    def final_from(self) -> int:
        return self.samples + 1

    def size_at(self, consumed_samples: int) -> int:
        if consumed_samples > self.samples:
            return self.end
        samples_per_increment = self.samples / ((self.end - self.start) // self.increment)
        return self.start + int(consumed_samples / samples_per_increment) * self.increment


@dataclass(frozen=True)
class StepSchedule:
    """Megatron-LM's `--step-batch-size-schedule`: (threshold in samples, batch size) pairs,
    thresholds strictly increasing from 0."""

    text: str
    steps: tuple[tuple[int, int], ...]

    @classmethod
    def parse(cls, text: str, seq_length: int | None) -> StepSchedule:
        """`text` is "THRESHOLD:SIZE ..." (spaces or commas between entries). With
        `seq_length` the thresholds count tokens (Megatron-LM's trainer passes it), else
        samples."""
        flag = f"--step-batch-size-schedule {text!r}"
        steps = []
        for entry in text.replace(",", " ").split():
            threshold, colon, size = entry.partition(":")
            if not colon:
                raise BatchScheduleError(f"{flag}: entry {entry!r} is not THRESHOLD:BATCH_SIZE")
            threshold, size = _count(threshold, flag), _count(size, flag)
            if seq_length is not None:
                threshold //= seq_length
            if size < 1:
                raise BatchScheduleError(f"{flag}: batch size {size} must be >= 1")
            steps.append((threshold, size))
        steps.sort()
        if not steps or steps[0][0] != 0:
            raise BatchScheduleError(f"{flag}: the first threshold must be 0")
        for (before, _), (after, _) in itertools.pairwise(steps):
            if after == before:
                unit = f" samples of --seq-length {seq_length}" if seq_length else ""
                raise BatchScheduleError(f"{flag}: two thresholds fall on {before}{unit}")
        return cls(text, tuple(steps))

    @property
    def flag(self) -> str:
        return f"--step-batch-size-schedule {self.text!r}"

    @property
    def end(self) -> int:
        return self.steps[-1][1]

    @property
    def final_from(self) -> int:
        return self.steps[-1][0]

    def size_at(self, consumed_samples: int) -> int:
        size = self.steps[0][1]
        for threshold, step_size in self.steps:
            if consumed_samples < threshold:
                break
            size = step_size
        return size


def _count(text: str, flag: str) -> int:
    """An integer, optionally with a K/M/B/T suffix ("2.4B" is 2,400,000,000)."""
    text = text.strip().upper()
    multiplier = _SUFFIXES.get(text[-1:], 1)
    digits = text[:-1] if multiplier > 1 else text
    try:
        value = Decimal(digits) * multiplier
    except InvalidOperation:
        raise BatchScheduleError(f"{flag}: {text!r} is not a number") from None
    if value != value.to_integral_value() or value < 0:
        raise BatchScheduleError(f"{flag}: {text!r} is not a whole count")
    return int(value)


class BatchSizeSchedule:
    """The trainer's microbatch calculator: one of the sizings above, split into microbatches
    of `micro_batch_size` on each of `data_parallel_size` replicas."""

    def __init__(self, sizes, micro_batch_size: int, data_parallel_size: int):
        self.sizes = sizes
        self.micro_batch_size = micro_batch_size
        self.data_parallel_size = data_parallel_size
        self.global_batch_size = None
        self.num_microbatches = None
        self.update(0, consistency_check=False)

    def get(self) -> int:
        """Microbatches per data-parallel replica in the current step."""
        return self.num_microbatches

    def get_current_global_batch_size(self) -> int:
        return self.global_batch_size

    def get_micro_batch_size(self) -> int:
        return self.micro_batch_size

    def update(self, consumed_samples: int, consistency_check: bool) -> None:
        """The batch size for the step after `consumed_samples` samples. With
        `consistency_check`, a size that does not split into whole microbatches on every
        replica is an error (without it the microbatch count rounds down)."""
        size = self.sizes.size_at(consumed_samples)
        per_round = self.micro_batch_size * self.data_parallel_size
        if consistency_check and size % per_round:
            raise BatchScheduleError(
                f"{self.sizes.flag}: global batch size {size} (after {consumed_samples} "
                f"samples) is not divisible by --micro-batch-size {self.micro_batch_size} x "
                f"data-parallel size {self.data_parallel_size}")
        if self.global_batch_size is not None and size != self.global_batch_size:
            log.info("global batch size %d -> %d after %d samples (%s)", self.global_batch_size,
                     size, consumed_samples, self.sizes.flag)
        self.global_batch_size = size
        self.num_microbatches = size // per_round

    def first_iterations(self, train_iters: int) -> dict[int, int]:
        """Each global batch size the first `train_iters` steps use -> the first step (from
        1) that uses it."""
        first, consumed = {}, 0
        for iteration in range(1, train_iters + 1):
            size = self.sizes.size_at(consumed)
            first.setdefault(size, iteration)
            if consumed >= self.sizes.final_from:
                break
            consumed += size
        return first

    def iterations_for_samples(self, train_samples: int) -> int:
        """Steps until at least `train_samples` samples are consumed (--train-samples)."""
        iterations, consumed = 0, 0
        while consumed < min(train_samples, self.sizes.final_from):
            consumed += self.sizes.size_at(consumed)
            iterations += 1
        remaining = max(0, train_samples - consumed)
        return iterations + -(-remaining // self.sizes.end)


def batch_size_schedule(global_batch_size: int | None, micro_batch_size: int,
                        data_parallel_size: int, rampup_batch_size=None,
                        step_batch_size_schedule: str | None = None,
                        seq_length: int | None = None) -> BatchSizeSchedule:
    """The schedule the flags ask for. A step schedule sets the final global batch size
    itself (Megatron-LM refuses it together with --global-batch-size)."""
    if step_batch_size_schedule is not None:
        if rampup_batch_size is not None:
            raise BatchScheduleError("--step-batch-size-schedule and --rampup-batch-size "
                                     "exclude each other")
        sizes = StepSchedule.parse(step_batch_size_schedule, seq_length)
    elif rampup_batch_size is not None:
        sizes = RampUp(*rampup_batch_size, end=global_batch_size)
    else:
        sizes = ConstantBatchSize(global_batch_size)
    return BatchSizeSchedule(sizes, micro_batch_size, data_parallel_size)
