"""--manual-gc: the automatic collector is off while training, collections come at the
chosen points, and the collector's state is restored afterwards."""

from __future__ import annotations

import gc

import pytest

from megatron.trainer.config.arguments import ArgumentError, parse_args
from megatron.trainer.run import manual_gc
from megatron.trainer.run.manual_gc import ManualGC
from tests.pipeline_runs import TINY_GPT


@pytest.fixture
def collections(monkeypatch):
    calls = []
    monkeypatch.setattr(manual_gc.gc, "collect", lambda *a: calls.append(a) or 0)
    return calls


def test_collects_at_start_interval_and_around_eval(collections):
    assert gc.isenabled()
    with ManualGC(enabled=True, interval=3) as collector:
        assert not gc.isenabled()
        assert len(collections) == 1  # at start
        for iteration in range(1, 8):
            collector.after_step(iteration)
        assert len(collections) == 3  # after iterations 3 and 6
        with collector.evaluation():
            assert len(collections) == 4
        assert len(collections) == 5
    assert gc.isenabled()


def test_off_changes_nothing(collections):
    with ManualGC(enabled=False, interval=1) as collector:
        assert gc.isenabled()
        collector.after_step(1)
        with collector.evaluation():
            pass
    assert collections == [] and gc.isenabled()


def test_no_eval_collection_and_interval_zero(collections):
    with ManualGC(enabled=True, interval=0, around_eval=False) as collector:
        for iteration in range(1, 5):
            collector.after_step(iteration)
        with collector.evaluation():
            pass
    assert len(collections) == 1


def test_flags():
    base = [*TINY_GPT, "--global-batch-size", "4"]
    args = parse_args([*base, "--manual-gc", "--manual-gc-interval", "5", "--no-manual-gc-eval"],
                      world_size=1)
    assert (args.manual_gc, args.manual_gc_interval, args.manual_gc_eval) == (True, 5, False)
    with pytest.raises(ArgumentError, match="--manual-gc-interval -1 must be >= 0"):
        parse_args([*base, "--manual-gc", "--manual-gc-interval", "-1"], world_size=1)
