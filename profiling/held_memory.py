"""Activation memory each pipeline schedule holds on a variable-length batch: per rank, the
peak bytes of the tensors autograd keeps for backward (megatron/trainer/run/activation_memory.py)
in one training step of the first global batch of --variable-seq-lengths GPT on CPU
processes, the test's model and batch (tests/trainer/data/test_variable_lengths.py).

    python profiling/held_memory.py --data-path /tmp/gpt_text_document --pp 4

Schedules: megatron-core's 1F1B in the natural order and fed DPP's cost order, DPP at
slack 0 and 2 (cost order, token cap).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the repository's packages
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.distributed import run_ranks  # noqa: E402
from tests.trainer.data.test_variable_lengths import base_flags, held_activation_bytes  # noqa: E402
from tests.trainer_runs import with_flags  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-path", required=True,
                        help="a GPT prefix (tools/preprocess_data.py on datasets_gpt)")
    parser.add_argument("--pp", type=int, default=4)
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    flags = with_flags(base_flags(args.data_path), pipeline_model_parallel_size=args.pp)
    results = run_ranks(args.pp, held_activation_bytes, flags, args.pp)
    names = list(results[0]["peaks"])
    sys.stdout.write(f"microbatch token counts: {results[0]['costs']}\n\n")
    sys.stdout.write("| rank | " + " | ".join(f"{n} (MiB)" for n in names) + " |\n")
    sys.stdout.write("|---" * (len(names) + 1) + "|\n")
    for rank, result in enumerate(results):
        cells = " | ".join(f"{result['peaks'][n] / 2**20:.3f}" for n in names)
        sys.stdout.write(f"| {rank} | {cells} |\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
