"""Record the global batch sizes megatron-core's own calculators give, as goldens for
tests/trainer/data/test_batch_schedule.py (which also compares with the live calculator where the
installed megatron-core has it):

    python tests/golden/record_batch_sizes.py                 # megatron-core 0.16.1: ramp-up
    VENV/bin/python tests/golden/record_batch_sizes.py        # 0.18 or later: step schedule

Writes tests/golden/megatron_core_<version>/rampup_batch_sizes.json (0.16's
RampupBatchsizeNumMicroBatchesCalculator: for each "start increment samples global", the
consumed-sample count at which each batch size starts, scanned sample by sample) or
.../step_batch_sizes.json (0.18+'s StepBatchsizeNumMicroBatchesCalculator: for each
"schedule|sequence length", (consumed samples, batch size) around every threshold).
"""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent

RAMPS = [(start, increment, samples, end)
         for start, increment, samples, end in itertools.product(
             (1, 2, 6), (1, 2, 3, 4), (1, 7, 24, 100, 1000), (8, 12, 24))
         if start < end and (end - start) % increment == 0]
# (schedule, sequence length or None: thresholds in samples)
STEP_SCHEDULES = [("0:16 2.4K:32 4.8K:64", 8), ("0:4, 10:8, 25:12", None), ("0:6 1M:12", 1000),
                  ("0:16 2.4B:320 4.8B:624 7.2B:928", 2048), ("0:3 7:5 3:4", None)]


def ramp_thresholds(calculator_class, start, increment, samples, end) -> list[list[int]]:
    """[consumed samples, batch size] where the size changes, scanning every count."""
    calculator = calculator_class(end, 1, 1, False, 0, start, increment, samples)
    changes, size = [], None
    for consumed in range(samples + 3):
        calculator.update(consumed, False)
        if calculator.get_current_global_batch_size() != size:
            size = calculator.get_current_global_batch_size()
            changes.append([consumed, size])
    return changes


def step_sizes(calculator_class, text, seq_length) -> list[list[int]]:
    """[consumed samples, batch size] one below, at and one above each threshold."""
    calculator = calculator_class(1, 1, False, 0, text, seq_length)
    points = set()
    for number in re.findall(r"([\d.]+)([KMBT]?):", text.upper()):
        value = int(float(number[0]) * {"": 1, "K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}[number[1]])
        threshold = value // seq_length if seq_length else value
        points |= {max(0, threshold + d) for d in (-1, 0, 1)}
    sizes = []
    for consumed in sorted(points):
        calculator.update(consumed, False)
        sizes.append([consumed, calculator.get_current_global_batch_size()])
    return sizes


def _write(path: Path, golden: dict) -> None:
    """One entry a line."""
    lines = [f"{json.dumps(key)}: {json.dumps(value)}" for key, value in golden.items()]
    path.write_text("{\n" + ",\n".join(lines) + "\n}\n")


def main() -> None:
    import megatron.core.num_microbatches_calculator as calculators
    from megatron.core import package_info

    directory = HERE / f"megatron_core_{package_info.__version__}"
    directory.mkdir(exist_ok=True)
    if hasattr(calculators, "RampupBatchsizeNumMicroBatchesCalculator"):
        ramp_class = calculators.RampupBatchsizeNumMicroBatchesCalculator
        golden = {" ".join(map(str, ramp)): ramp_thresholds(ramp_class, *ramp) for ramp in RAMPS}
        _write(directory / "rampup_batch_sizes.json", golden)
    if hasattr(calculators, "StepBatchsizeNumMicroBatchesCalculator"):
        step_class = calculators.StepBatchsizeNumMicroBatchesCalculator
        golden = {f"{text}|{seq_length or ''}": step_sizes(step_class, text, seq_length)
                  for text, seq_length in STEP_SCHEDULES}
        _write(directory / "step_batch_sizes.json", golden)
    print(f"wrote goldens of megatron-core {package_info.__version__} to {directory}")


if __name__ == "__main__":
    main()
