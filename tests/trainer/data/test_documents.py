"""Variable-length data (megatron/trainer/data/documents.py, microbatches.py): one document per
sample, Megatron's --split on documents, a resumable shuffled order, blending, padding that
the loss ignores, grouping by length, token counts, and the reordering iterator."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from megatron.core.datasets.blended_megatron_dataset_config import (
    convert_split_vector_to_split_matrix,
    parse_and_normalize_split,
)
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

from megatron.trainer.data.documents import (
    BlendedDocuments,
    DocumentDataConfig,
    DocumentDataset,
    build_document_datasets,
    length_statistics,
    split_document_ranges,
)
from megatron.trainer.data.microbatches import (
    BatchLayout,
    DocumentMicrobatches,
    ReorderedMicrobatches,
    cost_ordered,
    microbatch_token_counts,
    pad_microbatch,
    plan_global_batch,
    reorder_data_iterators,
)

SEQ = 12
SPLIT_SENTENCES_DOC = 5  # stored as two sequences, as preprocess_data --split-sentences does


def token(document: int, position: int) -> int:
    """Token values say where they come from: document * 1000 + position."""
    return document * 1000 + position


def write_prefix(path, lengths) -> str:
    builder = IndexedDatasetBuilder(f"{path}.bin", dtype=np.int32)
    for doc, n in enumerate(lengths):
        values = np.array([token(doc, p) for p in range(n)], dtype=np.int32)
        if doc == SPLIT_SENTENCES_DOC:
            builder.add_document(values, [n // 2, n - n // 2])
        else:
            builder.add_document(values, [n])
    builder.finalize(f"{path}.idx")
    return str(path)


# 60 documents of 1..40 tokens (some longer than SEQ + 1, one of a single token)
LENGTHS = [int(n) for n in np.random.default_rng(7).integers(2, 41, size=60)]
LENGTHS[3] = 1
LENGTHS[SPLIT_SENTENCES_DOC] = 30


@pytest.fixture(scope="module")
def prefix(tmp_path_factory):
    return write_prefix(tmp_path_factory.mktemp("docs") / "corpus", LENGTHS)


def datasets(prefix, sizes=(200, 40, 20), seed=1234, split="80,15,5", **kw):
    config = DocumentDataConfig([prefix] if isinstance(prefix, str) else prefix,
                                kw.pop("weights", None), split, SEQ, seed, **kw)
    return build_document_datasets(config, sizes)


def check_sample(sample, document: int):
    """The sample is document's beginning: n + 1 tokens, shifted by one for the labels."""
    n = min(LENGTHS[document], SEQ + 1) - 1
    expected = torch.tensor([token(document, p) for p in range(n + 1)])
    assert torch.equal(sample["tokens"], expected[:-1])
    assert torch.equal(sample["labels"], expected[1:])
    assert torch.equal(sample["loss_mask"], torch.ones(n))


@pytest.mark.parametrize("split", ["969,30,1", "80,15,5", "98/2", "1", "0,1,0", "33,33,34"])
@pytest.mark.parametrize("documents", [7, 60, 2101])
def test_split_ranges_are_megatrons(split, documents):
    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    expected = [(0, 0) if bounds is None else
                (int(round(bounds[0] * documents)), int(round(bounds[1] * documents)))
                for bounds in matrix]
    ranges = split_document_ranges(split, documents)
    assert [(a, b) for a, b in ranges if b > a] == [(a, b) for a, b in expected if b > a]
    assert ranges[0][0] == 0 and ranges[-1][1] == documents


@pytest.mark.parametrize("split", ["", "1,2,3,4", "a,b", "0,0,0", "-1,2"])
def test_a_bad_split_is_refused_by_name(split):
    with pytest.raises(ValueError, match="--split"):
        split_document_ranges(split, 10)


def test_every_sample_is_one_truncated_document(prefix):
    train, valid, test = datasets(prefix)
    seen = {}
    for name, dataset, (lo, hi) in zip(("train", "valid", "test"), (train, valid, test),
                                       split_document_ranges("80,15,5", len(LENGTHS)),
                                       strict=True):
        for i in range(len(dataset)):
            document = dataset.document_of(i)
            assert lo <= document < hi, name
            sample = dataset[i]
            check_sample(sample, document)
            assert dataset.sample_lengths([i])[0] == len(sample["tokens"])
            seen.setdefault(name, set()).add(document)
    # every document of 2+ tokens of its split is used; the 1-token one never
    assert seen["train"] == {d for d in range(48) if LENGTHS[d] >= 2}
    assert seen["valid"] == set(range(48, 57)) and seen["test"] == set(range(57, 60))
    assert SPLIT_SENTENCES_DOC in seen["train"] and 3 not in seen["train"]
    assert max(len(train[i]["tokens"]) for i in range(len(train))) == SEQ


