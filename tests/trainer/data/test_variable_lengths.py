"""--variable-seq-lengths on the shipped sample data: one document per sample, padded per
microbatch, carried through megatron-core's schedules and DPP with their real shapes.
Every layout trains to PP=1's losses (iteration 2's loss also checks the gradients of
iteration 1, through the update); padding, grouping and the cost order change nothing."""

from __future__ import annotations

import subprocess
import sys

import pytest

from megatron.trainer.data.documents import DocumentDataConfig, build_document_datasets
from megatron.trainer.data.microbatches import BatchLayout, cost_ordered, plan_global_batch
from tests import REPO as ROOT
from tests.distributed import run_ranks
from tests.trainer_runs import train_runs, with_flags

SEQ, MICRO, GLOBAL, SEED = 128, 2, 16, 3


@pytest.fixture(scope="module")
def sample_prefix(tmp_path_factory):
    """The shipped GPT sample text, tokenized as README's main job does."""
    prefix = tmp_path_factory.mktemp("sample") / "gpt"
    subprocess.run(
        [sys.executable, "tools/preprocess_data.py", "--input", "datasets_gpt/dataset.json",
         "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "datasets_gpt/vocab.json",
         "--merge-file", "datasets_gpt/merges.txt", "--append-eod", "--workers", "1",
         "--output-prefix", str(prefix)],
        cwd=ROOT, check=True, capture_output=True)
    return f"{prefix}_text_document"


def base_flags(prefix: str) -> list[str]:
    return [
        "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ),
        "--micro-batch-size", str(MICRO), "--global-batch-size", str(GLOBAL),
        "--train-iters", "2", "--lr", "1e-3", "--eval-iters", "0", "--log-interval", "1",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", str(SEED),
        "--make-vocab-size-divisible-by", "64",  # one padded vocabulary at TP 1 and 2
        "--tokenizer-type", "GPT2BPETokenizer",
        "--vocab-file", str(ROOT / "datasets_gpt/vocab.json"),
        "--merge-file", str(ROOT / "datasets_gpt/merges.txt"),
        "--data-path", prefix, "--split", "98,1,1", "--variable-seq-lengths",
        "--dpp-transport", "torch",
    ]


def first_batch_costs(prefix: str, pad_to_multiple: int = 1, data_parallel: int = 1):
    """Token counts of the first global batch's microbatches (DP rank 0) and their longest
    samples, as the trainer plans them."""
    (train, _, _) = build_document_datasets(
        DocumentDataConfig([prefix], None, "98,1,1", SEQ, SEED), (2 * GLOBAL, 0, 0))
    layout = BatchLayout(MICRO, GLOBAL, data_parallel, pad_to_multiple=pad_to_multiple)
    plan = plan_global_batch(train, 0, layout)
    longest = [int(max(train.sample_lengths(list(samples)))) for samples in plan.samples[0]]
    return plan.token_counts(0), list(plan.lengths[0]), longest


def losses_of(per_rank: list[list[dict]], run: int) -> list[float]:
    """The reported loss of each iteration of run `run` (the last rank reports)."""
    return [entry["lm loss"] for entry in per_rank[-1][run]["losses"]]


def assert_same_losses(losses, reference, name):
    assert len(losses) == len(reference) == 2, name
    assert losses == pytest.approx(reference, rel=2e-5, abs=1e-6), name


@pytest.mark.slow
@pytest.mark.long
def test_variable_lengths_train_as_pp1_in_every_schedule(sample_prefix):
    """PP=2 and PP=4 under megatron-core's schedule (natural and cost order, interleaved at
    PP=2, TP=2 with sequence parallelism: the planned shapes split by TP) and DPP (also
    with the B/W split, with virtual stages, with TP=2 and sequence parallelism padded to
    a multiple of 6; PP=4 with random delivery delays), PP=2 x DP=2 with grouping, and
    PP=1 with all-padding positions: PP=1's losses."""
    flags = base_flags(sample_prefix)
    costs, padded, longest = first_batch_costs(sample_prefix, pad_to_multiple=8)
    assert any(p > n for p, n in zip(padded, longest, strict=True)), \
        "no all-padding position with --pad-to-multiple 8: the case shows nothing"
    natural, _, _ = first_batch_costs(sample_prefix)
    assert cost_ordered(natural, 2) != list(range(len(natural))), \
        "the cost order is the natural one: the case shows nothing"
    single = {"pp1": flags, "pp1_pad8": with_flags(flags, pad_to_multiple=8),
              "pp1_grouped": with_flags(flags, group_by_length=True)}
    pp2 = with_flags(flags, pipeline_model_parallel_size=2)
    double = {"pp2_core": pp2, "pp2_core_cost": with_flags(pp2, microbatch_order="cost"),
              "pp2_dpp": with_flags(pp2, use_dpp=True),
              "pp2_dpp_split": with_flags(pp2, use_dpp=True, dpp_split_backward=True),
              "pp2_vpp2_dpp": with_flags(pp2, use_dpp=True,
                                         num_layers_per_virtual_pipeline_stage=1),
              "pp2_vpp2_core": with_flags(pp2, num_layers_per_virtual_pipeline_stage=1)}
    pp4 = with_flags(flags, pipeline_model_parallel_size=4)
    quad = {"pp4_core": pp4, "pp4_dpp": with_flags(pp4, use_dpp=True),
            "pp4_dpp_split": with_flags(pp4, use_dpp=True, dpp_split_backward=True),
            "pp2_dp2_grouped_dpp": with_flags(pp2, use_dpp=True, group_by_length=True),
            "pp2_tp2_sp_dpp": with_flags(pp2, use_dpp=True, tensor_model_parallel_size=2,
                                         sequence_parallel=True, pad_to_multiple=3),
            "pp2_tp2_sp_core": with_flags(pp2, tensor_model_parallel_size=2,
                                          sequence_parallel=True, pad_to_multiple=3)}
    reference = None
    for world, runs, env in ((1, single, None), (2, double, None),
                             (4, quad, {"DPP_TEST_DELIVERY_JITTER_MS": "5"})):
        per_rank = run_ranks(world, train_runs, list(runs.values()), world, env=env)
        for index, name in enumerate(runs):
            losses = losses_of(per_rank, index)
            if reference is None:
                reference = losses
                assert all(0 < loss < 20 for loss in reference)
            assert_same_losses(losses, reference, name)


