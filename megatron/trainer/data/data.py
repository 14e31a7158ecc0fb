"""Datasets and micro-batch iterators: megatron.core's GPTDataset / BERT masked-LM dataset
built from `--data-path` prefixes (or mock data), read in Megatron's sample order so that
`consumed_samples` alone says where a resumed run continues."""

from __future__ import annotations

import logging
import math
import os
import struct
from dataclasses import dataclass

import numpy as np
import torch
from megatron.core import parallel_state
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.indexed_dataset import DType

from megatron.trainer.data.fim import FimConfig, FimGPTDatasetConfig, fim_dataset_class
from megatron.trainer.data.microbatches import lengths_per_sample, padded_length

log = logging.getLogger(__name__)


class DataError(ValueError):
    """A --data-path prefix whose files are missing, inconsistent or empty."""


def check_data_paths(args) -> None:
    """Before anything else starts: every --data-path prefix has a .bin and a .idx whose
    header and sizes agree and that hold at least one document. One DataError names
    every bad prefix and what is wrong with it."""
    if args.mock_data or not args.data_path:
        return
    problems = []
    for prefix in args.data_blend[0]:
        problem = prefix_problem(prefix)
        if problem is not None:
            problems.append(f"--data-path {prefix}: {problem}")
    if problems:
        raise DataError("; ".join(problems))


# megatron.core's index: magic, version (u64), dtype code (u8), sequence count (u64),
# document-index count (u64), then int32 lengths, int64 byte offsets, int64 document
# indices (sequence numbers, starting at 0), and int8 modes in multimodal datasets
_INDEX_MAGIC = b"MMIDIDX\x00\x00"
_INDEX_HEADER = struct.Struct("<9sQBQQ")
_CHECK_BLOCK = 1 << 20  # entries checked at a time: bounded memory for any index size


def prefix_problem(prefix: str) -> str | None:
    """What is wrong with the dataset at `prefix` (None: nothing)."""
    bin_path, idx_path = prefix + ".bin", prefix + ".idx"
    have_bin, have_idx = os.path.isfile(bin_path), os.path.isfile(idx_path)
    stem, extension = os.path.splitext(prefix)
    if extension in (".bin", ".idx") and not (have_bin and have_idx):
        return f"give the prefix without the {extension} extension: --data-path {stem}"
    if not have_bin or not have_idx:
        missing = [path for path, found in ((bin_path, have_bin), (idx_path, have_idx))
                   if not found]
        return f"{' and '.join(missing)} not found"
    try:
        return _index_problem(idx_path, bin_path)
    except OSError as error:
        return f"cannot read it: {error}"


def _index_problem(idx_path: str, bin_path: str) -> str | None:
    idx_bytes, bin_bytes = os.path.getsize(idx_path), os.path.getsize(bin_path)
    if idx_bytes < _INDEX_HEADER.size:
        return f"{idx_path} has {idx_bytes} bytes, less than an index header"
    with open(idx_path, "rb") as stream:
        magic, version, code, sequences, doc_indices = _INDEX_HEADER.unpack(
            stream.read(_INDEX_HEADER.size))
    if magic != _INDEX_MAGIC or version != 1:
        return f"{idx_path} is not a megatron.core index (bad magic or version)"
    try:
        itemsize = DType.size(code)
    except ValueError:
        return f"{idx_path} names an unknown token dtype (code {code})"
    arrays = _INDEX_HEADER.size + 4 * sequences + 8 * sequences + 8 * doc_indices
    if idx_bytes not in (arrays, arrays + sequences):
        return (f"{idx_path} has {idx_bytes} bytes, but its header ({sequences} sequences, "
                f"{doc_indices - 1} documents) needs {arrays}: the index is truncated or "
                "corrupted")
    if doc_indices < 2 or sequences == 0:
        return f"no documents in {idx_path} (an empty dataset)"
    index = np.memmap(idx_path, mode="r", dtype=np.uint8)
    lengths = np.frombuffer(index, np.int32, sequences, _INDEX_HEADER.size)
    offsets = np.frombuffer(index, np.int64, sequences, _INDEX_HEADER.size + 4 * sequences)
    documents = np.frombuffer(index, np.int64, doc_indices,
                              _INDEX_HEADER.size + 12 * sequences)
    if documents[0] != 0 or documents[-1] != sequences or np.any(np.diff(documents) < 0):
        return f"{idx_path} has a corrupted document index"
    expected_offset = 0
    for start in range(0, sequences, _CHECK_BLOCK):
        block_lengths = lengths[start:start + _CHECK_BLOCK].astype(np.int64)
        block_offsets = offsets[start:start + _CHECK_BLOCK]
        if np.any(block_lengths < 0):
            return f"{idx_path} has negative sequence lengths (corrupted)"
        ends = expected_offset + np.cumsum(block_lengths * itemsize)
        starts = np.concatenate(([expected_offset], ends[:-1]))
        if not np.array_equal(block_offsets, starts):
            return f"{idx_path} has corrupted sequence offsets"
        expected_offset = int(ends[-1])
    if expected_offset != bin_bytes:
        cause = "truncated" if bin_bytes < expected_offset else "not the data of this index"
        return (f"{bin_path} has {bin_bytes} bytes, but {idx_path} describes "
                f"{expected_offset}: the .bin is {cause}")
    if expected_offset == 0:
        return f"no tokens in {bin_path} (an empty dataset)"
    return None


