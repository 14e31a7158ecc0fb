"""Token-budget micro-batching (`--microbatch-tokens`) and bucketed padding
(`--pad-to-multiple` with `--seq-length-cv`): the plan's cut, and training equal to PP=1 on
the same samples under megatron-core's schedule and DPP while the number of microbatches
changes from one iteration to the next; the same for `--seq-length-cv`'s lengths drawn per
sample under a budget."""

from __future__ import annotations

import numpy as np
import pytest

from megatron.trainer.data.microbatches import BatchLayout, padded_length, plan_global_batch
from tests.distributed import run_ranks
from tests.trainer.data.test_variable_lengths import (  # noqa: F401 (sample_prefix: a fixture)
    GLOBAL,
    SEQ,
    base_flags,
    losses_of,
    sample_prefix,
)
from tests.trainer_runs import TINY, train_runs, with_flags

BUDGET = 384  # three samples of 128 tokens, or more shorter ones
ITERATIONS = 3


class Lengths:
    """A dataset of which only the sample lengths are read."""

    def __init__(self, lengths, seq_length):
        self.lengths, self.seq_length = np.asarray(lengths), seq_length

    def sample_lengths(self, indices):
        return self.lengths[np.asarray(indices)]


@pytest.mark.parametrize("group", [False, True], ids=["natural", "grouped"])
@pytest.mark.parametrize("dp", [1, 2])
def test_token_budget_cut(group, dp):
    """Every sample of the global batch once; each microbatch within the budget, and the
    next sample of its rank's order would have passed it (greedy); the count varies."""
    rng = np.random.default_rng(5)
    # global batches of long and of short documents in turn
    data = Lengths(np.concatenate([rng.integers(2, 129 if k % 2 else 33, size=32)
                                   for k in range(5)]), seq_length=128)
    layout = BatchLayout(2, 32, dp, group_by_length=group, pad_to_multiple=8,
                         microbatch_tokens=BUDGET)
    counts = set()
    for consumed in range(0, 160, 32):
        plan = plan_global_batch(data, consumed, layout)
        seen = sorted(i for rank in plan.samples for mb in rank for i in mb)
        assert seen == list(range(consumed, consumed + 32))
        for rank in range(dp):
            mbs, widths = plan.samples[rank], plan.lengths[rank]
            assert all(len(mb) * w <= BUDGET for mb, w in zip(mbs, widths, strict=True))
            assert plan.token_counts(rank) == [len(mb) * w for mb, w in zip(mbs, widths,
                                                                            strict=True)]
            for mb, following in zip(mbs[:-1], mbs[1:], strict=True):
                joined = [*mb, following[0]]
                width = padded_length(int(data.lengths[joined].max()), 8, 128)
                assert len(joined) * width > BUDGET
            assert list(plan.real_tokens[rank]) == [int(data.lengths[list(mb)].sum())
                                                    for mb in mbs]
            counts.add(len(mbs))
    assert len(counts) > 1, "the number of microbatches never changed"


def test_token_budget_refuses_a_sample_it_cannot_hold():
    data = Lengths([100, 300], seq_length=512)
    with pytest.raises(ValueError, match="padded to 304 tokens does not fit"):
        plan_global_batch(data, 0, BatchLayout(1, 2, 1, pad_to_multiple=16,
                                               microbatch_tokens=256))


def microbatch_counts(prefix: str, iterations: int) -> list[int]:
    from megatron.trainer.data.documents import DocumentDataConfig, build_document_datasets

    (train, _, _) = build_document_datasets(
        DocumentDataConfig([prefix], None, "98,1,1", SEQ, 3), (iterations * GLOBAL, 0, 0))
    layout = BatchLayout(2, GLOBAL, 1, microbatch_tokens=BUDGET)
    return [len(plan_global_batch(train, k * GLOBAL, layout).samples[0])
            for k in range(iterations)]


