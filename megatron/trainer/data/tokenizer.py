"""Tokenizers shared by tools/preprocess_data.py and the trainer.

`build_tokenizer(tokenizer_type, ...)` returns an object that megatron.core's GPT and BERT
datasets accept as their `tokenizer` (vocab_size, eod, pad, cls, sep, mask, inv_vocab,
unique_identifiers). The byte-level BPE and WordPiece models run in HF `tokenizers`.
"""

from __future__ import annotations

import itertools
import json
import os
from collections import OrderedDict

from megatron.core.tokenizers import MegatronTokenizerBase

from megatron.trainer.data.tokenizer_record import TOKENIZER_TYPES

GPT2_EOD_TOKEN = "<|endoftext|>"
# GPT-2's pre-tokenization, the same as HF tokenizers' ByteLevel(use_regex=True).
GPT2_PRETOKENIZE_PATTERN = (
    r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
)
BERT_SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
# Looked up, in this order, as the end-of-document token of a HuggingFace tokenizer.json.
HF_EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "[SEP]")


class TokenizerError(ValueError):
    """The tokenizer cannot be built from the flags and files given; the message says why."""


class TokenizerFlagError(TokenizerError):
    """A tokenizer flag is missing or names no tokenizer (a usage error, as a bad flag)."""


class TokenizerFileError(TokenizerError):
    """A vocabulary, merges or model file is missing, unreadable or inconsistent."""


class Tokenizer(MegatronTokenizerBase):
    """Common surface of every tokenizer here; special tokens a model lacks raise."""

    def __init__(self, tokenizer_type: str, files: dict[str, str | None]) -> None:
        super().__init__(path=files.get("vocab_file") or files.get("tokenizer_model") or "",
                         config={})
        self.tokenizer_type = tokenizer_type
        self.files = {name: path for name, path in files.items() if path is not None}

    @property
    def unique_identifiers(self) -> OrderedDict:
        """What megatron.core hashes to name its dataset index caches."""
        identifiers = OrderedDict(tokenizer_type=self.tokenizer_type)
        identifiers.update(sorted(self.files.items()))
        identifiers["vocab_size"] = self.vocab_size
        return identifiers

    def tokenize(self, text: str) -> list[int]:
        return self.tokenize_batch([text])[0]

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        raise NotImplementedError

    def detokenize(self, ids) -> str:
        raise NotImplementedError

    def apply_chat_template(self, *args, **kwargs):
        raise NotImplementedError(f"{self.tokenizer_type} has no chat template")

    @property
    def vocab(self) -> dict[str, int]:
        raise NotImplementedError

    @property
    def inv_vocab(self) -> dict[int, str]:
        return {token_id: token for token, token_id in self.vocab.items()}

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def _special(self, name: str) -> int:
        raise NotImplementedError(f"{self.tokenizer_type} has no {name} token")

    def add_special_tokens(self, tokens) -> list[str]:
        """Make each of `tokens` one token of this tokenizer (never produced by splitting
        text); returns those that were added. Here nothing can be added: the model's files
        must hold them."""
        missing = [token for token in tokens if token not in self.vocab]
        if missing:
            raise TokenizerFileError(
                f"{self.tokenizer_type} has no {', '.join(missing)} token"
                f"{'s' if len(missing) > 1 else ''} and cannot add tokens: use a tokenizer "
                "model that holds them")
        return []

    @property
    def eod(self) -> int:
        return self._special("end-of-document")

    @property
    def pad(self) -> int:
        return self._special("padding")

    @property
    def cls(self) -> int:
        return self._special("[CLS]")

    @property
    def sep(self) -> int:
        return self._special("[SEP]")

    @property
    def mask(self) -> int:
        return self._special("[MASK]")

    @property
    def bos(self) -> int:
        return self._special("beginning-of-sequence")

    @property
    def eos(self) -> int:
        return self._special("end-of-sequence")


