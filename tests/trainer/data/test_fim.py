"""--fim-data (megatron/trainer/data/fim.py): fill-in-the-middle samples of megatron.core's GPT
dataset, checked against the plain samples of the same dataset and seed."""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

from megatron.trainer.config.arguments import ArgumentError, parse_args
from megatron.trainer.config.configs import TokenizerConfig
from megatron.trainer.data.data import build_gpt_datasets
from megatron.trainer.data.fim import FimConfig, FimError, FimTransform
from megatron.trainer.data.tokenizer import TokenizerFileError, _byte_to_char, build_tokenizer
from tests import REPO as ROOT
from tests.distributed import run_ranks
from tests.trainer_runs import train_runs, with_flags

GPT_FILES = ["--vocab-file", str(ROOT / "datasets_gpt/vocab.json"),
             "--merge-file", str(ROOT / "datasets_gpt/merges.txt")]
SENTINELS = ("<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>")
SEQ = 48
BASE = ["--num-layers", "1", "--hidden-size", "8", "--num-attention-heads", "1",
        "--seq-length", str(SEQ), "--lr", "1e-3", "--train-iters", "8", "--global-batch-size",
        "8", "--eval-iters", "0", "--split", "1,0,0"]


@pytest.fixture(scope="module")
def byte_files(tmp_path_factory):
    """A GPT-2 BPE vocabulary of the 256 bytes and <|endoftext|>, no merges: one token per
    character of ASCII text, so a character split is a token split."""
    directory = tmp_path_factory.mktemp("bytes")
    vocab = {char: byte for byte, char in _byte_to_char().items()}
    vocab["<|endoftext|>"] = 256
    (directory / "vocab.json").write_text(json.dumps(vocab))
    (directory / "merges.txt").write_text("#version: 0.2\n")
    return ["--vocab-file", str(directory / "vocab.json"),
            "--merge-file", str(directory / "merges.txt")]


def _documents(count: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefgh ijklmnop qrstuvwxyz"))
    return ["".join(rng.choice(letters, int(rng.integers(3, 40)))) for _ in range(count)]


def _write(prefix: Path, documents: list[list[int]], eod: int) -> str:
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.int32)
    for document in documents:
        builder.add_document(np.array([*document, eod]), [len(document) + 1])
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


@pytest.fixture(scope="module")
def text_data(tmp_path_factory, byte_files):
    """ASCII documents as byte tokens (`--data-path`)."""
    directory = tmp_path_factory.mktemp("data")
    tokenizer = build_tokenizer("GPT2BPETokenizer", vocab_file=byte_files[1],
                                merge_file=byte_files[3])
    documents = tokenizer.tokenize_batch(_documents(60))
    return _write(directory / "text", documents, tokenizer.eod), directory


def _train_set(data, files, *flags):
    prefix, directory = data
    args = parse_args([*BASE, *files, "--data-path", prefix, "--data-cache-path",
                       str(directory / "cache"), *flags], world_size=1)
    tokenizer = TokenizerConfig.from_args(args).build()
    return build_gpt_datasets(args, tokenizer)[0], tokenizer


def _text(sample) -> list[int]:
    """The sample's SEQ + 1 token ids (tokens, then the last label)."""
    return [*sample["tokens"].tolist(), int(sample["labels"][-1])]


def _pieces(tokens: list[int], eod: int) -> list[list[int]]:
    pieces = [[]]
    for token in tokens:
        if token == eod:
            pieces.append([])
        else:
            pieces[-1].append(token)
    return pieces


def _unarrange(piece: list[int], prefix_id, middle_id, suffix_id) -> list[int]:
    """The text of a FIM piece in reading order: PSM is P a S c M b -> a b c; SPM is
    P S c M a b, which reads the same as PSM with an empty prefix."""
    assert piece[0] == prefix_id and piece.count(suffix_id) == 1, piece
    suffix_at, middle_at = piece.index(suffix_id), piece.index(middle_id)
    assert suffix_at < middle_at, piece
    return piece[1:suffix_at] + piece[middle_at + 1:] + piece[suffix_at + 1:middle_at]