@pytest.mark.slow
@pytest.mark.long
def test_token_budget_trains_as_pp1_in_every_schedule(sample_prefix):  # noqa: F811
    """PP=1 with 8 microbatches of 2 documents is the reference; with a budget of 384 tokens
    the same 16 documents per iteration form 5, 5, then 6 microbatches (checked), and
    PP=1, megatron-core's 1F1B at PP=2 (natural and cost order) and PP=4, and DPP at PP=2
    (with the B/W split too, and its plan in order) and PP=4 (random delivery delays), all
    give its losses:
    the loss is per token, so how documents are grouped changes nothing. Each iteration's
    loss also checks the gradients of the ones before, through the updates."""
    counts = microbatch_counts(sample_prefix, ITERATIONS)
    assert len(set(counts)) > 1 and max(counts) < GLOBAL // 2, counts
    flags = with_flags(base_flags(sample_prefix), train_iters=ITERATIONS)
    budget = with_flags(flags, microbatch_tokens=BUDGET)
    pp2 = with_flags(budget, pipeline_model_parallel_size=2)
    pp4 = with_flags(budget, pipeline_model_parallel_size=4)
    groups = (
        (1, {"pp1": flags, "pp1_budget": budget,
             "pp1_budget_grouped": with_flags(budget, group_by_length=True)}, None),
        (2, {"pp2_core": pp2, "pp2_core_cost": with_flags(pp2, microbatch_order="cost"),
             "pp2_dpp": with_flags(pp2, use_dpp=True),
             "pp2_dpp_split": with_flags(pp2, use_dpp=True, dpp_split_backward=True),
             # --use-dpp's GPU default: the plan in order, in the cost order
             "pp2_dpp_split_static": with_flags(pp2, use_dpp=True, dpp_split_backward=True,
                                                dpp_static=True)}, None),
        (4, {"pp4_core": pp4, "pp4_dpp": with_flags(pp4, use_dpp=True)},
         {"DPP_TEST_DELIVERY_JITTER_MS": "5"}),
    )
    reference = None
    for world, runs, env in groups:
        per_rank = run_ranks(world, train_runs, list(runs.values()), world, env=env)
        for index, name in enumerate(runs):
            losses = losses_of(per_rank, index)
            if reference is None:
                reference = losses
                assert len(reference) == ITERATIONS and all(0 < x < 20 for x in reference)
            assert losses == pytest.approx(reference, rel=2e-5, abs=1e-6), name


SYNTHETIC = with_flags(TINY, seq_length=64, max_position_embeddings=64, global_batch_size=8,
                       train_iters=2, seq_length_cv=0.5, seed=11)


@pytest.mark.slow
def test_bucketed_synthetic_lengths_train_as_unpadded():
    """--seq-length-cv with --pad-to-multiple 32: the drawn lengths (multiples of 16) are
    padded to buckets of 32, the padding out of the loss: PP=1 and DPP at PP=2 give the
    unpadded run's losses, and the log line reports the padding."""
    from megatron.trainer.data.data import variable_length

    drawn = {variable_length(64, 0.5, 11, k) for k in range(0, 16, 2)}
    assert any(n % 32 for n in drawn), f"no length to pad among {drawn}: the case shows nothing"
    padded = with_flags(SYNTHETIC, pad_to_multiple=32, log_throughput=True)
    runs = [SYNTHETIC, padded]
    (single,) = run_ranks(1, train_runs, runs, 1)
    reference = [entry["lm loss"] for entry in single[0]["losses"]]
    assert [entry["lm loss"] for entry in single[1]["losses"]] == pytest.approx(
        reference, rel=2e-5)
    lines = [m for _, m in single[1]["logs"] if "real tokens per second" in m]
    assert lines and all("padding: " in line for line in lines)
    dpp = with_flags(padded, pipeline_model_parallel_size=2, use_dpp=True,
                     dpp_transport="torch")
    per_rank = run_ranks(2, train_runs, [dpp], 2)
    assert [entry["lm loss"] for entry in per_rank[-1][0]["losses"]] == pytest.approx(
        reference, rel=2e-5)