class _HFBackedTokenizer(Tokenizer):
    """Encodes and decodes through a `tokenizers.Tokenizer` without adding special tokens."""

    def __init__(self, tokenizer_type: str, files: dict[str, str | None], backend) -> None:
        super().__init__(tokenizer_type, files)
        self._backend = backend
        self._vocab = backend.get_vocab(with_added_tokens=True)
        self._inv_vocab = None

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        encodings = self._backend.encode_batch_fast(texts, add_special_tokens=False)
        return [encoding.ids for encoding in encodings]

    def add_special_tokens(self, tokens) -> list[str]:
        """New tokens get the ids after the vocabulary, as HF's added special tokens."""
        from tokenizers import AddedToken

        missing = [token for token in dict.fromkeys(tokens) if token not in self._vocab]
        if missing:
            self._backend.add_special_tokens(
                [AddedToken(token, special=True, normalized=False) for token in missing])
            self._vocab = self._backend.get_vocab(with_added_tokens=True)
            self._inv_vocab = None
        return missing

    def detokenize(self, ids) -> str:
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=False)

    @property
    def vocab(self) -> dict[str, int]:
        return self._vocab

    @property
    def inv_vocab(self) -> dict[int, str]:
        if self._inv_vocab is None:
            self._inv_vocab = {token_id: token for token, token_id in self._vocab.items()}
        return self._inv_vocab

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)


class GPT2BPETokenizer(_HFBackedTokenizer):
    """GPT-2 byte-level BPE from vocab.json + merges.txt; EOD is <|endoftext|>.

    Encodes with tiktoken where installed and the vocab ids follow the merge order (as in
    GPT-2's own files and those HF's BpeTrainer writes): it gives the same ids as HF
    `tokenizers` about three times faster, which preprocessing needs. HF `tokenizers` otherwise.
    """

    def __init__(self, vocab_file: str, merge_file: str) -> None:
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers

        vocab = _read_json_vocab(vocab_file)
        merges = _read_merges(merge_file, vocab, vocab_file)
        if GPT2_EOD_TOKEN not in vocab:
            raise TokenizerFileError(f"vocab file {vocab_file}: no {GPT2_EOD_TOKEN} token")
        backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        super().__init__(
            "GPT2BPETokenizer", {"vocab_file": vocab_file, "merge_file": merge_file}, backend
        )
        self._merges = merges
        self._tiktoken = _tiktoken_encoding(vocab, merges)

    @property
    def engine(self) -> str:
        return "tiktoken" if self._tiktoken is not None else "tokenizers"

    def add_special_tokens(self, tokens) -> list[str]:
        added = super().add_special_tokens(tokens)
        if added and self._tiktoken is not None:
            # tiktoken decodes only the ids it was built with
            self._tiktoken = _tiktoken_encoding(self._vocab, self._merges, specials=added)
        return added

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        if self._tiktoken is None:
            return super().tokenize_batch(texts)
        return [self._tiktoken.encode_ordinary(text) for text in texts]

    def detokenize(self, ids) -> str:
        if self._tiktoken is None:
            return super().detokenize(ids)
        return self._tiktoken.decode([int(i) for i in ids])

    @property
    def eod(self) -> int:
        return self._vocab[GPT2_EOD_TOKEN]


def _byte_to_char() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters used in vocab.json."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    mapping = {byte: chr(byte) for byte in printable}
    shifted = 0
    for byte in range(256):
        if byte not in mapping:
            mapping[byte] = chr(256 + shifted)
            shifted += 1
    return mapping


def _tiktoken_encoding(vocab: dict[str, int], merges: list[tuple[str, str]], specials=()):
    """A tiktoken Encoding equal to the HF BPE model, or None where that cannot hold.
    `specials`: added tokens, never merged from text whatever their characters."""
    try:
        import tiktoken
    except ImportError:
        return None
    ids_in_merge_order = [vocab[left + right] for left, right in merges]
    if any(a >= b for a, b in itertools.pairwise(ids_in_merge_order)):
        return None
    char_to_byte = {char: byte for byte, char in _byte_to_char().items()}
    special_names = {GPT2_EOD_TOKEN, *specials}
    ranks, special_ids = {}, {}
    for token, token_id in vocab.items():
        if all(char in char_to_byte for char in token) and token not in special_names:
            ranks[bytes(char_to_byte[char] for char in token)] = token_id
        else:
            special_ids[token] = token_id
    if (len(ranks) + len(special_ids) != len(vocab)
            or any(bytes([b]) not in ranks for b in range(256))):
        return None
    return tiktoken.Encoding(
        "gpt2_bpe_from_files", pat_str=GPT2_PRETOKENIZE_PATTERN, mergeable_ranks=ranks,
        special_tokens=special_ids,
    )


