"""Length distribution of a `.bin`/`.idx` prefix, in tokens: the documents, the samples that
`--variable-seq-lengths` makes of them at a given --seq-length, and the padded microbatches'
token counts (what the cost order and the memory cap see), without and with grouping.

    python tools/document_lengths.py --data-path datasets_gpt/gpt_text_document \
        --seq-length 1024 --micro-batch-size 2 --global-batch-size 32
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron.trainer.data.documents import (  # noqa: E402
    DocumentDataConfig,
    build_document_datasets,
    document_lengths,
    length_statistics,
)
from megatron.trainer.data.microbatches import BatchLayout, plan_global_batch  # noqa: E402


def line(name: str, stats: dict) -> str:
    return (f"{name:<28} n {int(stats['documents']):>7}  mean {stats['mean']:8.1f}  "
            f"cv {stats['cv']:.2f}  min {stats['min']:.0f}  p10 {stats['p10']:.0f}  "
            f"p50 {stats['p50']:.0f}  p90 {stats['p90']:.0f}  p99 {stats['p99']:.0f}  "
            f"max {stats['max']:.0f}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-path", required=True)
    parser.add_argument("--seq-length", type=int, action="append",
                        help="repeatable (default: 512, 1024, 2048)")
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--global-batch-size", type=int, default=32)
    parser.add_argument("--pad-to-multiple", type=int, default=8)
    parser.add_argument("--batches", type=int, default=50, help="global batches to sample")
    args = parser.parse_args(argv)
    print(line("documents", length_statistics(document_lengths(args.data_path))))
    samples = args.batches * args.global_batch_size
    for seq_length in args.seq_length or [512, 1024, 2048]:
        (train, _, _) = build_document_datasets(
            DocumentDataConfig([args.data_path], None, "1", seq_length, 1234), (samples, 0, 0))
        epoch = train.sample_lengths(np.arange(len(train.documents)))  # each document once
        print(line(f"samples, seq {seq_length}", length_statistics(epoch)),
              f" truncated {np.mean(epoch == seq_length):.1%}")
        lengths = train.sample_lengths(np.arange(samples))
        for group in (False, True):
            layout = BatchLayout(args.micro_batch_size, args.global_batch_size,
                                 group_by_length=group, pad_to_multiple=args.pad_to_multiple)
            plans = [plan_global_batch(train, k * args.global_batch_size, layout)
                     for k in range(args.batches)]
            counts = [np.array(plan.token_counts(0), dtype=np.float64) for plan in plans]
            real = lengths.sum()
            padded = sum(c.sum() for c in counts)
            within = np.mean([c.std() / c.mean() for c in counts])
            print(f"  microbatches of {args.micro_batch_size}{', grouped' if group else '':9}"
                  f" tokens mean {np.mean(np.concatenate(counts)):8.1f}  cv within a global "
                  f"batch {within:.2f}  padding {1 - real / padded:.1%}")


if __name__ == "__main__":
    main()
