"""CUDA-graph slots kept per input shape (megatron/trainer/model/graph_slots.py), with a fake
recorder: lanes (one memory pool per microbatch in flight) holding a slot per length bucket,
recorded on first use, when the lane is made or between steps, reused, and the memory budget that sends a
bucket to the eager path with one log line."""

from __future__ import annotations

import logging

import pytest
import torch

from megatron.trainer.model.graph_slots import (
    MAX_LANES,
    GraphMemoryBudget,
    ShapeSlots,
    SlotLeak,
)

HIDDEN, ROWS = 8, 2
BYTES_PER_TOKEN = 100


class FakeRecorder:
    """Records nothing: a slot is a name; a lane's pool holds BYTES_PER_TOKEN per position of
    the largest shape recorded into it, so a recording adds only what its pool grows by."""

    def __init__(self):
        self.recorded: list[tuple[int, ...]] = []
        self.pools: list[dict] = []

    def new_pool(self) -> dict:
        self.pools.append({"tokens": 0})
        return self.pools[-1]

    def __call__(self, shape, pool, lane):
        self.recorded.append(shape)
        tokens = shape[0] * shape[1]
        grown = max(0, tokens - pool["tokens"]) * BYTES_PER_TOKEN
        pool["tokens"] = max(pool["tokens"], tokens)
        return f"slot {len(self.recorded)} lane {lane} {shape}", grown


def make_slots(budget=None, warm=()) -> tuple[ShapeSlots, FakeRecorder]:
    recorder = FakeRecorder()
    return ShapeSlots(recorder, budget, recorder.new_pool, warm), recorder


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


def test_lanes_follow_the_microbatches_in_flight_and_record_each_bucket_once():
    """Three buckets over six iterations of 8 microbatches, 3 in flight: 3 lanes (pools),
    each recording a bucket at most once, all in the first iteration it appears; later
    iterations record nothing; the pools hold 3 x the largest bucket, not a pool per slot."""
    slots, recorder = make_slots()
    buckets = [128, 256, 384]
    iterations = [[buckets[(i * 5 + k * 7) % 3] for k in range(8)] for i in range(6)]
    run_microbatches(slots, iterations[0], in_flight=3)
    after_first = list(recorder.recorded)
    assert set(after_first) == {(b, ROWS, HIDDEN) for b in buckets}
    for lengths in iterations[1:]:
        got = run_microbatches(slots, lengths, in_flight=3)
        assert all(slot is not None for slot in got)
    assert recorder.recorded == after_first, "a later iteration recorded again"
    assert len(slots.lanes) == 3 and len(recorder.pools) == 3
    for bucket in buckets:
        assert 1 <= after_first.count((bucket, ROWS, HIDDEN)) <= 3
    assert len(slots) == len(after_first)
    assert slots.budget.used_bytes <= 3 * 384 * ROWS * BYTES_PER_TOKEN


def test_a_lane_carries_one_microbatch_whatever_its_shape():
    """A slot is reused by its own shape only; a busy lane lends none of its slots, so two
    microbatches in flight never share a pool."""
    slots, _ = make_slots()
    short = slots.acquire(block_input(128))
    long = slots.acquire(block_input(256))  # lane 0 is busy: a second lane
    assert "lane 0" in short and "lane 1" in long
    slots.release((128, ROWS, HIDDEN), short)
    again = slots.acquire(block_input(256))  # lane 0 is free: 256 recorded into it
    assert "lane 0" in again and again != long
    assert slots.acquire(block_input(128)) is not short  # lane 0 busy again: lane 2
    slots.release((256, ROWS, HIDDEN), long)
    assert slots.acquire(block_input(256)) is long
    # another row count (a token budget) is another shape
    assert slots.acquire(block_input(128, rows=3)) not in (short, long, again)
    with pytest.raises(KeyError, match="no lane holds"):
        slots.release((64, ROWS, HIDDEN), "a slot never recorded")


