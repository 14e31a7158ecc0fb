"""--variable-seq-lengths on the shipped sample data: one document per sample, padded per
microbatch, carried through megatron-core's schedules and DPP with their real shapes.
Every layout trains to PP=1's losses (iteration 2's loss also checks the gradients of
iteration 1, through the update); padding, grouping and the cost order change nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from megatron.trainer.documents import DocumentDataConfig, build_document_datasets
from megatron.trainer.microbatches import BatchLayout, cost_ordered, plan_global_batch
from tests.distributed import run_ranks
from tests.trainer_runs import train_runs, with_flags

ROOT = Path(__file__).resolve().parents[1]
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


def test_variable_lengths_train_as_pp1_in_every_schedule(sample_prefix):
    """PP=2 and PP=4 under megatron-core's schedule (natural and cost order) and DPP (also
    with the B/W split; PP=4 with random delivery delays), PP=2 x DP=2 with grouping, and
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
              "pp2_dpp_split": with_flags(pp2, use_dpp=True, dpp_split_backward=True)}
    pp4 = with_flags(flags, pipeline_model_parallel_size=4)
    quad = {"pp4_core": pp4, "pp4_dpp": with_flags(pp4, use_dpp=True),
            "pp4_dpp_split": with_flags(pp4, use_dpp=True, dpp_split_backward=True),
            "pp2_dp2_grouped_dpp": with_flags(pp2, use_dpp=True, group_by_length=True)}
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