def test_fim_rate_zero_gives_the_plain_samples(text_data, byte_files):
    plain, _ = _train_set(text_data, byte_files)
    fim, _ = _train_set(text_data, byte_files, "--fim-data", "--fim-rate", "0")
    assert type(fim).__name__ == "FimGPTDataset"
    for index in range(len(plain)):
        a, b = plain[index], fim[index]
        assert a.keys() == b.keys()
        assert all(torch.equal(a[key], b[key]) for key in a), index


@pytest.mark.parametrize("spm_rate", [0.0, 0.5, 1.0])
def test_fim_rate_one_rearranges_every_piece_of_the_plain_sample(text_data, byte_files,
                                                                 spm_rate):
    plain, _ = _train_set(text_data, byte_files)
    fim, tokenizer = _train_set(text_data, byte_files, "--fim-data", "--fim-rate", "1",
                                "--fim-spm-rate", str(spm_rate))
    prefix_id, middle_id, suffix_id, _ = (tokenizer.vocab[t] for t in SENTINELS)
    sentinels = Counter({prefix_id: 1, middle_id: 1, suffix_id: 1})
    suffix_first = arranged = 0
    for index in range(len(plain)):
        original = _pieces(_text(plain[index]), tokenizer.eod)
        text = _text(fim[index])
        assert len(text) == SEQ + 1
        pieces = _pieces(text, tokenizer.eod)
        # three sentinels per piece: the last pieces are cut off at the sample's length
        assert 1 <= len(pieces) <= len(original)
        for number, (piece, before) in enumerate(zip(pieces, original, strict=False)):
            if not before:
                assert not piece  # an empty piece (a sample starting at a document) stays
                continue
            if number < len(pieces) - 1:
                assert Counter(piece) == Counter(before) + sentinels
                assert _unarrange(piece, prefix_id, middle_id, suffix_id) == before
                arranged += 1
                suffix_first += piece[1] == suffix_id
            elif piece:  # empty where the cut falls right after an end-of-document token
                assert piece[0] == prefix_id and Counter(piece) <= Counter(before) + sentinels
    assert arranged > 50
    if spm_rate == 1.0:
        assert suffix_first == arranged
    else:
        # PSM with an empty prefix also starts P S: one start in len(text) + 1
        share = suffix_first / arranged
        assert (share < 0.2) if spm_rate == 0.0 else (0.3 < share < 0.8), share


def test_fim_samples_are_the_same_whoever_reads_them_in_any_order(text_data, byte_files):
    flags = ("--fim-data", "--fim-rate", "1")
    first, _ = _train_set(text_data, byte_files, *flags)
    second, _ = _train_set(text_data, byte_files, *flags)
    indices = list(range(len(first)))
    forward = [_text(first[i]) for i in indices]
    backward = [_text(second[i]) for i in reversed(indices)][::-1]
    assert forward == backward


def test_mock_data_gets_fim_samples_of_its_decoded_tokens(tmp_path):
    args = parse_args([*BASE, *GPT_FILES, "--mock-data", "--fim-data", "--fim-rate", "1",
                       "--fim-spm-rate", "0", "--data-cache-path", str(tmp_path)], world_size=1)
    tokenizer = TokenizerConfig.from_args(args).build()
    mock = build_gpt_datasets(args, tokenizer)[0]
    assert type(mock).__name__ == "FimMockGPTDataset"
    for index in range(4):
        text = _text(mock[index])
        assert len(text) == SEQ + 1 and text[0] == tokenizer.vocab["<fim_prefix>"]
        assert tokenizer.vocab["<fim_suffix>"] in text