def index_arrays(prefix: str) -> tuple[np.ndarray, np.ndarray]:
    """(token count of each sequence, document index) of a prefix that passed
    prefix_problem, read from its .idx without opening the .bin."""
    index = np.memmap(prefix + ".idx", mode="r", dtype=np.uint8)
    _, _, _, sequences, doc_indices = _INDEX_HEADER.unpack(bytes(index[:_INDEX_HEADER.size]))
    lengths = np.frombuffer(index, np.int32, sequences, _INDEX_HEADER.size)
    documents = np.frombuffer(index, np.int64, doc_indices, _INDEX_HEADER.size + 12 * sequences)
    return lengths, documents


@dataclass
class SplitSizes:
    train: int
    valid: int
    test: int


def split_sizes(args) -> SplitSizes:
    evals = (args.train_iters // max(1, args.eval_interval) + 1) * args.eval_iters
    eval_batch = args.eval_global_batch_size or args.global_batch_size
    return SplitSizes(
        train=args.train_iters * args.global_batch_size,
        valid=evals * eval_batch,
        test=args.eval_iters * eval_batch,
    )


def _dataset_config_kwargs(args, tokenizer) -> dict:
    """The fields of megatron-core's dataset configs that GPT and BERT set alike."""
    return dict(random_seed=args.seed, sequence_length=args.seq_length,
                blend=None if args.mock_data else args.data_blend, split=args.split,
                path_to_cache=args.data_cache_path, tokenizer=tokenizer,
                mmap_bin_files=args.mmap_bin_files)


def build_gpt_datasets(args, tokenizer):
    if args.variable_seq_lengths:
        return build_gpt_document_datasets(args, tokenizer)
    if lengths_per_sample(args):  # --seq-length-cv under --microbatch-tokens
        return tuple(None if split is None else DrawnLengthSamples(
            split, args.seq_length, args.seq_length_cv, args.seed)
            for split in _build_gpt_datasets(args, tokenizer))
    return _build_gpt_datasets(args, tokenizer)


def _build_gpt_datasets(args, tokenizer):
    fim = FimConfig.from_args(args)  # --fim-data: fill-in-the-middle samples (fim.py)
    config_class = GPTDatasetConfig if fim is None else FimGPTDatasetConfig
    config = config_class(
        **_dataset_config_kwargs(args, tokenizer),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        # a causal mask is implicit in attention: a mask is only made where it holds the
        # document boundaries
        create_attention_mask=args.reset_attention_mask and args.create_attention_mask_in_dataloader,
        **({} if fim is None else {"fim": fim}),
    )
    dataset_class = MockGPTDataset if args.mock_data else GPTDataset
    if fim is not None:
        dataset_class = fim_dataset_class(args.mock_data)
    return _build(dataset_class, config, split_sizes(args))


def build_gpt_document_datasets(args, tokenizer):
    """--variable-seq-lengths: one document per sample (megatron/trainer/data/documents.py)."""
    from megatron.trainer.data.documents import DocumentDataConfig, build_document_datasets

    prefixes, weights = args.data_blend
    config = DocumentDataConfig(prefixes, weights, args.split, args.seq_length, args.seed,
                                eod_token=tokenizer.eod if args.eod_mask_loss else None)
    sizes = split_sizes(args)
    return build_document_datasets(config, (sizes.train, sizes.valid, sizes.test))


def build_bert_datasets(args, tokenizer):
    from megatron.core.datasets.bert_dataset import (
        BERTMaskedWordPieceDataset,
        BERTMaskedWordPieceDatasetConfig,
    )

    if args.mock_data:
        sizes = split_sizes(args)
        return tuple(
            MockBertDataset(n, args.seq_length, tokenizer.vocab_size, args.seed + i)
            for i, n in enumerate((sizes.train, sizes.valid, sizes.test))
        )
    config = BERTMaskedWordPieceDatasetConfig(
        **_dataset_config_kwargs(args, tokenizer),
        masking_probability=args.mask_prob,
        short_sequence_probability=args.short_seq_prob,
        masking_max_ngram=3,
        masking_do_full_word=True,
        masking_do_permutation=False,
        masking_use_longer_ngrams=False,
        masking_use_geometric_distribution=False,
        classification_head=not args.bert_no_binary_head,
    )
    return _build(BERTMaskedWordPieceDataset, config, split_sizes(args))


def _build(dataset_class, config, sizes: SplitSizes):
    builder = BlendedMegatronDatasetBuilder(
        dataset_class, [sizes.train, sizes.valid, sizes.test], lambda: True, config
    )
    return tuple(builder.build())


class MockBertDataset(torch.utils.data.Dataset):
    """Random masked-LM samples for `--mock-data` BERT runs (no tokenizer files needed)."""

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int):
        self.num_samples, self.seq_length = num_samples, seq_length
        self.vocab_size, self.seed = vocab_size, seed

    def __len__(self):
        return self.num_samples

    def __getitem__(self, index):
        rng = np.random.default_rng([self.seed, index])
        length = int(rng.integers(self.seq_length // 2, self.seq_length + 1))
        text = np.zeros(self.seq_length, dtype=np.int64)
        text[:length] = rng.integers(5, self.vocab_size, size=length)
        loss_mask = np.zeros(self.seq_length, dtype=np.int64)
        loss_mask[:length] = rng.random(length) < 0.15
        labels = np.where(loss_mask == 1, text, -1)
        padding_mask = (np.arange(self.seq_length) < length).astype(np.int64)
        types = np.zeros(self.seq_length, dtype=np.int64)
        types[length // 2 : length] = 1
        return {
            "text": text, "types": types, "labels": labels,
            "is_random": int(rng.integers(0, 2)), "padding_mask": padding_mask,
            "loss_mask": loss_mask, "truncated": 0,
        }


_TOKEN_KEYS = ("tokens", "labels", "text")  # GPT's and BERT's token-id fields


class MicroBatchIterator:
    """Yields this data-parallel rank's micro-batches in Megatron's order, starting at
    `consumed_samples`: global micro-batch k holds samples [k*m*d, (k+1)*m*d) and data-parallel
    rank r takes its slice [r*m, (r+1)*m) (m = micro-batch size, d = data-parallel size)."""

    def __init__(self, dataset, micro_batch_size: int, consumed_samples: int = 0,
                 dp_rank: int | None = None, dp_size: int | None = None,
                 seq_length_cv: float = 0.0, seed: int = 0, num_workers: int = 0,
                 pad_to_multiple: int = 1, vocab_size: int | None = None):
        self.dataset = dataset
        self.vocab_size = vocab_size  # token ids must be below it (None: not checked)
        self.seq_length_cv, self.seed = seq_length_cv, seed
        self.pad_to_multiple = pad_to_multiple
        self.micro_batch_size = micro_batch_size
        self.dp_rank = parallel_state.get_data_parallel_rank() if dp_rank is None else dp_rank
        self.dp_size = parallel_state.get_data_parallel_world_size() if dp_size is None else dp_size
        self.stride = micro_batch_size * self.dp_size
        self.next_start = consumed_samples
        self._loader = None
        if num_workers > 0:
            # --num-workers: worker processes read and collate the same index lists ahead
            indices = _IndexLists(self.next_start, self.stride, self.indices)
            self._loader = iter(torch.utils.data.DataLoader(
                dataset, batch_sampler=indices, num_workers=num_workers,
                collate_fn=torch.utils.data.default_collate))

    def indices(self, global_start: int) -> list[int]:
        """This rank's sample indices of the global micro-batch starting at `global_start`."""
        start = global_start + self.dp_rank * self.micro_batch_size
        return [(start + i) % len(self.dataset) for i in range(self.micro_batch_size)]

    def __iter__(self):
        return self

    def __next__(self):
        global_index = self.next_start
        self.next_start += self.stride
        if self._loader is not None:
            return self._checked(next(self._loader), global_index)
        batch = torch.utils.data.default_collate(
            [self.dataset[i] for i in self.indices(global_index)])
        if self.seq_length_cv > 0:
            batch = _truncate(batch, self.seq_length_cv, self.seed, global_index,
                              self.pad_to_multiple)
        return self._checked(batch, global_index)

    def _checked(self, batch, global_index: int):
        """The batch, once its token ids are known to index the embedding: an id beyond it
        (data tokenized with a larger vocabulary) would fail in the lookup without a word
        on the data (or, on a GPU, as a device-side assert)."""
        if self.vocab_size is None or not isinstance(batch, dict):
            return batch
        for key in _TOKEN_KEYS:
            ids = batch.get(key)
            if isinstance(ids, torch.Tensor) and ids.numel() and int(ids.max()) >= self.vocab_size:
                raise DataError(
                    f"the micro-batch at sample {global_index} holds token id {int(ids.max())} "
                    f"({key}), beyond the model's vocabulary of {self.vocab_size} (--vocab-size "
                    "or the tokenizer's, padded): the data was tokenized with a larger "
                    "vocabulary")
        return batch


class _IndexLists:
    """The endless sequence of a MicroBatchIterator's index lists, as a batch sampler."""

    def __init__(self, first: int, stride: int, indices):
        self.first, self.stride, self.indices = first, stride, indices

    def __iter__(self):
        start = self.first
        while True:
            yield self.indices(start)
            start += self.stride


def _truncate(batch: dict, cv: float, seed: int, global_index: int,
              pad_to_multiple: int = 1) -> dict:
    """Cut every per-token field to this micro-batch's drawn length rounded up to
    `pad_to_multiple` (its shape bucket); the positions past the drawn length are padding,
    out of the loss (loss_mask) and, for BERT, out of attention (padding_mask). GPT's causal
    attention keeps them from the real tokens, which come first."""
    full = max(v.shape[1] for v in batch.values() if torch.is_tensor(v) and v.dim() >= 2)
    length = variable_length(full, cv, seed, global_index)
    padded = padded_length(length, pad_to_multiple, full)
    cut = {
        key: value[:, :padded].contiguous()
        if torch.is_tensor(value) and value.dim() >= 2 and value.shape[1] == full else value
        for key, value in batch.items()
    }
    for key in ("loss_mask", "padding_mask"):
        if padded > length and key in cut:
            cut[key] = cut[key].clone()
            cut[key][:, length:] = 0
    return cut


def variable_length(seq_length: int, cv: float, seed: int, sample_index: int) -> int:
    """Token count of one micro-batch under `--seq-length-cv`: lognormal with the given CV,
    mean half of --seq-length (so long draws still fit), multiple of 16, in [16, seq_length].
    Every rank draws the same value for the same micro-batch."""
    if cv <= 0:
        return seq_length
    sigma = math.sqrt(math.log1p(cv * cv))
    mu = math.log(seq_length / 2) - sigma * sigma / 2
    draw = np.random.default_rng([seed, sample_index]).lognormal(mu, sigma)
    return int(min(seq_length, max(16, round(draw / 16) * 16)))


class DrawnLengthSamples(torch.utils.data.Dataset):
    """--seq-length-cv under --microbatch-tokens: every GPT sample cut to a length of its own,
    drawn as `variable_length` draws a microbatch's (indexed by the sample), so that the
    token budget forms microbatches from the lengths as it does from documents
    (microbatches.plan_global_batch). A sample is {"tokens", "labels", "loss_mask"} of its
    drawn length; position ids and padding come with its microbatch (pad_microbatch)."""

    def __init__(self, samples, seq_length: int, cv: float, seed: int):
        self.samples, self.seq_length, self.cv, self.seed = samples, seq_length, cv, seed

    def __len__(self) -> int:
        return len(self.samples)

    def sample_lengths(self, indices) -> np.ndarray:
        return np.array([variable_length(self.seq_length, self.cv, self.seed, int(index))
                         for index in np.asarray(indices).reshape(-1)], dtype=np.int64)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        # Megatron's order wraps past the end (MicroBatchIterator); the draw keeps the index
        sample = self.samples[index % len(self.samples)]
        length = variable_length(self.seq_length, self.cv, self.seed, index)
        return {key: torch.as_tensor(sample[key])[:length].clone()
                for key in ("tokens", "labels", "loss_mask")}


def microbatch_lengths(consumed_samples: int, global_batch: int, rows: int, seq_length: int,
                       seq_length_cv: float, seed: int) -> list[int]:
    """Real (drawn) sequence length of each global micro-batch (`rows` samples: micro-batch
    size x data-parallel size) of the batch starting at `consumed_samples` (all equal to
    --seq-length unless --seq-length-cv is set); the micro-batch is padded to
    padded_length(length, --pad-to-multiple, --seq-length)."""
    return [
        variable_length(seq_length, seq_length_cv, seed, consumed_samples + k)
        for k in range(0, global_batch, rows)
    ]


def batch_to_device(batch: dict, device) -> dict:
    """The batch's tensors on `device`. On a GPU they go through pinned memory: a copy from
    pageable memory makes the host wait for all the work queued on the stream first (CUDA's
    rule for pageable host-to-device copies), so the host could never run ahead of the GPU
    on the stages that read the batch, and each of their forwards would start on an idle
    GPU. The pinned buffers come from torch's caching host allocator, which keeps each one
    until its copy is done."""
    tensors = {key: value for key, value in batch.items() if torch.is_tensor(value)}
    if torch.device(device).type != "cuda":
        return {key: value.to(device) for key, value in tensors.items()}
    return {key: value.pin_memory().to(device, non_blocking=True)
            for key, value in tensors.items()}
