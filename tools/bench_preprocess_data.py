"""Measures tools/preprocess_data.py throughput (MB/s of JSON input) on the sample corpus.

The input is datasets_gpt/dataset.json repeated until it reaches --size-mb, in a temporary
folder; the timing covers reading, tokenizing and writing, not tokenizer loading.

    python tools/bench_preprocess_data.py --size-mb 100 --workers 2
"""

import argparse
import logging
import os
import platform
import shutil
import sys
import tempfile
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.preprocess_data import parse_args, preprocess  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
logger = logging.getLogger("bench_preprocess_data")


def write_repeated_input(source: str, destination: str, size_bytes: int) -> int:
    with open(source, "rb") as handle:
        corpus = handle.read()
    written = 0
    with open(destination, "wb") as out:
        while written < size_bytes:
            out.write(corpus)
            written += len(corpus)
    return written


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=float, default=100.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="runs; the report lists each")
    parser.add_argument("--tokenizer-type", default="GPT2BPETokenizer")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logger.setLevel(logging.INFO)

    data = os.path.join(REPO_ROOT, "datasets_gpt")
    workdir = tempfile.mkdtemp(prefix="bench_preprocess_")
    try:
        input_path = os.path.join(workdir, "input.json")
        size = write_repeated_input(os.path.join(data, "dataset.json"), input_path,
                                    int(args.size_mb * 1e6))
        rates = []
        for run in range(args.repeats):
            run_args = parse_args([
                "--input", input_path,
                "--output-prefix", os.path.join(workdir, "out"),
                "--tokenizer-type", args.tokenizer_type,
                "--vocab-file", os.path.join(data, "vocab.json"),
                "--merge-file", os.path.join(data, "merges.txt"),
                "--append-eod",
                "--workers", str(args.workers),
                "--log-interval", str(10**9),
            ])
            wall_start = time.perf_counter()
            summary = preprocess(run_args)
            wall = time.perf_counter() - wall_start
            rates.append(summary.megabytes_per_second)
            logger.info(
                "run %d: %.1f MB, %d documents, %d tokens in %.2f s -> %.2f MB/s "
                "(%.2f s including tokenizer load)",
                run + 1, size / 1e6, summary.documents, summary.tokens, summary.seconds,
                summary.megabytes_per_second, wall,
            )
        logger.info(
            "%s, %d workers, %d cores (%s): median %.2f MB/s",
            args.tokenizer_type, args.workers, os.cpu_count(), platform.processor() or "cpu",
            sorted(rates)[len(rates) // 2],
        )
    finally:
        shutil.rmtree(workdir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