def held_activation_bytes(rank, flags, world_size):
    """Rank function: one training step of the first global batch under each schedule, on
    the same model; this rank's peak bytes of tensors kept for backward in each."""
    import contextlib

    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron.dpp.config import DppOptions
    from megatron.dpp.schedule import DppSchedule
    from megatron.trainer.config.arguments import parse_args
    from megatron.trainer.data.microbatches import reorder_data_iterators
    from megatron.trainer.run.activation_memory import SavedTensorBytes
    from megatron.trainer.run.training import data_iterators, iteration_lengths, setup
    from megatron.trainer.tasks.gpt import GPT_TASK

    args = parse_args(flags, world_size=world_size)
    peaks = {}
    with contextlib.ExitStack() as stack:
        trainer = setup(GPT_TASK, args, stack)
        costs, _, _ = iteration_lengths(trainer, 0, args.global_batch_size)
        core = get_forward_backward_func()
        for name in ("1f1b", "1f1b_cost", "dpp+0", "dpp+2"):
            iterator = data_iterators(trainer, trainer.datasets[0], 0)
            schedule = core
            if name == "1f1b_cost":
                order = cost_ordered(costs, args.pipeline_model_parallel_size)
                iterator = reorder_data_iterators(iterator, order)
            elif name.startswith("dpp"):
                schedule = DppSchedule(DppOptions(slack=int(name[-1]), transport="torch"))
                stack.callback(schedule.close)
                schedule.set_microbatch_costs(costs)
            for chunk in trainer.model:
                chunk.zero_grad_buffer()
            counter = SavedTensorBytes(p for chunk in trainer.model for p in chunk.parameters())
            with counter.counting():
                schedule(forward_step_func=trainer.forward_step_func(1), data_iterator=iterator,
                         model=trainer.model, num_microbatches=args.num_microbatches,
                         seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
                         decoder_seq_length=args.seq_length, forward_only=False)
            assert counter.current == 0, f"{name}: {counter.current} bytes still held"
            peaks[name] = counter.peak
    return {"peaks": peaks, "costs": costs}


@pytest.mark.slow
def test_dpp_holds_no_more_activation_memory_than_1f1b(sample_prefix):
    """PP=4, a variable-length batch, arrivals delayed at random: per rank, DPP at slack 0
    (cost order, token cap) holds at most what megatron-core's 1F1B fed the same order
    holds; the counter sees the pipeline's shape (rank 0 holds the most under 1F1B) and
    the slack's extra forwards. (The cost order itself may hold more than megatron's
    natural order: docs/benchmarks/variable_lengths.md.)"""
    flags = with_flags(base_flags(sample_prefix), pipeline_model_parallel_size=4)
    results = run_ranks(4, held_activation_bytes, flags, 4,
                        env={"DPP_TEST_DELIVERY_JITTER_MS": "5"})
    peaks = [r["peaks"] for r in results]
    assert len(set(results[0]["costs"])) > 1, "the batch's microbatches are all alike"
    for rank, peak in enumerate(peaks):
        assert 0 < peak["dpp+0"] <= peak["1f1b_cost"], (rank, peak)
    # the counter sees what a schedule holds: slack 2 buffers two more forwards on rank 0
    assert peaks[0]["dpp+2"] > peaks[0]["dpp+0"], peaks[0]
    first_ranks = [peak["1f1b"] for peak in peaks[:-1]]
    assert first_ranks == sorted(first_ranks, reverse=True), peaks
