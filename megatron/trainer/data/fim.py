"""Fill-in-the-middle (FIM) samples, Megatron-LM's `--fim-data` (Bavarian et al. 2022,
"Efficient Training of Language Models to Fill in the Middle").

Each sample of megatron.core's GPT dataset (real or mock) is cut at its end-of-document tokens;
with probability `rate` a piece's text is split at two random character positions into
prefix, middle and suffix, each re-tokenized, and laid out

    PSM: <fim_prefix> prefix <fim_suffix> suffix <fim_middle> middle
    SPM: <fim_prefix> <fim_suffix> suffix <fim_middle> prefix middle   (probability spm_rate)

The sample keeps its length: cut at the end, or filled with <fim_pad>, which is out of the
loss. Draws are keyed by (seed, split, sample index), so a sample is the same whichever
rank, worker or resumed run reads it. Megatron-LM draws from one generator per dataset in
reading order instead, drops the end-of-document token after an empty piece, lays out an
empty last piece as three sentinels and trains on <fim_pad>; here none of that happens.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset


@dataclass(frozen=True)
class FimConfig:
    """The --fim-* flags (after validation)."""

    rate: float
    spm_rate: float
    prefix_token: str = "<fim_prefix>"
    middle_token: str = "<fim_middle>"
    suffix_token: str = "<fim_suffix>"
    pad_token: str = "<fim_pad>"
    eod_token: str | None = None  # None: the tokenizer's end-of-document token
    split_sample: str | None = None  # a token whose fragments are FIM'd one by one
    fragment_rate: float | None = None  # FIM probability of each such fragment
    no_prefix: str | None = None  # pieces whose text starts with it stay as they are

    @classmethod
    def from_args(cls, args) -> FimConfig | None:
        if not args.fim_data:
            return None
        return cls(args.fim_rate, args.fim_spm_rate, args.fim_prefix_token,
                   args.fim_middle_token, args.fim_suffix_token, args.fim_pad_token,
                   args.fim_eod_token, args.fim_split_sample, args.fim_fragment_rate,
                   args.fim_no_prefix)

    @property
    def sentinels(self) -> tuple[str, str, str, str]:
        return (self.prefix_token, self.middle_token, self.suffix_token, self.pad_token)


class FimError(ValueError):
    """A FIM token the tokenizer does not have."""


class FimTransform:
    """Rearranges the token ids of one sample; `tokenizer` holds the sentinels (added at
    start-up for GPT-2 BPE and HF tokenizers, configs.TokenizerConfig)."""

    def __init__(self, config: FimConfig, tokenizer):
        self.config = config
        self.tokenizer = tokenizer
        vocab = tokenizer.vocab
        missing = [token for token in config.sentinels if token not in vocab]
        if missing:
            raise FimError(f"--fim-data: the tokenizer ({tokenizer.tokenizer_type}) has no "
                           f"{', '.join(missing)} token (--fim-*-token names them)")
        self.prefix, self.middle, self.suffix, self.pad = (vocab[t] for t in config.sentinels)
        self.eod = (tokenizer.eod if config.eod_token is None
                    else self._token_id(config.eod_token, "--fim-eod-token"))
        self.split = (None if config.split_sample is None
                      else self._token_id(config.split_sample, "--fim-split-sample"))

    def _token_id(self, token: str, flag: str) -> int:
        if token not in self.tokenizer.vocab:
            raise FimError(f"{flag} {token!r} is not one token of the tokenizer "
                           f"({self.tokenizer.tokenizer_type})")
        return self.tokenizer.vocab[token]

    def document_lengths(self, tokens: np.ndarray) -> list[int]:
        """Token counts of the documents of a FIM sample, each up to its end-of-document."""
        ends = [0, *(np.flatnonzero(tokens == self.eod) + 1).tolist(), len(tokens)]
        return [int(b - a) for a, b in itertools.pairwise(ends) if b > a]

    def __call__(self, tokens: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """`tokens` rearranged piece by piece between end-of-document tokens, cut or padded
        to its length."""
        parts = []
        for index, piece in enumerate(_split_at(tokens, self.eod)):
            if index:
                parts.append([self.eod])
            parts.append(self._piece(piece, rng))
        out = np.concatenate(parts).astype(np.int64)[: len(tokens)]
        return np.concatenate([out, np.full(len(tokens) - len(out), self.pad, np.int64)])

    def _piece(self, piece: np.ndarray, rng) -> np.ndarray:
        if len(piece) == 0:
            return piece
        if self.split is None or not np.any(piece == self.split):
            return self._permute(piece, self.config.rate, rng)
        # a piece of several fragments (e.g. the files of one repository): FIM or not as a
        # whole, then each fragment on its own
        if rng.random() >= self.config.rate:
            return piece
        parts = []
        for index, fragment in enumerate(_split_at(piece, self.split)):
            if index:
                parts.append([self.split])
            parts.append(self._permute(fragment, self.config.fragment_rate, rng)
                         if len(fragment) else fragment)
        return np.concatenate(parts)

    def _permute(self, piece: np.ndarray, rate: float, rng) -> np.ndarray:
        if rng.random() >= rate:
            return piece
        text = self.tokenizer.detokenize(piece)
        if self.config.no_prefix is not None and text.startswith(self.config.no_prefix):
            return piece
        # character positions: the model also learns middles that begin or end inside a token
        start, end = sorted(rng.integers(0, len(text) + 1, size=2))
        prefix, middle, suffix = self.tokenizer.tokenize_batch(
            [text[:start], text[start:end], text[end:]])
        if rng.random() < self.config.spm_rate:
            order = [self.prefix, self.suffix, *suffix, self.middle, *prefix, *middle]
        else:
            order = [self.prefix, *prefix, self.suffix, *suffix, self.middle, *middle]
        return np.asarray(order, dtype=np.int64)


def _split_at(tokens: np.ndarray, separator: int) -> list[np.ndarray]:
    """The pieces between the separators: one more than there are separators, some maybe
    empty."""
    cuts = np.flatnonzero(tokens == separator)
    starts = np.concatenate([[0], cuts + 1])
    ends = np.concatenate([cuts, [len(tokens)]])
    return [tokens[start:end] for start, end in zip(starts, ends, strict=True)]


@dataclass
class FimGPTDatasetConfig(GPTDatasetConfig):
    """megatron.core's GPT dataset configuration with the FIM settings."""

    fim: FimConfig | None = None


