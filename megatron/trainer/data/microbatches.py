"""Microbatches of variable-length samples (documents.py): padding, grouping by length within
a global batch, per-microbatch token counts, and running one iteration's microbatches in a
given order.

Padding. A microbatch is padded on the right to its own longest sample (rounded up to
`pad_to_multiple`, at most the dataset's seq_length). Padding positions get loss_mask 0 and
token = label = `pad_id` (a valid vocabulary id, so every cross-entropy kernel accepts it;
the mask removes it). No attention mask is needed: under the causal mask position t attends
to positions <= t only, and every padding position comes after all real tokens of its row,
so real tokens never see padding; padding rows attend to real tokens and compute garbage
whose loss is masked, so its gradient is zero and never reaches the real tokens. Each row
is one document, so position ids are 0, 1, ... in every row.

Grouping. Without grouping the global batch of samples [c, c + G) is laid out as Megatron
does: DP rank r's k-th microbatch holds samples c + k*m*d + r*m + [0, m). With grouping the
same G samples are sorted by (length, index) and cut into G/m microbatches of m neighbours
(so little padding); d neighbouring microbatches form a slot, and each DP rank gets one
microbatch of every slot: dearest slot first, its dearest microbatch goes to the rank with
the fewest tokens so far (ties: lower rank). Pairing opposite orders keeps the ranks' token
totals within the largest spread inside one slot, so the DP replicas' work stays even.
Slots then run in the order of their smallest sample index. The DP ranks together still see
exactly the samples [c, c + G); the partition is a pure function of the sample lengths, so
every rank computes it without communication.

Token budget (`--microbatch-tokens N`, DynaPipe's dynamic micro-batching). DP rank r takes
the r-th of d equal contiguous slices of the global batch (with grouping: every d-th sample
of the batch sorted by (length, index), so the ranks get alike lengths). Its samples, in
that order, are cut greedily into microbatches: a sample joins the current microbatch while
rows x padded length stays within N, else it starts the next one. So a microbatch holds as
many short documents as the budget allows, and the number of microbatches differs between
iterations (and DP ranks); every pipeline stage of a replica computes the same cut. With
`--seq-length-cv` the budget plans the same way over one drawn length per sample
(data.DrawnLengthSamples) instead of documents.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from megatron.dpp.policy import choose_cost_order


def pad_microbatch(samples: Sequence[dict], pad_to_multiple: int = 1, pad_id: int = 0,
                   max_length: int | None = None) -> dict:
    """Megatron's GPT batch from samples of {"tokens", "labels", "loss_mask"} of any lengths:
    tokens, labels (int64), loss_mask (float32), position_ids (int64), all [b, L] with L the
    longest sample rounded up to `pad_to_multiple` (capped at max_length); attention_mask
    None (the causal mask suffices, see the module's docstring)."""
    if not samples:
        raise ValueError("pad_microbatch: no samples")
    longest = max(len(sample["tokens"]) for sample in samples)
    length = padded_length(longest, pad_to_multiple, max_length)
    batch = len(samples)
    tokens = torch.full((batch, length), pad_id, dtype=torch.int64)
    labels = torch.full((batch, length), pad_id, dtype=torch.int64)
    loss_mask = torch.zeros((batch, length), dtype=torch.float32)
    for row, sample in enumerate(samples):
        n = len(sample["tokens"])
        tokens[row, :n] = sample["tokens"]
        labels[row, :n] = sample["labels"]
        loss_mask[row, :n] = sample["loss_mask"]
    position_ids = torch.arange(length, dtype=torch.int64).repeat(batch, 1)
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask,
            "position_ids": position_ids, "attention_mask": None}


def lengths_per_sample(values) -> bool:
    """Whether a run's microbatches are planned from each sample's own length
    (plan_global_batch: the token budget, grouping): documents (`--variable-seq-lengths`),
    or `--seq-length-cv`'s draws, one per sample, under `--microbatch-tokens`. `values`: the
    parsed flags or a DataConfig (the same names)."""
    return bool(values.variable_seq_lengths) or (
        values.seq_length_cv > 0 and values.microbatch_tokens is not None)


