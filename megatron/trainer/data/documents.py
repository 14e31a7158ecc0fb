"""Variable-length GPT data: one sample per document of a megatron.core `.bin`/`.idx` prefix.

A sample is the beginning of ONE document, cut at `seq_length + 1` tokens (tokens =
doc[:-1], labels = doc[1:], as in megatron.core's GPTDataset), never packed with its
neighbours. `--split` cuts each prefix into train/valid/test document ranges as Megatron
does (fractions of the document count, rounded). Within a split the samples run in epochs:
epoch e visits every document once in a permutation drawn from (seed, split, epoch), so
sample i is a pure function of i and `consumed_samples` alone says where a resumed run
continues. Several prefixes blend by weight with megatron.core's own blending index.

Documents of fewer than 2 tokens have no next-token target and are left out of the split.
Only the index is read to know a sample's length, so every rank can plan a global batch
(microbatches.py) without touching the token file.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from megatron.core.datasets.indexed_dataset import IndexedDataset

log = logging.getLogger(__name__)

SPLIT_NAMES = ("train", "valid", "test")


def split_document_ranges(split: str, num_documents: int) -> list[tuple[int, int]]:
    """Megatron's --split on documents: "969,30,1" (or "969/30/1"; missing parts are 0) is
    normalised to fractions; split k is the documents [round(a_k * n), round(b_k * n)) with
    a_k, b_k the cumulative fractions before and after it."""
    parts = [p for p in re.split(r"[,/]", split.strip()) if p.strip()]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise ValueError(f"--split {split!r}: expected up to 3 numbers such as 969,30,1") from None
    if not 1 <= len(values) <= 3 or any(v < 0 or not math.isfinite(v) for v in values) or (
            sum(values) <= 0):
        raise ValueError(f"--split {split!r}: expected 1 to 3 non-negative numbers with a "
                         "positive sum, such as 969,30,1")
    values += [0.0] * (3 - len(values))
    total = sum(values)
    bounds = [0.0]
    for value in values:
        bounds.append(bounds[-1] + value / total)
    return [(int(round(lo * num_documents)), int(round(hi * num_documents)))
            for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]


class DocumentDataset(torch.utils.data.Dataset):
    """The documents of one split of one prefix, one sample per document, in epochs.

    `dataset[i]` is {"tokens", "labels": int64 [n], "loss_mask": float32 [n]} with
    n = min(document length, seq_length + 1) - 1; any i >= 0 is valid (epoch i // documents),
    `len()` covers the whole epochs needed for `num_samples`."""

    def __init__(self, indexed: IndexedDataset, documents: np.ndarray, seq_length: int,
                 num_samples: int, seed: int, stream: Sequence[int] = (),
                 eod_token: int | None = None, name: str = ""):
        if seq_length < 1:
            raise ValueError(f"DocumentDataset: seq_length must be >= 1, got {seq_length}")
        self.indexed, self.seq_length = indexed, seq_length
        self.name, self.seed, self.stream = name, seed, tuple(stream)
        self.eod_token = eod_token  # its labels are masked out of the loss (--eod-mask-loss)
        documents = np.asarray(documents, dtype=np.int64)
        lengths = _document_lengths(indexed, documents)
        kept = lengths >= 2
        if not kept.all():
            log.info("%s: %d of %d documents have fewer than 2 tokens and are left out",
                     name, int((~kept).sum()), len(documents))
        self.documents, self.document_lengths = documents[kept], lengths[kept]
        if len(self.documents) == 0:
            raise ValueError(f"{name}: no document of 2 tokens or more in this split")
        epochs = max(1, math.ceil(num_samples / len(self.documents)))
        self.num_samples = epochs * len(self.documents)
        self._orders: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return self.num_samples

    def _epoch_order(self, epoch: int) -> np.ndarray:
        order = self._orders.get(epoch)
        if order is None:
            rng = np.random.default_rng([self.seed, *self.stream, epoch])
            order = rng.permutation(len(self.documents))
            if len(self._orders) >= 2:  # a global batch spans at most a few epochs
                self._orders.pop(next(iter(self._orders)))
            self._orders[epoch] = order
        return order

    def _positions(self, indices: np.ndarray) -> np.ndarray:
        """Position in self.documents of each sample index."""
        indices = np.asarray(indices, dtype=np.int64)
        if indices.size and indices.min() < 0:
            raise IndexError(f"{self.name}: negative sample index {int(indices.min())}")
        epochs, offsets = np.divmod(indices, len(self.documents))
        positions = np.empty_like(indices)
        for epoch in np.unique(epochs):
            where = epochs == epoch
            positions[where] = self._epoch_order(int(epoch))[offsets[where]]
        return positions

    def document_of(self, index: int) -> int:
        """The document id (in the prefix) of sample `index`."""
        return int(self.documents[self._positions(np.array([index]))[0]])

    def sample_lengths(self, indices) -> np.ndarray:
        """Token count (n above) of each sample, from the index alone."""
        lengths = self.document_lengths[self._positions(indices)]
        return np.minimum(lengths, self.seq_length + 1) - 1

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        position = self._positions(np.array([index]))[0]
        tokens = self._read(int(self.documents[position]),
                            min(int(self.document_lengths[position]), self.seq_length + 1))
        text = torch.from_numpy(tokens.astype(np.int64))
        labels = text[1:].clone()
        loss_mask = torch.ones(len(labels), dtype=torch.float32)
        if self.eod_token is not None:
            loss_mask[labels == self.eod_token] = 0.0
        return {"tokens": text[:-1].clone(), "labels": labels, "loss_mask": loss_mask}

    def _read(self, document: int, count: int) -> np.ndarray:
        """The first `count` tokens of a document, across its sequences (a document holds
        several when tools/preprocess_data.py split sentences)."""
        first, stop = self.indexed.document_indices[document:document + 2]
        pieces, remaining = [], count
        for sequence in range(int(first), int(stop)):
            if remaining == 0:
                break
            take = min(int(self.indexed.sequence_lengths[sequence]), remaining)
            pieces.append(self.indexed.get(sequence, 0, take))
            remaining -= take
        return np.concatenate(pieces)


class BlendedDocuments(torch.utils.data.Dataset):
    """Samples drawn from several DocumentDatasets by weight: sample i comes from the dataset
    whose share so far lags its weight most (megatron.core's build_blending_indices, the
    rule of its BlendedDataset), and is that dataset's next sample."""

    def __init__(self, datasets: Sequence[DocumentDataset], weights: Sequence[float],
                 num_samples: int):
        from megatron.core.datasets import helpers

        if len(datasets) != len(weights) or len(datasets) > np.iinfo(np.int16).max:
            raise ValueError(f"BlendedDocuments: {len(datasets)} datasets, {len(weights)} weights")
        total = float(sum(weights))
        self.datasets = list(datasets)
        self.weights = np.array([w / total for w in weights], dtype=np.float64)
        self.seq_length = datasets[0].seq_length
        self.num_samples = num_samples
        self.dataset_index = np.zeros(num_samples, dtype=np.int16)
        self.dataset_sample_index = np.zeros(num_samples, dtype=np.int64)
        helpers.build_blending_indices(self.dataset_index, self.dataset_sample_index,
                                       self.weights, len(datasets), num_samples, False)

    def __len__(self) -> int:
        return self.num_samples

    def _check(self, indices: np.ndarray) -> None:
        if indices.size and (indices.min() < 0 or indices.max() >= self.num_samples):
            raise IndexError(f"blended documents: sample index out of [0, {self.num_samples}) "
                             f"(the split was sized for {self.num_samples} samples)")

    def sample_lengths(self, indices) -> np.ndarray:
        indices = np.asarray(indices, dtype=np.int64)
        self._check(indices)
        lengths = np.empty(len(indices), dtype=np.int64)
        which = self.dataset_index[indices]
        for k in np.unique(which):
            where = which == k
            lengths[where] = self.datasets[k].sample_lengths(
                self.dataset_sample_index[indices[where]])
        return lengths

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        self._check(np.array([index]))
        dataset = self.datasets[self.dataset_index[index]]
        return dataset[int(self.dataset_sample_index[index])]


@dataclass(frozen=True)
class DocumentDataConfig:
    """What build_document_datasets needs (the trainer fills it from its flags)."""

    prefixes: Sequence[str]
    weights: Sequence[float] | None  # None: each prefix weighs its split's document count
    split: str
    seq_length: int
    seed: int
    eod_token: int | None = None  # masked in the loss when given (--eod-mask-loss)


def build_document_datasets(config: DocumentDataConfig, sizes: Sequence[int]):
    """(train, valid, test) datasets of documents for `sizes` samples each; a split with no
    documents (its --split share rounds to 0 documents) or no samples asked is None."""
    if len(sizes) != 3:
        raise ValueError(f"build_document_datasets: need 3 split sizes, got {sizes}")
    if config.weights is not None and len(config.weights) != len(config.prefixes):
        raise ValueError(f"--data-path: {len(config.weights)} weights for "
                         f"{len(config.prefixes)} prefixes")
    if config.weights is not None and (any(w < 0 for w in config.weights)
                                       or sum(config.weights) <= 0):
        raise ValueError(f"--data-path: weights {list(config.weights)} must be >= 0 with a "
                         "positive sum")
    indexed = []
    for prefix in config.prefixes:
        if not IndexedDataset.exists(prefix):
            raise FileNotFoundError(f"--data-path {prefix}: no {prefix}.bin / {prefix}.idx "
                                    "(tools/preprocess_data.py writes them)")
        indexed.append(IndexedDataset(prefix))
    ranges = [split_document_ranges(config.split, len(data.document_indices) - 1)
              for data in indexed]
    splits = []
    for split_index, (name, size) in enumerate(zip(SPLIT_NAMES, sizes, strict=True)):
        parts, weights, empty = [], [], []
        for k, (prefix, data) in enumerate(zip(config.prefixes, indexed, strict=True)):
            start, stop = ranges[k][split_index]
            weight = None if config.weights is None else config.weights[k]
            if stop == start:
                if weight:
                    empty.append(prefix)
                continue
            if weight == 0:
                continue
            parts.append(DocumentDataset(
                data, np.arange(start, stop), config.seq_length, size, config.seed,
                stream=(k, split_index), eod_token=config.eod_token, name=f"{prefix} [{name}]"))
            weights.append(stop - start if weight is None else weight)
        if parts and empty and size:
            raise ValueError(f"--split {config.split} leaves no {name} documents in "
                             f"{', '.join(empty)}, which --data-path gives a weight")
        if not size or not parts:
            splits.append(None)
        elif len(parts) == 1:
            splits.append(parts[0])
        else:
            splits.append(BlendedDocuments(parts, weights, size))
    for name, dataset in zip(SPLIT_NAMES, splits, strict=True):
        if dataset is not None:
            log.info("%s: %d samples of up to %d tokens, one document each",
                     name, len(dataset), config.seq_length)
    return tuple(splits)


def length_statistics(lengths) -> dict[str, float]:
    """Mean, coefficient of variation, min, max and percentiles of token counts."""
    lengths = np.asarray(lengths, dtype=np.float64)
    if lengths.size == 0:
        raise ValueError("length_statistics: no lengths")
    mean = float(lengths.mean())
    stats = {"documents": float(lengths.size), "mean": mean,
             "cv": float(lengths.std() / mean) if mean else 0.0,
             "min": float(lengths.min()), "max": float(lengths.max())}
    for p in (10, 25, 50, 75, 90, 99):
        stats[f"p{p}"] = float(np.percentile(lengths, p))
    return stats


def document_lengths(prefix: str) -> np.ndarray:
    """Token count of every document of a prefix (from its .idx)."""
    data = IndexedDataset(prefix)
    return _document_lengths(data, np.arange(len(data.document_indices) - 1))


def _document_lengths(indexed: IndexedDataset, documents: np.ndarray) -> np.ndarray:
    """Token count of each document, over its sequences (a document holds several when
    tools/preprocess_data.py split sentences)."""
    starts = np.concatenate([[0], np.cumsum(indexed.sequence_lengths, dtype=np.int64)])
    bounds = indexed.document_indices
    return starts[bounds[documents + 1]] - starts[bounds[documents]]