class BertWordPieceTokenizer(_HFBackedTokenizer):
    """BERT WordPiece from vocab.txt (one token per line, id = line index); EOD is [SEP]."""

    def __init__(self, vocab_file: str, lower_case: bool) -> None:
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, normalizers, pre_tokenizers

        vocab = _read_wordpiece_vocab(vocab_file)
        backend = HFTokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
        backend.normalizer = normalizers.BertNormalizer(lowercase=lower_case)
        backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        backend.decoder = decoders.WordPiece(prefix="##")
        name = "BertWordPieceLowerCase" if lower_case else "BertWordPieceCase"
        super().__init__(name, {"vocab_file": vocab_file}, backend)

    @property
    def pad(self) -> int:
        return self._vocab["[PAD]"]

    @property
    def cls(self) -> int:
        return self._vocab["[CLS]"]

    @property
    def sep(self) -> int:
        return self._vocab["[SEP]"]

    @property
    def mask(self) -> int:
        return self._vocab["[MASK]"]

    @property
    def eod(self) -> int:
        return self._vocab["[SEP]"]


class HuggingFaceTokenizer(_HFBackedTokenizer):
    """Any `tokenizers` model saved as tokenizer.json (the file, or a folder holding it)."""

    def __init__(self, tokenizer_model: str) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        path = tokenizer_model
        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        _require_file(path, "tokenizer model (tokenizer.json)")
        try:
            backend = HFTokenizer.from_file(path)
        except Exception as error:
            raise TokenizerFileError(f"tokenizer model {path}: cannot load: {error}") from error
        super().__init__("HuggingFaceTokenizer", {"tokenizer_model": tokenizer_model}, backend)

    @property
    def eod(self) -> int:
        for token in HF_EOD_CANDIDATES:
            if token in self._vocab:
                return self._vocab[token]
        return self._special(f"end-of-document (none of {', '.join(HF_EOD_CANDIDATES)})")

    @property
    def pad(self) -> int:
        for token in ("<pad>", "[PAD]", "<|pad|>"):
            if token in self._vocab:
                return self._vocab[token]
        return self._special("padding")


class SentencePieceTokenizer(Tokenizer):
    """A sentencepiece .model file; EOD is its </s> (eos) piece, no tokens are added. Also
    Megatron-LM's GPTSentencePieceTokenizer, which is exactly that."""

    def __init__(self, tokenizer_model: str,
                 tokenizer_type: str = "SentencePieceTokenizer") -> None:
        try:
            import sentencepiece
        except ImportError as error:
            raise TokenizerError(
                "SentencePieceTokenizer needs the sentencepiece package: pip install sentencepiece"
            ) from error
        _require_file(tokenizer_model, "tokenizer model")
        try:
            self._processor = sentencepiece.SentencePieceProcessor(model_file=tokenizer_model)
        except Exception as error:
            raise TokenizerFileError(
                f"tokenizer model {tokenizer_model}: cannot load: {error}"
            ) from error
        super().__init__(tokenizer_type, {"tokenizer_model": tokenizer_model})
        size = self._processor.get_piece_size()
        self._vocab = {self._processor.id_to_piece(i): i for i in range(size)}

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return self._processor.encode(list(texts))

    def detokenize(self, ids) -> str:
        return self._processor.decode([int(i) for i in ids])

    @property
    def vocab(self) -> dict[str, int]:
        return self._vocab

    def _piece(self, token_id: int, what: str) -> int:
        return token_id if token_id >= 0 else self._special(what)

    @property
    def eod(self) -> int:
        return self._piece(self._processor.eos_id(), "end-of-document (eos)")

    @property
    def eos(self) -> int:
        return self._piece(self._processor.eos_id(), "end-of-sequence")

    @property
    def bos(self) -> int:
        return self._piece(self._processor.bos_id(), "beginning-of-sequence")

    @property
    def pad(self) -> int:
        return self._piece(self._processor.pad_id(), "padding")


class NullTokenizer(Tokenizer):
    """No files: text is space-separated token ids; EOD is the last id, vocab_size - 1."""

    def __init__(self, vocab_size: int) -> None:
        if vocab_size is None or int(vocab_size) < 2:
            raise TokenizerFlagError(f"NullTokenizer needs --vocab-size >= 2, got {vocab_size}")
        self._size = int(vocab_size)
        super().__init__("NullTokenizer", {})

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return [self._parse(text) for text in texts]

    def _parse(self, text: str) -> list[int]:
        ids = []
        for word in text.split():
            if not word.isdigit() or int(word) >= self._size:
                raise ValueError(
                    f"NullTokenizer: {word!r} is not a token id in [0, {self._size - 1}]"
                )
            ids.append(int(word))
        return ids

    def detokenize(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)

    @property
    def vocab(self) -> dict[str, int]:
        return {str(i): i for i in range(self._size)}

    @property
    def inv_vocab(self) -> dict[int, str]:
        return {i: str(i) for i in range(self._size)}

    @property
    def vocab_size(self) -> int:
        return self._size

    @property
    def eod(self) -> int:
        return self._size - 1