def test_pieces_split_at_character_positions_keep_the_text(tmp_path):
    """A real BPE: each piece's three parts, re-tokenized, still spell the document."""
    config = FimConfig(rate=1.0, spm_rate=0.5)
    tokenizer = TokenizerConfig("GPT2BPETokenizer", GPT_FILES[1], GPT_FILES[3],
                                special_tokens=config.sentinels).build()
    fim = FimTransform(config, tokenizer)
    documents = ["The quick brown fox jumps over the lazy dog.", "Fill in the middle, please!",
                 "Ünïcödé tëxt – with dashes and ‘quotes’."]
    tokens = np.concatenate([[*ids, tokenizer.eod] for ids in tokenizer.tokenize_batch(documents)])
    for seed in range(20):
        out = fim(np.concatenate([tokens, np.full(60, tokenizer.eod)]),
                  np.random.default_rng(seed))
        pieces = _pieces(out.tolist(), tokenizer.eod)[:len(documents)]
        for piece, document in zip(pieces, documents, strict=True):
            prefix, middle, suffix = _parts(piece, fim)
            assert "".join(tokenizer.detokenize(p) for p in (prefix, middle, suffix)) == document


def _parts(piece, fim):
    suffix_at, middle_at = piece.index(fim.suffix), piece.index(fim.middle)
    if piece[1] == fim.suffix:  # SPM, or PSM with an empty prefix: the same text
        return [], piece[middle_at + 1:], piece[2:middle_at]
    return piece[1:suffix_at], piece[middle_at + 1:], piece[suffix_at + 1:middle_at]


def test_fim_pad_fills_shortened_samples_out_of_the_loss(tmp_path):
    """Documents stored as single bytes re-tokenize into fewer GPT-2 tokens: the sample is
    filled with <fim_pad>, which the loss skips."""
    tokenizer = build_tokenizer("GPT2BPETokenizer", vocab_file=GPT_FILES[1],
                                merge_file=GPT_FILES[3])
    byte_id = {byte: tokenizer.vocab[char] for byte, char in _byte_to_char().items()}
    documents = [[byte_id[b] for b in text.encode()] for text in _documents(40, seed=1)]
    data = (_write(tmp_path / "bytes", documents, tokenizer.eod), tmp_path)
    fim, tokenizer = _train_set(data, GPT_FILES, "--fim-data", "--fim-rate", "1")
    pad = tokenizer.vocab["<fim_pad>"]
    padded = 0
    for index in range(len(fim)):
        sample = fim[index]
        at_pad = sample["labels"] == pad
        assert torch.all(sample["loss_mask"][at_pad] == 0)
        assert torch.all(sample["loss_mask"][~at_pad] == 1)
        if at_pad.any():
            first = int(at_pad.nonzero()[0])
            assert torch.all(at_pad[first:]), "padding is at the end only"
            padded += 1
    assert padded > len(fim) // 2


def test_split_sample_fragments_and_no_prefix(byte_files):
    config = FimConfig(rate=1.0, spm_rate=0.0, split_sample="<|endoftext|>",
                       fragment_rate=1.0, eod_token="~")
    tokenizer = TokenizerConfig("GPT2BPETokenizer", byte_files[1], byte_files[3],
                                special_tokens=config.sentinels).build()
    sep, eod = tokenizer.vocab["<|endoftext|>"], tokenizer.vocab["~"]
    fim = FimTransform(config, tokenizer)
    a, b, c = tokenizer.tokenize_batch(["first file", "second file", "#! left alone"])
    piece = np.array([*a, sep, *b, eod, *c, *[eod] * 12])
    out = fim(piece, np.random.default_rng(0)).tolist()
    first, second = _pieces(out, eod)[:2]
    fragments = _pieces(first, sep)
    assert len(fragments) == 2
    for fragment, before in zip(fragments, (a, b), strict=True):
        assert _unarrange(fragment, fim.prefix, fim.middle, fim.suffix) == before
    assert fim.prefix in second
    # megatron-core >= 0.19 takes the documents' lengths of a sample with it
    assert fim.document_lengths(np.array([*out[:5], eod, *a, eod])) == [6, len(a) + 1]
    kept = FimTransform(FimConfig(1.0, 0.0, eod_token="~", no_prefix="#!"), tokenizer)
    two = np.array([*a, eod, *c, *[eod] * 12])
    assert _pieces(kept(two, np.random.default_rng(0)).tolist(), eod)[1] == c
    unfragmented = FimTransform(
        FimConfig(1.0, 0.0, split_sample="<|endoftext|>", fragment_rate=0.0, eod_token="~"),
        tokenizer)
    assert _pieces(unfragmented(piece, np.random.default_rng(0)).tolist(), eod)[0] == [
        *a, sep, *b]