class FullSamples:
    """GPT samples of `seq_length` tokens whose ids tell sample and position apart."""

    def __init__(self, count: int, seq_length: int):
        self.count, self.seq_length = count, seq_length

    def __len__(self):
        return self.count

    def __getitem__(self, index):
        import torch

        tokens = torch.arange(self.seq_length, dtype=torch.int64) + 1000 * index
        return {"tokens": tokens, "labels": tokens + 1,
                "loss_mask": torch.ones(self.seq_length), "position_ids": torch.arange(
                    self.seq_length)}


def test_drawn_lengths_cut_each_sample_to_its_own_draw():
    """--seq-length-cv under a budget: each sample is its own draw (the synthetic path's
    lognormal, indexed by the sample), the first tokens of the full sample; past the end
    the order wraps as Megatron's does while the draw keeps the index; the budget then cuts
    the global batches into varying numbers of microbatches."""
    from megatron.trainer.data.data import DrawnLengthSamples, variable_length

    samples = DrawnLengthSamples(FullSamples(40, 64), 64, 0.5, seed=3)
    lengths = samples.sample_lengths(range(50))
    assert list(lengths) == [variable_length(64, 0.5, 3, k) for k in range(50)]
    assert len(set(lengths)) > 3
    for index in (0, 7, 45):
        sample = samples[index]
        assert set(sample) == {"tokens", "labels", "loss_mask"}
        assert len(sample["tokens"]) == len(sample["labels"]) == lengths[index]
        assert sample["tokens"].tolist() == list(range(1000 * (index % 40),
                                                       1000 * (index % 40) + lengths[index]))
    layout = BatchLayout(2, 8, 1, pad_to_multiple=16, microbatch_tokens=128)
    counts = {len(plan_global_batch(samples, k * 8, layout).samples[0]) for k in range(5)}
    assert len(counts) > 1, counts


DRAWN = with_flags(SYNTHETIC, seq_length_cv=0.5, train_iters=3, microbatch_tokens=128,
                   global_batch_size=8)


@pytest.mark.slow
@pytest.mark.long
def test_drawn_lengths_under_a_budget_train_alike_in_every_schedule():
    """--seq-length-cv 0.5 with --microbatch-tokens: the same samples cut into other
    microbatches (a budget of 64 tokens: mostly one sample each; 128: several) give the same
    per-token losses at PP=1, and megatron-core's 1F1B (natural and cost order) and DPP (with
    the B/W split) at PP=2 give them too; the number of microbatches varies (checked)."""
    from megatron.trainer.data.data import DrawnLengthSamples

    lengths = DrawnLengthSamples(None, 64, 0.5, seed=11)
    counts = [len(plan_global_batch(lengths, k * 8, BatchLayout(
        2, 8, 1, microbatch_tokens=128)).samples[0]) for k in range(3)]
    assert len(set(counts)) > 1, counts
    pp2 = with_flags(DRAWN, pipeline_model_parallel_size=2)
    (single,) = run_ranks(1, train_runs, [DRAWN, with_flags(DRAWN, microbatch_tokens=64),
                                          with_flags(DRAWN, group_by_length=True)], 1)
    reference = [entry["lm loss"] for entry in single[0]["losses"]]
    assert len(reference) == 3 and all(0 < x < 20 for x in reference)
    for run in single[1:]:
        assert [entry["lm loss"] for entry in run["losses"]] == pytest.approx(
            reference, rel=2e-5)
    runs = {"core": pp2, "core_cost": with_flags(pp2, microbatch_order="cost"),
            "dpp_split": with_flags(pp2, use_dpp=True, dpp_split_backward=True,
                                    dpp_transport="torch")}
    per_rank = run_ranks(2, train_runs, list(runs.values()), 2)
    for index, name in enumerate(runs):
        assert [entry["lm loss"] for entry in per_rank[-1][index]["losses"]] == pytest.approx(
            reference, rel=2e-5), name
        # both stages read data (tokens; labels): each has read the next global batch of 8
        # by the end of a step, but none after the last
        for rank in range(2):
            assert per_rank[rank][index]["planned_samples"] == [[16], [24], [24]], (name, rank)