def test_eod_tokens_can_be_masked_out_of_the_loss(prefix):
    (train, _, _) = datasets(prefix, eod_token=token(0, 4))
    sample = train[[train.document_of(i) for i in range(47)].index(0)]
    assert sample["loss_mask"].tolist() == [0.0 if p == 3 else 1.0 for p in range(SEQ)]


def test_epochs_shuffle_every_document_once_deterministically(prefix):
    (train, _, _), (again, _, _) = datasets(prefix), datasets(prefix)
    (other_seed, _, _) = datasets(prefix, seed=99)
    documents = len(train.documents)
    assert documents == 47 and len(train) == 5 * documents  # whole epochs >= 200 samples
    epochs = [[train.document_of(e * documents + k) for k in range(documents)]
              for e in range(6)]
    for order in epochs:
        assert sorted(order) == sorted(train.documents.tolist())
    assert epochs[0] != epochs[1]  # a new permutation each epoch
    assert epochs == [[again.document_of(e * documents + k) for k in range(documents)]
                      for e in range(6)]
    assert epochs[0] != [other_seed.document_of(k) for k in range(documents)]


def test_blending_follows_the_weights_and_reads_each_prefix_in_its_order(prefix, tmp_path):
    second = write_prefix(tmp_path / "second", [10 + (d % 7) for d in range(30)])
    (blend, _, _) = datasets([prefix, second], sizes=(400, 0, 0), weights=[1.0, 3.0])
    (alone, _, _) = datasets(prefix, sizes=(400, 0, 0))
    assert isinstance(blend, BlendedDocuments) and len(blend) == 400
    from_first = np.flatnonzero(blend.dataset_index == 0)
    assert len(from_first) == 100
    # the first prefix's samples are that prefix's own sample sequence, in order
    for k, i in enumerate(from_first[:60]):
        check_sample(blend[int(i)], alone.document_of(k))
    lengths = blend.sample_lengths(np.arange(400))
    assert lengths.tolist() == [len(blend[i]["tokens"]) for i in range(400)]
    with pytest.raises(IndexError, match="400"):
        blend.sample_lengths([400])


def test_data_errors_name_the_problem(prefix, tmp_path):
    with pytest.raises(FileNotFoundError, match="missing"):
        datasets(str(tmp_path / "missing"))
    tiny = write_prefix(tmp_path / "tiny", [5, 6, 7])
    with pytest.raises(ValueError, match="no valid documents in .*tiny"):
        datasets([prefix, tiny], weights=[1.0, 1.0], split="90,10,0")
    with pytest.raises(ValueError, match="weights"):
        datasets([prefix, tiny], weights=[1.0])
    with pytest.raises(ValueError, match="no document of 2 tokens"):
        DocumentDataset(IndexedDataset(prefix), np.array([3]), SEQ, 10, 0, name="one-token")


def test_padding_is_masked_and_has_the_gpt_batch_shape():
    samples = [{"tokens": torch.arange(1, n + 1), "labels": torch.arange(2, n + 2),
                "loss_mask": torch.ones(n)} for n in (3, 7, 1)]
    batch = pad_microbatch(samples, pad_to_multiple=8, pad_id=5)
    assert batch["attention_mask"] is None
    assert all(batch[k].shape == (3, 8) for k in ("tokens", "labels", "loss_mask",
                                                  "position_ids"))
    assert batch["loss_mask"].dtype == torch.float32 and batch["tokens"].dtype == torch.int64
    for row, n in enumerate((3, 7, 1)):
        assert batch["tokens"][row, :n].tolist() == list(range(1, n + 1))
        assert batch["loss_mask"][row].tolist() == [1.0] * n + [0.0] * (8 - n)
        assert batch["labels"][row, n:].eq(5).all() and batch["tokens"][row, n:].eq(5).all()
        assert batch["position_ids"][row].tolist() == list(range(8))
    assert batch["loss_mask"][:, 7].eq(0).all()  # a position that is padding in every row
    assert pad_microbatch(samples)["tokens"].shape == (3, 7)  # its own longest, no more
    assert pad_microbatch(samples, 16, max_length=12)["tokens"].shape == (3, 12)