def test_missing_tokens_are_named():
    plain = build_tokenizer("GPT2BPETokenizer", vocab_file=GPT_FILES[1], merge_file=GPT_FILES[3])
    with pytest.raises(FimError, match="no <fim_prefix>, <fim_middle>, <fim_suffix>, <fim_pad>"):
        FimTransform(FimConfig(1.0, 0.5), plain)
    added = TokenizerConfig("GPT2BPETokenizer", GPT_FILES[1], GPT_FILES[3],
                            special_tokens=SENTINELS).build()
    assert [added.vocab[t] for t in SENTINELS] == [50257, 50258, 50259, 50260]
    assert added.vocab_size == 50261 and added.detokenize([50257, 464]) == "<fim_prefix>The"
    with pytest.raises(FimError, match="--fim-split-sample '<file_sep>' is not one token"):
        FimTransform(FimConfig(1.0, 0.5, split_sample="<file_sep>", fragment_rate=0.5), added)
    with pytest.raises(TokenizerFileError, match="NullTokenizer has no <fim_prefix>, <fim_pad>"):
        build_tokenizer("NullTokenizer", vocab_size=64).add_special_tokens(
            ["<fim_prefix>", "<fim_pad>"])


@pytest.mark.parametrize("flags, model, message", [
    (["--fim-rate", "0.3"], "gpt", "--fim-rate needs --fim-data"),
    (["--fim-spm-rate", "1", "--fim-no-prefix", "#"], "gpt",
     "--fim-spm-rate --fim-no-prefix need --fim-data"),
    (["--fim-data", "--fim-rate", "1.5"], "gpt", "--fim-rate 1.5 must be in [0, 1]"),
    (["--fim-data", "--fim-split-sample", "<f>"], "gpt", "--fim-fragment-rate go together"),
    (["--fim-data", "--fim-pad-token", "<fim_middle>"], "gpt", "four different tokens"),
    (["--fim-data"], "bert", "BERT's masked-LM samples have no FIM form"),
])
def test_refused_flags_are_named(flags, model, message):
    with pytest.raises(ArgumentError, match=re.escape(message)):
        parse_args([*BASE, "--mock-data", *GPT_FILES, *flags], world_size=1, model=model)


def test_mock_data_without_tokenizer_files_names_the_tokens():
    with pytest.raises(ArgumentError, match="needs a tokenizer with the tokens <fim_prefix> "
                       "<fim_middle> <fim_suffix> <fim_pad>: NullTokenizer"):
        parse_args([*BASE, "--mock-data", "--vocab-size", "64", "--fim-data"], world_size=1)


def test_gpt_trains_on_fim_mock_data():
    plain = with_flags(BASE, num_layers=2, hidden_size=16, num_attention_heads=2, seq_length=32,
                       micro_batch_size=2, global_batch_size=4, train_iters=3, log_interval=1,
                       hidden_dropout=0, attention_dropout=0, mock_data=True, split=None)
    plain += GPT_FILES
    fim = with_flags(plain, fim_data=True, fim_rate=1)
    (runs,) = run_ranks(1, train_runs, [plain, fim], 1)
    plain_losses = [loss["lm loss"] for loss in runs[0]["losses"]]
    fim_losses = [loss["lm loss"] for loss in runs[1]["losses"]]
    assert len(fim_losses) == 3 and all(math.isfinite(loss) for loss in fim_losses)
    assert fim_losses[0] != plain_losses[0]  # other tokens reach the model
    assert any("added <fim_prefix> <fim_middle> <fim_suffix> <fim_pad> as ids 50257 50258 "
               "50259 50260" in message for _, message in runs[1]["logs"])
