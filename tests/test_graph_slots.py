"""CUDA-graph slots kept per input shape (megatron/trainer/model/graph_slots.py), with a fake
recorder: one set of slots per length bucket, recorded on first use and reused, and the
memory budget that sends a bucket to the eager path with one log line."""

from __future__ import annotations

import logging

import pytest
import torch

from megatron.trainer.model.graph_slots import (
    MAX_SLOTS_PER_SHAPE,
    GraphMemoryBudget,
    ShapeSlots,
    SlotLeak,
)

HIDDEN, ROWS = 8, 2
BYTES_PER_TOKEN = 100


class FakeRecorder:
    """Records nothing: a slot is a name, holding BYTES_PER_TOKEN per input position."""

    def __init__(self):
        self.recorded: list[tuple[int, ...]] = []

    def __call__(self, sample):
        shape = tuple(sample.shape)
        self.recorded.append(shape)
        return f"slot {len(self.recorded)} {shape}", BYTES_PER_TOKEN * shape[0] * shape[1]


def block_input(length: int, rows: int = ROWS) -> torch.Tensor:
    return torch.empty(length, rows, HIDDEN)


def run_microbatches(slots: ShapeSlots, lengths: list[int], in_flight: int) -> list:
    """Forwards in order, each backward `in_flight` forwards later (1F1B's steady state):
    returns what each forward got (a slot or None)."""
    got, pending = [], []
    for length in lengths:
        sample = block_input(length)
        slot = slots.acquire(sample)
        got.append(slot)
        pending.append((sample.shape, slot))
        if len(pending) == in_flight:
            shape, done = pending.pop(0)
            if done is not None:
                slots.release(shape, done)
    for shape, done in pending:
        if done is not None:
            slots.release(shape, done)
    return got


def test_one_set_of_slots_per_bucket_recorded_once():
    """Three buckets over six iterations of 8 microbatches, 3 in flight: each bucket records
    at most 3 slots, all in the first iteration it appears; later iterations record nothing."""
    recorder = FakeRecorder()
    slots = ShapeSlots(recorder)
    buckets = [128, 256, 384]
    iterations = [[buckets[(i * 5 + k * 7) % 3] for k in range(8)] for i in range(6)]
    run_microbatches(slots, iterations[0], in_flight=3)
    after_first = list(recorder.recorded)
    assert set(after_first) == {(b, ROWS, HIDDEN) for b in buckets}
    for lengths in iterations[1:]:
        got = run_microbatches(slots, lengths, in_flight=3)
        assert all(slot is not None for slot in got)
    assert recorder.recorded == after_first, "a later iteration recorded again"
    for bucket in buckets:
        assert 1 <= after_first.count((bucket, ROWS, HIDDEN)) <= 3
    assert len(slots) == len(after_first)


def test_a_slot_is_only_reused_by_its_own_shape():
    slots = ShapeSlots(FakeRecorder())
    short = slots.acquire(block_input(128))
    slots.release((128, ROWS, HIDDEN), short)
    long = slots.acquire(block_input(256))
    assert long != short and "(256, 2, 8)" in long
    assert slots.acquire(block_input(128)) == short
    # another row count (a token budget) is another shape
    assert slots.acquire(block_input(128, rows=3)) not in (short, long)


def test_memory_limit_sends_a_bucket_to_eager_with_one_line(caplog):
    """A budget of two 128-token slots and one 256-token slot: the next 256 slot would pass
    it (estimated from the recorded one), so that microbatch runs eagerly, said once; freed
    slots are still replayed."""
    recorder = FakeRecorder()
    per_128 = BYTES_PER_TOKEN * 128 * ROWS
    budget = GraphMemoryBudget(limit_bytes=4 * per_128)
    slots = ShapeSlots(recorder, budget)
    with caplog.at_level(logging.INFO, logger="megatron.trainer.model.graph_slots"):
        a = slots.acquire(block_input(128))
        b = slots.acquire(block_input(128))
        c = slots.acquire(block_input(256))
        assert None not in (a, b, c) and budget.used_bytes == 4 * per_128
        assert slots.estimate_bytes((384, ROWS, HIDDEN)) == 3 * per_128  # scaled by tokens
        assert slots.acquire(block_input(256)) is None
        assert slots.acquire(block_input(256)) is None
        assert slots.acquire(block_input(384)) is None
    lines = [r.getMessage() for r in caplog.records if "memory limit" in r.getMessage()]
    assert len(lines) == 2 and "(256, 2, 8)" in lines[0] and "(384, 2, 8)" in lines[1]
    assert len(recorder.recorded) == 3
    slots.release((256, ROWS, HIDDEN), c)
    assert slots.acquire(block_input(256)) == c


def test_blocks_share_the_rank_budget():
    budget = GraphMemoryBudget(limit_bytes=BYTES_PER_TOKEN * 128 * ROWS)
    first, second = ShapeSlots(FakeRecorder(), budget), ShapeSlots(FakeRecorder(), budget)
    assert first.acquire(block_input(128)) is not None
    # the second block has recorded nothing: the rank's slots give its estimate
    assert second.acquire(block_input(64)) is None
    assert first.acquire(block_input(128)) is None
    assert budget.used_bytes == budget.limit_bytes


def test_a_forward_without_backward_is_named_a_leak():
    slots = ShapeSlots(FakeRecorder())
    for _ in range(MAX_SLOTS_PER_SHAPE):
        slots.acquire(block_input(128))
    with pytest.raises(SlotLeak, match="a forward whose backward never ran"):
        slots.acquire(block_input(128))
    assert slots.acquire(block_input(256)) is not None  # another shape is not the leak


def test_negative_budget_is_refused():
    with pytest.raises(ValueError, match="must be >= 0"):
        GraphMemoryBudget(limit_bytes=-1)