def read(iterator, count):
    return [next(iterator) for _ in range(count)]


@pytest.mark.parametrize("group", [False, True])
def test_resume_at_consumed_samples_continues_the_same_batches(prefix, group):
    (train, _, _) = datasets(prefix)
    layout = BatchLayout(2, 8, 2, group_by_length=group, pad_to_multiple=4)
    for rank in range(2):
        whole = read(DocumentMicrobatches(train, layout, rank), 6)  # 3 global batches
        resumed = read(DocumentMicrobatches(train, layout, rank, consumed_samples=16), 2)
        for a, b in zip(whole[4:], resumed, strict=True):
            assert all(torch.equal(a[k], b[k]) for k in ("tokens", "labels", "loss_mask"))


class _CountedReads:
    """The dataset, counting the samples read."""

    def __init__(self, dataset):
        self.dataset, self.reads = dataset, 0

    def __getattr__(self, name):
        return getattr(self.dataset, name)

    def __getitem__(self, index):
        self.reads += 1
        return self.dataset[index]


def test_reading_the_next_global_batch_ahead_gives_the_same_microbatches(prefix):
    """read_next_global_batch, called once a global batch is read (as the trainer does at
    the end of a step), reads the whole next one: the microbatches that follow are those of
    an iterator read one by one, and reading them touches the dataset no more. Called with
    microbatches of this batch left, it reads nothing."""
    (train, _, _) = datasets(prefix)
    layout = BatchLayout(2, 8, 2, group_by_length=True, pad_to_multiple=4,
                         microbatch_tokens=16)
    for rank in range(2):
        counted = _CountedReads(train)
        ahead = DocumentMicrobatches(counted, layout, rank)
        ahead.read_next_global_batch()
        counts = [len(plan_global_batch(train, 8 * k, layout).samples[rank]) for k in range(3)]
        assert counted.reads == 4  # a global batch of 8 samples, half of it this rank's
        batches = []
        for count in counts:
            reads = counted.reads
            batches += read(ahead, count)
            assert counted.reads == reads  # read ahead: no sample read here
            ahead.read_next_global_batch()
            assert counted.reads == reads + 4
        one_by_one = read(DocumentMicrobatches(train, layout, rank), sum(counts))
        for a, b in zip(batches, one_by_one, strict=True):
            assert all(torch.equal(a[k], b[k]) for k in ("tokens", "labels", "loss_mask"))
        partly = DocumentMicrobatches(counted, layout, rank)
        next(partly)
        assert counts[0] > 1  # microbatches of the first batch left: nothing read ahead
        reads = counted.reads
        partly.read_next_global_batch()
        assert counted.reads == reads


def test_a_global_batch_planned_again_reads_no_lengths(prefix):
    """The trainer plans each step's batch after its data iterator planned it to read it
    ahead: the second plan is the first, the lengths read once."""
    (train, _, _) = datasets(prefix)

    class CountedLengths(_CountedReads):
        def sample_lengths(self, indices):
            self.reads += 1
            return self.dataset.sample_lengths(indices)

    counted = CountedLengths(train)
    layout = BatchLayout(2, 8, 2, group_by_length=True, pad_to_multiple=4,
                         microbatch_tokens=16)
    reader = DocumentMicrobatches(counted, layout, 0)
    reader.read_next_global_batch()
    reads = counted.reads
    plan = plan_global_batch(counted, 0, BatchLayout(2, 8, 2, group_by_length=True,
                                                     pad_to_multiple=4, microbatch_tokens=16))
    assert counted.reads == reads and plan.samples[0] == plan_global_batch(train, 0, layout).samples[0]
    plan_global_batch(counted, 8, layout)
    assert counted.reads == reads + 1


def test_without_grouping_the_layout_is_megatrons(prefix):
    (train, _, _) = datasets(prefix)
    plan = plan_global_batch(train, 24, BatchLayout(2, 12, 3))
    # DP rank r's k-th microbatch: samples c + k*m*d + r*m + [0, m)
    assert plan.samples == tuple(tuple((24 + k * 6 + r * 2, 24 + k * 6 + r * 2 + 1)
                                       for k in range(2)) for r in range(3))


