"""Start-up check that --split gives every split the run reads enough data.

megatron.core cuts each --data-path prefix into train/valid/test ranges by --split and
builds a split whose weight is not 0 even when no sample of it is asked for. A split
without tokens makes GPTDataset count epochs forever (rank 0 spins while the other ranks
wait in a barrier), so every such split is refused here, before any rank starts, with one
line naming the prefix, the split, its documents and tokens, and a --split that works.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from megatron.core.datasets.blended_megatron_dataset_config import (
    convert_split_vector_to_split_matrix,
    parse_and_normalize_split,
)

from megatron.trainer.data.data import DataError, index_arrays, split_sizes

SPLIT_NAMES = ("train", "valid", "test")
# tried in this order when suggesting a --split that gives every needed split data
EXAMPLE_SPLITS = ("90,5,5", "80,10,10", "60,20,20", "34,33,33")


@dataclass(frozen=True)
class SplitContents:
    """One split of one prefix: how many elements (documents, or sequences for GPT) and
    tokens megatron.core's document ranges give it; None where its --split weight is 0."""

    elements: int
    tokens: int


def split_contents(lengths: np.ndarray, document_indices: np.ndarray, split: str,
                   by_document: bool) -> list[SplitContents | None]:
    """megatron.core's ranges: GPT splits the sequences, BERT the documents, each range
    [round(a * n), round(b * n)) of the cumulative --split fractions a, b."""
    count = len(document_indices) - 1 if by_document else len(lengths)
    contents = []
    for bounds in convert_split_vector_to_split_matrix(parse_and_normalize_split(split)):
        if bounds is None:
            contents.append(None)
            continue
        begin, end = (int(round(fraction * float(count))) for fraction in bounds)
        if by_document:
            first, last = int(document_indices[begin]), int(document_indices[end])
        else:
            first, last = begin, end
        contents.append(SplitContents(end - begin, int(lengths[first:last].sum())))
    return contents


def split_problem(prefix: str, split: str, contents: list[SplitContents | None],
                  samples: list[int], min_tokens: int, unit: str) -> tuple[str, str] | None:
    """(split name, what is wrong with it) for the first unusable split of `prefix`; None:
    every split is usable. `samples` are the samples asked of each split, `min_tokens` the
    tokens of one sample."""
    for name, content, wanted in zip(SPLIT_NAMES, contents, samples, strict=True):
        if content is None:
            if wanted > 0 and name == "train":
                return name, (f"--split {split} gives the train split of --data-path {prefix} "
                              f"weight 0, but --train-iters asks for {wanted} samples")
            continue
        counted = unit if content.elements != 1 else unit[:-1]
        where = (f"the {name} split of --data-path {prefix} (--split {split}) gets "
                 f"{content.elements} {counted}, {content.tokens} tokens")
        if content.tokens == 0:
            return name, f"{where}: it is empty"
        if wanted > 0 and content.tokens < min_tokens:
            flag = "--train-iters" if name == "train" else "--eval-iters"
            return name, (f"{where}, fewer than one sample ({min_tokens} tokens) for the "
                          f"{wanted} samples {flag} asks for")
    return None


def _remedy(name: str, example: str | None, total: str) -> str:
    larger = (f"give it a larger share of --split (e.g. --split {example})" if example else
              f"add data: all of it is {total}")
    if name == "train":
        return larger
    return f"{larger}, or set --eval-iters 0 and its --split weight to 0 (e.g. --split 100,0,0)"


def check_splits(args, by_document: bool) -> None:
    """Raise one DataError naming every prefix whose splits cannot give the samples the run
    asks for (see the module docstring); by_document: BERT's split by documents."""
    if args.mock_data or not args.data_path or args.variable_seq_lengths:
        return  # --variable-seq-lengths' document datasets leave an empty split out
    sizes = split_sizes(args)
    samples = [sizes.train, sizes.valid, sizes.test]
    # a GPT sample reads seq_length + 1 tokens; BERT pads a short document's sample
    min_tokens = 1 if by_document else args.seq_length + 1
    problems = []
    for prefix in args.data_blend[0]:
        lengths, document_indices = index_arrays(prefix)
        if by_document or len(document_indices) - 1 == len(lengths):
            unit = "documents"
        else:
            unit = "sequences"  # GPT splits sentence-level data by sequence

        def problem_at(split: str, lengths=lengths, document_indices=document_indices,
                       prefix=prefix, unit=unit):
            contents = split_contents(lengths, document_indices, split, by_document)
            return split_problem(prefix, split, contents, samples, min_tokens, unit)

        found = problem_at(args.split)
        if found is None:
            continue
        name, problem = found
        example = next((split for split in EXAMPLE_SPLITS if problem_at(split) is None), None)
        total = f"{len(document_indices) - 1} documents, {int(lengths.sum())} tokens"
        problems.append(f"{problem}; {_remedy(name, example, total)}")
    if problems:
        raise DataError("; ".join(problems))
