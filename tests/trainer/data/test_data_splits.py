"""A --split that leaves a split the run reads without data stops every rank at start-up
with one line naming the split, its documents and tokens and the flag to change (instead
of megatron.core counting epochs forever); a start-up stage that blocks says what it waits
on (megatron.trainer.run.stalls)."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import pytest

from megatron.trainer.config.arguments import parse_args
from megatron.trainer.data.data import DataError
from megatron.trainer.data.data_splits import check_splits
from megatron.trainer.run.stalls import StallWatch
from tests.failures.test_failures_data import make_dataset
from tests.job import TINY_GPT, Job
from tests.trainer_runs import with_flags

DOCUMENTS = 200
TOKENS_PER_DOCUMENT = 20


def corpus(tmp_path, documents=DOCUMENTS) -> str:
    """`documents` documents of TOKENS_PER_DOCUMENT tokens, one sequence each."""
    return make_dataset(tmp_path / "corpus", [[list(range(1, TOKENS_PER_DOCUMENT + 1))]
                                              for _ in range(documents)])


def gpt_args(prefix: str, **overrides):
    flags = with_flags(TINY_GPT, mock_data=None, data_path=prefix, train_iters=4, **overrides)
    return parse_args(flags, world_size=1, model="gpt")


def refusal(args, by_document=False) -> str:
    with pytest.raises(DataError) as caught:
        check_splits(args, by_document)
    return str(caught.value)


def test_the_default_split_of_200_documents_leaves_the_test_split_empty(tmp_path):
    prefix = corpus(tmp_path)
    # megatron.core builds the test split (weight 1 of 1000) even where no sample is read
    for eval_iters in (0, 1):
        message = refusal(gpt_args(prefix, eval_iters=eval_iters))
        assert message.startswith(
            f"the test split of --data-path {prefix} (--split 969,30,1) gets 0 documents, "
            f"0 tokens: it is empty; give it a larger share of --split (e.g. --split 90,5,5)")
        assert "--eval-iters 0 and its --split weight to 0" in message
    check_splits(gpt_args(prefix, split="90,5,5", eval_iters=1), by_document=False)
    check_splits(gpt_args(prefix, split="100,0,0"), by_document=False)


def test_a_valid_split_smaller_than_one_sample_is_refused_at_eval_iters(tmp_path):
    # 100 documents: --split 98,1,1 gives valid and test one document of 20 tokens each,
    # fewer than one sample of --seq-length 32 (+1 token)
    prefix = corpus(tmp_path, documents=100)
    args = gpt_args(prefix, split="98,1,1", eval_iters=2, seq_length=32,
                    max_position_embeddings=32)
    message = refusal(args)
    assert message.startswith(
        f"the valid split of --data-path {prefix} (--split 98,1,1) gets 1 document, 20 "
        "tokens, fewer than one sample (33 tokens) for the 16 samples --eval-iters asks for; "
        "give it a larger share of --split (e.g. --split 90,5,5)")
    # without evaluation the one-document splits are never read: nothing to refuse
    check_splits(gpt_args(prefix, split="98,1,1", eval_iters=0, seq_length=32,
                          max_position_embeddings=32), by_document=False)


def test_bert_splits_count_documents_and_name_the_train_split(tmp_path):
    # 3 documents of 2 sentences: --split 1,1,1 gives each split one document; 10,0,90 gives
    # train round(0.1 * 3) = 0 documents
    prefix = make_dataset(tmp_path / "sentences", [[[1, 2, 3], [4, 5]]] * 3)
    args = SimpleNamespace(mock_data=False, data_path=[prefix], variable_seq_lengths=False,
                           data_blend=([prefix], None), split="10,0,90", seq_length=16,
                           train_iters=2, global_batch_size=4, eval_interval=2, eval_iters=1,
                           eval_global_batch_size=None)
    message = refusal(args, by_document=True)
    assert message.startswith(
        f"the train split of --data-path {prefix} (--split 10,0,90) gets 0 documents, 0 "
        "tokens: it is empty; give it a larger share of --split (e.g. --split 34,33,33)")
    args.split = "1,1,1"
    check_splits(args, by_document=True)


@pytest.mark.slow
def test_the_200_document_run_stops_within_30_s_with_one_line_per_rank(tmp_path):
    prefix = corpus(tmp_path)
    flags = with_flags(TINY_GPT, mock_data=None, data_path=prefix, train_iters=4,
                       eval_iters=1, pipeline_model_parallel_size=2)
    # timed from after the imports, which take most of a loaded CI machine's time
    timed = ("import atexit, time\n"
             "import megatron.trainer.run.training\n"
             "started = time.monotonic()\n"
             "atexit.register(lambda: print(f'ran {time.monotonic() - started:.1f} s'))\n")
    with Job("pretrain_gpt.py", flags, 2, tmp_path / "job", prelude=timed) as job:
        statuses = [job.wait(rank, 120) for rank in (0, 1)]
    for rank in (0, 1):
        log = job.log(rank)
        assert statuses[rank] == 1, log[-3000:]
        (error,) = job.lines(rank, " ERROR ")
        assert "bad training data: the test split of --data-path" in error
        assert "gets 0 documents, 0 tokens: it is empty" in error
        assert "Traceback" not in log
        (ran,) = job.lines(rank, "ran ")
        assert float(ran.split()[1]) < 30, "the check runs before any rank waits on another"


def test_a_stage_says_what_it_waits_on_after_the_interval(caplog):
    with caplog.at_level(logging.WARNING, logger="megatron.trainer.run.stalls"):
        with StallWatch("loading the checkpoint", "reading --load ckpt", interval_s=0.2):
            time.sleep(0.5)
        quiet_after = len(caplog.records)
        time.sleep(0.3)
        with StallWatch("joining the job", "waiting for 2 ranks", interval_s=5.0):
            pass
    warnings = [record.getMessage() for record in caplog.records]
    assert len(warnings) == 2 == quiet_after, "every interval while blocked, none after"
    assert warnings[0].startswith("still loading the checkpoint after 0 s: reading --load ckpt")


@pytest.mark.slow
def test_ranks_waiting_for_rank_0s_dataset_index_say_so(tmp_path):
    """Rank 0 builds the dataset index files while the other ranks wait in megatron.core's
    barrier: with the stall interval at 1 s, a 4 s build makes both sides say so."""
    slow_build = (
        "import os, time\n"
        "if os.environ['RANK'] == '0':\n"
        "    from megatron.trainer.data import data\n"
        "    build = data._build\n"
        "    data._build = lambda *a: (time.sleep(4), build(*a))[1]\n")
    flags = with_flags(TINY_GPT, train_iters=1, pipeline_model_parallel_size=2)
    with Job("pretrain_gpt.py", flags, 2, tmp_path / "job", prelude=slow_build,
             env={"MEGATRON_STALL_WARNING_S": "1"}) as job:
        statuses = [job.wait(rank, 120) for rank in (0, 1)]
    assert statuses == [0, 0], job.log(0)[-3000:] + job.log(1)[-3000:]
    (waiting, *_) = job.lines(1, "still building the datasets after")
    assert "waiting in a barrier for rank 0 to write the dataset index files" in waiting
    (writing, *_) = job.lines(0, "still building the datasets after")
    assert "writing the dataset index files" in writing