def test_grouping_keeps_the_global_batch_and_partitions_it_deterministically(prefix):
    (train, _, _) = datasets(prefix)
    for consumed in (0, 32, 64):
        natural = plan_global_batch(train, consumed, BatchLayout(2, 32, 2))
        layout = BatchLayout(2, 32, 2, group_by_length=True)
        grouped = plan_global_batch(train, consumed, layout)
        assert grouped == plan_global_batch(train, consumed, layout)  # every rank alike
        everything = [i for rank in grouped.samples for mb in rank for i in mb]
        assert sorted(everything) == list(range(consumed, consumed + 32))
        assert [len(rank) for rank in grouped.samples] == [8, 8]
        assert all(len(mb) == 2 for rank in grouped.samples for mb in rank)
        # microbatches are neighbours in length order: little padding
        lengths = train.sample_lengths(np.arange(consumed, consumed + 32))
        rank_of = {tuple(sorted(mb)): r for r, rank in enumerate(grouped.samples)
                   for mb in rank}
        by_length = np.lexsort((np.arange(32), lengths)) + consumed
        assert {tuple(sorted(int(i) for i in by_length[j:j + 2])) for j in range(0, 32, 2)} \
            == set(rank_of)
        padded = [sum(p.token_counts(r)) for p in (natural, grouped) for r in range(2)]
        assert sum(padded[2:]) < sum(padded[:2])


def test_grouping_keeps_the_data_parallel_ranks_work_even(prefix):
    (train, _, _) = datasets(prefix, sizes=(400, 40, 20))
    for consumed in range(0, 384, 48):
        plan = plan_global_batch(train, consumed, BatchLayout(1, 48, 4, group_by_length=True))
        counts = np.array([plan.token_counts(r) for r in range(4)])  # [rank, slot]
        totals = counts.sum(axis=1)
        # every slot holds 4 neighbours in length order, one per rank; the ranks' totals
        # differ by at most the largest spread inside one slot
        assert totals.max() - totals.min() <= (counts.max(axis=0) - counts.min(axis=0)).max()


@pytest.mark.parametrize("group", [False, True])
def test_token_counts_are_the_batches_sizes(prefix, group):
    (train, _, _) = datasets(prefix)
    layout = BatchLayout(3, 12, 2, group_by_length=group, pad_to_multiple=4)
    for rank in range(2):
        iterator = DocumentMicrobatches(train, layout, rank, consumed_samples=12)
        for consumed in (12, 24):
            counts = microbatch_token_counts(train, consumed, layout, rank)
            batches = read(iterator, 2)
            assert counts == [b["tokens"].numel() for b in batches]
            real = [int(b["loss_mask"].sum()) for b in batches]
            assert all(r <= c for r, c in zip(real, counts, strict=True))


def test_reordered_microbatches_yield_the_permutation():
    order = [2, 0, 3, 1]
    assert list(ReorderedMicrobatches(iter("abcdef"), order)) == ["c", "a", "d", "b"]
    source = iter(range(8))
    wrapped = reorder_data_iterators([source, None], order)
    assert wrapped[1] is None and list(wrapped[0]) == [2, 0, 3, 1]
    assert list(ReorderedMicrobatches(source, [1, 0])) == [5, 4]  # the next iteration
    with pytest.raises(ValueError, match="not a permutation"):
        ReorderedMicrobatches(iter(range(4)), [0, 0, 1, 2])


def test_cost_order_runs_cheap_microbatches_first_and_last(prefix):
    (train, _, _) = datasets(prefix)
    layout = BatchLayout(1, 16, 1)
    counts = microbatch_token_counts(train, 0, layout, 0)
    order = cost_ordered(counts, pp_size=4)
    batches = list(ReorderedMicrobatches(DocumentMicrobatches(train, layout, 0), order))
    run = [b["tokens"].numel() for b in batches]
    assert run == [counts[i] for i in order]
    assert run[0] == min(counts) and run[-1] <= sorted(counts)[1]
    assert run.index(max(run)) < len(run) // 2
    with pytest.raises(ValueError, match="pp_size"):
        cost_ordered(counts, 0)