def build_tokenizer(
    tokenizer_type: str,
    *,
    vocab_file: str | None = None,
    merge_file: str | None = None,
    tokenizer_model: str | None = None,
    vocab_size: int | None = None,
) -> Tokenizer:
    """The tokenizer that `--tokenizer-type` names, from its files (or vocab_size for Null)."""
    if tokenizer_type == "GPT2BPETokenizer":
        _require_arg(vocab_file, "--vocab-file", tokenizer_type)
        _require_arg(merge_file, "--merge-file", tokenizer_type)
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type in ("BertWordPieceLowerCase", "BertWordPieceCase"):
        _require_arg(vocab_file, "--vocab-file", tokenizer_type)
        return BertWordPieceTokenizer(vocab_file, tokenizer_type == "BertWordPieceLowerCase")
    if tokenizer_type == "HuggingFaceTokenizer":
        _require_arg(tokenizer_model, "--tokenizer-model", tokenizer_type)
        return HuggingFaceTokenizer(tokenizer_model)
    if tokenizer_type in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer"):
        _require_arg(tokenizer_model, "--tokenizer-model", tokenizer_type)
        return SentencePieceTokenizer(tokenizer_model, tokenizer_type)
    if tokenizer_type == "NullTokenizer":
        _require_arg(vocab_size, "--vocab-size", tokenizer_type)
        return NullTokenizer(vocab_size)
    raise TokenizerFlagError(
        f"unknown tokenizer type {tokenizer_type!r}; expected one of {', '.join(TOKENIZER_TYPES)}"
    )


def _require_arg(value, flag: str, tokenizer_type: str) -> None:
    if value is None:
        raise TokenizerFlagError(f"{tokenizer_type} needs {flag}")


def _require_file(path: str, what: str) -> None:
    if not os.path.isfile(path):
        raise TokenizerFileError(f"{what} {path}: no such file")


def _read_json_vocab(vocab_file: str) -> dict[str, int]:
    _require_file(vocab_file, "vocab file")
    try:
        with open(vocab_file, encoding="utf-8") as handle:
            vocab = json.load(handle)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise TokenizerFileError(f"vocab file {vocab_file}: not a JSON vocabulary: {error}") from None
    if not isinstance(vocab, dict) or not all(isinstance(i, int) for i in vocab.values()):
        raise TokenizerFileError(f"vocab file {vocab_file}: expected a JSON object token -> id")
    return vocab


def _read_merges(merge_file: str, vocab: dict[str, int], vocab_file: str) -> list[tuple[str, str]]:
    """Merge rules; each must join two vocab tokens into a vocab token, else the files mismatch."""
    _require_file(merge_file, "merges file")
    merges = []
    with open(merge_file, encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            line = line.rstrip("\n")
            if line.startswith("#version") or not line:
                continue
            parts = line.split(" ")
            if len(parts) != 2:
                raise TokenizerFileError(
                    f"merges file {merge_file}:{line_number}: expected two tokens, got {line!r}"
                )
            for token in (*parts, parts[0] + parts[1]):
                if token not in vocab:
                    raise TokenizerFileError(
                        f"merges file {merge_file}:{line_number}: token {token!r} is not in "
                        f"vocab file {vocab_file} (mismatched vocab and merges files?)"
                    )
            merges.append((parts[0], parts[1]))
    return merges


def _read_wordpiece_vocab(vocab_file: str) -> dict[str, int]:
    _require_file(vocab_file, "vocab file")
    vocab: dict[str, int] = {}
    try:
        with open(vocab_file, encoding="utf-8") as handle:
            for line_number, line in enumerate(handle, start=1):
                token = line.rstrip("\n")
                if token in vocab:
                    raise TokenizerFileError(
                        f"vocab file {vocab_file}:{line_number}: duplicate token {token!r}"
                    )
                vocab[token] = line_number - 1
    except UnicodeDecodeError as error:
        raise TokenizerFileError(f"vocab file {vocab_file}: not UTF-8 text: {error}") from None
    missing = [token for token in BERT_SPECIAL_TOKENS if token not in vocab]
    if missing:
        raise TokenizerFileError(
            f"vocab file {vocab_file}: not a BERT WordPiece vocab, lacks {', '.join(missing)}"
        )
    return vocab