class _FimSamples:
    """Mixed into megatron.core's GPTDataset / MockGPTDataset: FIM on each sample's tokens
    before megatron.core makes tokens, labels and masks of them."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fim = FimTransform(self.config.fim, self.config.tokenizer)

    def _query_document_sample_shuffle_indices(self, idx):
        text, documents, *lengths = super()._query_document_sample_shuffle_indices(idx)
        # megatron.core fills a short last sample with its own padding id: FIM the rest
        kept = np.flatnonzero(text != self._pad_token_id)
        length = int(kept[-1]) + 1 if len(kept) else 0
        rng = np.random.default_rng((self.config.random_seed, self.index_split.value, int(idx)))
        arranged = self.fim(text[:length], rng)
        if lengths:  # megatron-core >= 0.19 also returns the documents' token counts
            lengths = [self.fim.document_lengths(arranged)]
        return (np.concatenate([arranged, text[length:]]), documents, *lengths)

    def __getitem__(self, idx):
        sample = super().__getitem__(idx)
        # <fim_pad> fills a sample that re-tokenizing shortened: it is not text to learn.
        # Out of place: megatron.core may hand out its cached mask itself
        sample["loss_mask"] = sample["loss_mask"].masked_fill(
            sample["labels"] == self.fim.pad, 0.0)
        return sample


class FimGPTDataset(_FimSamples, GPTDataset):
    """GPTDataset (--data-path) with FIM samples."""


class FimMockGPTDataset(_FimSamples, MockGPTDataset):
    """MockGPTDataset (--mock-data) with FIM samples; its token ids are not text, so the
    pieces come back re-tokenized from their decoded (lossy) text."""


def fim_dataset_class(mock: bool):
    return FimMockGPTDataset if mock else FimGPTDataset