def test_length_statistics():
    stats = length_statistics([1, 2, 3, 4, 10])
    assert stats["mean"] == 4 and stats["max"] == 10 and stats["p50"] == 3
    assert stats["cv"] == pytest.approx(np.std([1, 2, 3, 4, 10]) / 4)


def _padded_and_alone(rank, directory):
    """A GPT (the project's builder, fp32, no dropout) on one padded microbatch of three
    documents and on each document alone, unpadded: token losses and main_grads."""
    import contextlib
    import dataclasses

    from megatron.trainer.config.arguments import parse_args
    from megatron.trainer.model.models import (
        build_gpt_stage,
        build_model_chunks,
        transformer_config,
    )
    from megatron.trainer.run.initialize import initialize_distributed
    from megatron.trainer.run.optimizer import wrap_model_chunks
    from megatron.trainer.tasks.gpt import gpt_loss
    from tests.trainer_runs import exact_vocab_configs

    rng = np.random.default_rng(3)
    builder = IndexedDatasetBuilder(f"{directory}/gpt.bin", dtype=np.int32)
    for n in (12, 6, 4):  # samples of 11, 5 and 3 tokens
        builder.add_document(rng.integers(0, 96, size=n, dtype=np.int32), [n])
    builder.finalize(f"{directory}/gpt.idx")
    (dataset, _, _) = build_document_datasets(
        DocumentDataConfig([f"{directory}/gpt"], None, "1", 16, 0), (3, 0, 0))
    samples = [dataset[i] for i in range(3)]
    batch = pad_microbatch(samples, pad_to_multiple=8)  # 16 columns, 11..15 all padding
    flags = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
             "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size",
             "3", "--global-batch-size", "3", "--vocab-size", "96", "--mock-data",
             "--tokenizer-type", "NullTokenizer", "--lr", "1e-4", "--train-iters", "1",
             "--hidden-dropout", "0", "--attention-dropout", "0",
             "--distributed-backend", "gloo"]
    results = {}
    with contextlib.ExitStack() as stack:
        base = exact_vocab_configs(parse_args(flags, world_size=1))
        device = initialize_distributed(base, stack)
        for positions in ("learned_absolute", "rope"):
            configs = dataclasses.replace(base, model=dataclasses.replace(
                base.model, position_embedding_type=positions))
            config = transformer_config(configs)
            (model,) = wrap_model_chunks(build_model_chunks(configs, config, build_gpt_stage),
                                         configs, config, device)
            output = model(batch["tokens"], batch["position_ids"], None,
                           labels=batch["labels"])
            loss, tokens, _ = gpt_loss(batch["loss_mask"], output)
            loss.backward()
            padded = ({n: p.main_grad.clone() for n, p in model.named_parameters()},
                      output.detach(), float(loss), int(tokens))
            model.zero_grad_buffer()
            alone = []
            for sample in samples:
                n = len(sample["tokens"])
                out = model(sample["tokens"][None], torch.arange(n)[None], None,
                            labels=sample["labels"][None])
                out.sum().backward()
                alone.append(out.detach()[0])
            results[positions] = (padded, alone,
                                  {n: p.main_grad.clone() for n, p in model.named_parameters()})
    return results


def test_padding_changes_neither_loss_nor_gradients_of_a_gpt(tmp_path):
    from tests.distributed import run_ranks

    (results,) = run_ranks(1, _padded_and_alone, str(tmp_path))
    for positions, ((grads, output, loss, tokens), alone, alone_grads) in results.items():
        assert output.shape == (3, 16) and tokens == 11 + 5 + 3, positions
        for row, token_losses in enumerate(alone):
            torch.testing.assert_close(output[row, :len(token_losses)], token_losses,
                                       msg=positions)
        # padding computes real (garbage) losses: the mask is what removes them
        assert output[:, 11:].min() > 0
        assert loss == pytest.approx(float(sum(t.sum() for t in alone)), rel=1e-6)
        assert grads.keys() == alone_grads.keys()
        for name, grad in alone_grads.items():
            assert grad.abs().sum() > 0, (positions, name)
            # fp32 summation order (other GEMM shapes): within 2e-6 of the tensor's scale
            torch.testing.assert_close(grads[name], grad, rtol=1e-5,
                                       atol=2e-6 * grad.abs().max().item(),
                                       msg=f"{positions} {name}")