def lengths_source(values) -> str:
    """The flags that give a lengths_per_sample run its lengths, as messages name them."""
    return ("--variable-seq-lengths" if values.variable_seq_lengths
            else "--seq-length-cv with --microbatch-tokens")


def padded_length(longest: int, pad_to_multiple: int = 1, max_length: int | None = None) -> int:
    """`longest` rounded up to a multiple of `pad_to_multiple`, not beyond max_length."""
    if pad_to_multiple < 1:
        raise ValueError(f"pad_to_multiple must be >= 1, got {pad_to_multiple}")
    length = -(-longest // pad_to_multiple) * pad_to_multiple
    return length if max_length is None else min(length, max(max_length, longest))


# beyond this many microbatch shapes a run's CUDA graphs record each when it first comes
# instead of all by the end of the first step (model/cuda_graphs.py)
MAX_WARM_SHAPES = 64


def shapes_by_length(seq_length: int, pad_to_multiple: int, micro_batch_size: int,
                     microbatch_tokens: int | None, samples: int) -> dict[int, range] | None:
    """The padded lengths a run of variable lengths can meet, each with the row counts its
    microbatches can have there: --micro-batch-size, or with a token budget every count the
    budget allows (rows x length <= it, at most `samples`, a global batch's on one DP rank).
    None where the shapes are more than MAX_WARM_SHAPES."""
    if seq_length / pad_to_multiple > MAX_WARM_SHAPES:
        return None
    lengths = sorted({min(k * pad_to_multiple, seq_length)
                      for k in range(1, math.ceil(seq_length / pad_to_multiple) + 1)})
    if microbatch_tokens is None:
        rows = {length: range(micro_batch_size, micro_batch_size + 1) for length in lengths}
    else:
        rows = {length: range(1, min(microbatch_tokens // length, samples) + 1)
                for length in lengths}
    return rows if sum(map(len, rows.values())) <= MAX_WARM_SHAPES else None


@dataclass(frozen=True)
class BatchLayout:
    """How a global batch becomes microbatches (the same on every rank)."""

    micro_batch_size: int
    global_batch_size: int
    data_parallel_size: int = 1
    group_by_length: bool = False
    pad_to_multiple: int = 1
    microbatch_tokens: int | None = None  # a token budget per microbatch instead of rows

    def __post_init__(self):
        per_slot = self.micro_batch_size * self.data_parallel_size
        if min(self.micro_batch_size, self.data_parallel_size, self.pad_to_multiple) < 1 or (
                self.global_batch_size % per_slot):
            raise ValueError(
                f"BatchLayout: global batch {self.global_batch_size} must be a positive "
                f"multiple of micro batch {self.micro_batch_size} x data-parallel "
                f"{self.data_parallel_size}; pad_to_multiple {self.pad_to_multiple} >= 1")
        if self.microbatch_tokens is not None and self.microbatch_tokens < 1:
            raise ValueError(f"BatchLayout: microbatch_tokens {self.microbatch_tokens} must "
                             "be >= 1")

    @property
    def microbatches_per_rank(self) -> int:
        """Microbatches of each DP rank with a fixed row count (a token budget varies it:
        see GlobalBatchPlan.samples)."""
        if self.microbatch_tokens is not None:
            raise ValueError("BatchLayout: with a token budget the number of microbatches "
                             "is the plan's (plan_global_batch)")
        return self.global_batch_size // (self.micro_batch_size * self.data_parallel_size)


@dataclass(frozen=True)
class GlobalBatchPlan:
    """Which samples form each microbatch of one global batch: samples[r][k] are the sample
    indices of DP rank r's k-th microbatch, lengths[r][k] its padded length and
    real_tokens[r][k] the tokens of its samples (padding left out)."""

    consumed_samples: int
    samples: tuple[tuple[tuple[int, ...], ...], ...]
    lengths: tuple[tuple[int, ...], ...]
    real_tokens: tuple[tuple[int, ...], ...]

    def token_counts(self, dp_rank: int) -> list[int]:
        """Tokens each of this rank's microbatches holds, padding included (rows x padded
        length): what its activations take, the cost the schedule orders by."""
        return [len(samples) * length for samples, length in
                zip(self.samples[dp_rank], self.lengths[dp_rank], strict=True)]


# the step asks for its batch's plan (training.iteration_lengths) after the data iterator
# planned it to read it ahead: the second ask is a lookup
@lru_cache(maxsize=4)
def plan_global_batch(dataset, consumed_samples: int, layout: BatchLayout) -> GlobalBatchPlan:
    """The microbatches of the global batch of samples [consumed_samples, + G), from the
    samples' lengths alone (dataset.sample_lengths reads only the index)."""
    m, d = layout.micro_batch_size, layout.data_parallel_size
    indices = np.arange(consumed_samples, consumed_samples + layout.global_batch_size)
    lengths = np.asarray(dataset.sample_lengths(indices), dtype=np.int64)
    cap = getattr(dataset, "seq_length", None)
    if layout.microbatch_tokens is not None:
        positions = _token_budget_positions(lengths, indices, layout, cap)
    elif layout.group_by_length:
        slots = layout.microbatches_per_rank
        ranked = np.lexsort((indices, lengths))  # by length, ties by sample index
        groups = ranked.reshape(slots * d, m)
        group_tokens = [m * padded_length(int(lengths[g].max()), layout.pad_to_multiple, cap)
                        for g in groups]
        owner = np.empty((slots, d), dtype=np.int64)  # owner[k, r]: index into groups
        totals = [0] * d
        for k in reversed(range(slots)):  # dearest slot first
            lightest_first = sorted(range(d), key=lambda r: (totals[r], r))
            for rank, group in zip(lightest_first, reversed(range(k * d, (k + 1) * d)),
                                   strict=True):
                owner[k, rank] = group
                totals[rank] += group_tokens[group]
        slot_order = np.argsort(groups.min(axis=1).reshape(slots, d).min(axis=1), kind="stable")
        owner = owner[slot_order]
        positions = [[groups[owner[k, r]] for k in range(slots)] for r in range(d)]
    else:
        slots = layout.microbatches_per_rank
        natural = np.arange(layout.global_batch_size).reshape(slots, d, m)
        positions = [[natural[k, r] for k in range(slots)] for r in range(d)]
    return GlobalBatchPlan(
        consumed_samples=consumed_samples,
        samples=tuple(tuple(tuple(int(indices[p]) for p in mb) for mb in rank)
                      for rank in positions),
        lengths=tuple(tuple(padded_length(int(lengths[mb].max()), layout.pad_to_multiple, cap)
                            for mb in rank) for rank in positions),
        real_tokens=tuple(tuple(int(lengths[mb].sum()) for mb in rank) for rank in positions),
    )


def _token_budget_positions(lengths: np.ndarray, indices: np.ndarray, layout: BatchLayout,
                            cap: int | None) -> list[list[np.ndarray]]:
    """Each DP rank's microbatches (positions in the global batch) under the token budget
    (the module's docstring)."""
    d, budget = layout.data_parallel_size, layout.microbatch_tokens
    widest = padded_length(int(lengths.max()), layout.pad_to_multiple, cap)
    if widest > budget:
        raise ValueError(f"microbatch_tokens {budget}: a sample padded to {widest} tokens "
                         "does not fit; the budget must hold the longest sample")
    if layout.group_by_length:
        ranked = np.lexsort((indices, lengths))
        shares = [ranked[r::d] for r in range(d)]
    else:
        shares = np.arange(layout.global_batch_size).reshape(d, -1)
    positions = []
    for share in shares:
        microbatches, current, longest = [], [], 0
        for position in share:
            widest = padded_length(max(longest, int(lengths[position])),
                                   layout.pad_to_multiple, cap)
            if current and (len(current) + 1) * widest > budget:
                microbatches.append(np.array(current))
                current, longest = [], 0
            current.append(int(position))
            longest = max(longest, int(lengths[position]))
        microbatches.append(np.array(current))
        positions.append(microbatches)
    return positions


def microbatch_token_counts(dataset, consumed_samples: int, layout: BatchLayout,
                            dp_rank: int) -> list[int]:
    """Padded token count of each of DP rank `dp_rank`'s microbatches of the global batch at
    `consumed_samples`, in the order they are read: known before the step, computed alike on
    every rank (the cost order and the memory cap of one pipeline use this list)."""
    return plan_global_batch(dataset, consumed_samples, layout).token_counts(dp_rank)


class DocumentMicrobatches:
    """This DP rank's padded microbatches, global batch after global batch, starting at
    `consumed_samples`. `read_next_global_batch` reads the next one ahead."""

    def __init__(self, dataset, layout: BatchLayout, dp_rank: int,
                 consumed_samples: int = 0, pad_id: int = 0):
        if not 0 <= dp_rank < layout.data_parallel_size:
            raise ValueError(f"dp_rank {dp_rank} not in [0, {layout.data_parallel_size})")
        self.dataset, self.layout, self.dp_rank, self.pad_id = dataset, layout, dp_rank, pad_id
        self.next_start = consumed_samples
        self._pending: list[tuple[int, ...]] = []  # samples of the microbatches still to read
        self._read: deque[dict] = deque()  # microbatches read ahead, in order

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if self._read:
            return self._read.popleft()
        if not self._pending:
            self._plan_next_global_batch()
        return self._read_microbatch()

    def read_next_global_batch(self) -> None:
        """Reads and pads the next global batch's microbatches now, once this one's are all
        read. The trainer calls it while the GPU finishes a step: a schedule that runs the
        microbatches out of order reads them all at its first forward, which then waited
        for the host (8 ms on two H200s at 23 microbatches, on the pipeline's critical
        path). The microbatches are the same as read one by one."""
        if self._pending or self._read:
            return
        self._plan_next_global_batch()
        while self._pending:
            self._read.append(self._read_microbatch())

    def _plan_next_global_batch(self) -> None:
        plan = plan_global_batch(self.dataset, self.next_start, self.layout)
        self._pending = list(plan.samples[self.dp_rank])
        self.next_start += self.layout.global_batch_size

    def _read_microbatch(self) -> dict:
        samples = [self.dataset[i] for i in self._pending.pop(0)]
        return pad_microbatch(samples, self.layout.pad_to_multiple, self.pad_id,
                              getattr(self.dataset, "seq_length", None))


class ReorderedMicrobatches:
    """One iteration's microbatches of `source` in the order `order` (a permutation of
    range(len(order))): on first use it reads len(order) microbatches, then yields
    microbatch order[0], order[1], ... Each stage that reads data wraps its own iterator
    with the same order, so the microbatches stay matched along the pipeline."""

    def __init__(self, source: Iterator, order: Sequence[int]):
        if sorted(order) != list(range(len(order))):
            raise ValueError(f"microbatch order {list(order)} is not a permutation of "
                             f"0..{len(order) - 1}")
        self._source, self._order = source, list(order)
        self._read: list | None = None
        self._next = 0

    def __iter__(self):
        return self

    def __next__(self):
        if self._next == len(self._order):
            raise StopIteration
        if self._read is None:
            self._read = [next(self._source) for _ in self._order]
        item = self._read[self._order[self._next]]
        self._read[self._order[self._next]] = None  # yielded once; let it go
        self._next += 1
        return item


def reorder_data_iterators(data_iterator, order: Sequence[int]):
    """The schedule's data_iterator argument (an iterator, None, or one per model chunk)
    with every iterator wrapped in ReorderedMicrobatches(order)."""
    if isinstance(data_iterator, list):
        return [reorder_data_iterators(it, order) for it in data_iterator]
    return None if data_iterator is None else ReorderedMicrobatches(data_iterator, order)


def cost_ordered(costs: Sequence[float], pp_size: int) -> list[int]:
    """The microbatch order `--microbatch-order cost` gives megatron-core's schedules: the
    DPP policy's choice for this pipeline depth without slack (1F1B's memory)."""
    if pp_size < 1 or not costs or any(not math.isfinite(c) or c < 0 for c in costs):
        raise ValueError(f"cost_ordered: need pp_size >= 1 and finite costs >= 0, got "
                         f"pp_size {pp_size}, costs {list(costs)}")
    return choose_cost_order(list(costs), pp_size, slack=0)