def test_a_new_lane_records_the_largest_bucket_then_the_rest_between_steps():
    """With the buckets known in advance a lane records the largest (it sizes the pool) and
    the shape it is made for; record_warm() between steps records the rest into every free
    lane, so no later microbatch waits for a recording."""
    buckets = [(b, ROWS, HIDDEN) for b in (128, 256, 384)]
    slots, recorder = make_slots(warm=buckets)
    first = slots.acquire(block_input(128))
    second = slots.acquire(block_input(256))  # another lane: one microbatch in flight each
    assert recorder.recorded == [(384, ROWS, HIDDEN), (128, ROWS, HIDDEN),
                                 (384, ROWS, HIDDEN), (256, ROWS, HIDDEN)]
    assert slots.budget.used_bytes == 2 * 384 * ROWS * BYTES_PER_TOKEN  # a pool per lane
    # a lane still carrying a microbatch records nothing
    slots.release((128, ROWS, HIDDEN), first)
    assert slots.record_warm() == 1
    assert recorder.recorded[-1] == (256, ROWS, HIDDEN)
    slots.release((256, ROWS, HIDDEN), second)
    assert slots.record_warm() == 1
    assert recorder.recorded[-1] == (128, ROWS, HIDDEN)
    assert slots.record_warm() == 0
    assert slots.budget.used_bytes == 2 * 384 * ROWS * BYTES_PER_TOKEN
    recorded = len(recorder.recorded)
    for length in (384, 256, 128):
        held = [slots.acquire(block_input(length)) for _ in range(2)]
        assert None not in held
        for slot in held:
            slots.release((length, ROWS, HIDDEN), slot)
    assert len(recorder.recorded) == recorded
    # a shape outside the buckets is still recorded on first use
    assert slots.acquire(block_input(64)) is not None
    assert len(recorder.recorded) == recorded + 1


def test_memory_limit_sends_a_bucket_to_eager_with_one_line(caplog):
    """A budget of two 128-token pools and room to grow one of them to 256 tokens: a third
    pool would pass it (estimated from the first), so those microbatches run eagerly, said
    once per shape; a recording that fits in a lane's pool costs nothing; freed slots are
    still replayed."""
    per_128 = BYTES_PER_TOKEN * 128 * ROWS
    budget = GraphMemoryBudget(limit_bytes=3 * per_128)
    slots, recorder = make_slots(budget)
    with caplog.at_level(logging.INFO, logger="megatron.trainer.model.graph_slots"):
        a = slots.acquire(block_input(128))
        b = slots.acquire(block_input(128))
        assert None not in (a, b) and budget.used_bytes == 2 * per_128
        assert slots.estimate_bytes((384, ROWS, HIDDEN)) == 3 * per_128  # scaled by tokens
        assert slots.estimate_bytes((384, ROWS, HIDDEN), slots.lanes[0]) == 2 * per_128
        assert slots.acquire(block_input(256)) is None  # a third pool: 2 x per_128 more
        assert slots.acquire(block_input(256)) is None
        slots.release((128, ROWS, HIDDEN), a)
        c = slots.acquire(block_input(256))  # lane 0's pool grows by 128 tokens
        assert c is not None and budget.used_bytes == 3 * per_128
        slots.release((256, ROWS, HIDDEN), c)
        assert slots.acquire(block_input(128)) == a  # recorded in lane 0, fits: no cost
        assert slots.acquire(block_input(384)) is None  # both lanes busy: a third pool
    lines = [r.getMessage() for r in caplog.records if "memory limit" in r.getMessage()]
    assert len(lines) == 2 and "(256, 2, 8)" in lines[0] and "(384, 2, 8)" in lines[1]
    assert len(recorder.recorded) == 3


def test_blocks_share_the_rank_budget():
    budget = GraphMemoryBudget(limit_bytes=BYTES_PER_TOKEN * 128 * ROWS)
    (first, _), (second, _) = make_slots(budget), make_slots(budget)
    assert first.acquire(block_input(128)) is not None
    # the second block has recorded nothing: the rank's recordings give its estimate
    assert second.acquire(block_input(64)) is None
    assert first.acquire(block_input(128)) is None
    assert budget.used_bytes == budget.limit_bytes


def test_a_forward_without_backward_is_named_a_leak():
    slots, _ = make_slots()
    for _ in range(MAX_LANES):
        slots.acquire(block_input(128))
    with pytest.raises(SlotLeak, match="a forward whose backward never ran"):
        slots.acquire(block_input(256))


def test_negative_budget_is_refused():
    with pytest.raises(ValueError, match="must be >= 0"):
        GraphMemoryBudget(limit_bytes=-1)
