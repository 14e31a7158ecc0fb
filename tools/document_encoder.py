"""Worker side of tools/preprocess_data.py: JSON lines in, token arrays out.

Kept free of torch and megatron.core imports so that a worker process starts fast.
"""

import gzip
import itertools
import json
from dataclasses import dataclass, field

import numpy

# Punkt learns abbreviations and collocations from this much text at the start of the input.
PUNKT_TRAINING_BYTES = 8 << 20


@dataclass
class LineChunk:
    first_line_number: int
    lines: list[bytes]


@dataclass
class EncodedKey:
    """Tokens of every kept document of a chunk for one JSON key, concatenated."""

    tokens: numpy.ndarray
    documents: list[list[int]] = field(default_factory=list)  # sentence lengths per document


@dataclass
class EncodedChunk:
    keys: dict[str, EncodedKey]
    documents: int = 0
    token_count: int = 0
    input_bytes: int = 0
    empty_documents: int = 0
    blank_lines: int = 0
    bad_lines: list[tuple[int, str]] = field(default_factory=list)


def read_line_chunks(path: str, chunk_bytes: int):
    """Groups the file's raw lines into chunks of about chunk_bytes, with line numbers."""
    with open(path, "rb") as handle:
        lines, size, first = [], 0, 1
        for line_number, line in enumerate(handle, start=1):
            lines.append(line)
            size += len(line)
            if size >= chunk_bytes:
                yield LineChunk(first, lines)
                lines, size, first = [], 0, line_number + 1
        if lines:
            yield LineChunk(first, lines)


def parse_record(line: bytes, json_keys: list[str]) -> list[str]:
    """The texts under json_keys; ValueError names what is wrong with the line."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"not UTF-8: {error}") from None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"not valid JSON: {error}") from None
    if not isinstance(record, dict):
        raise ValueError(f"not a JSON object but {type(record).__name__}")
    texts = []
    for key in json_keys:
        if key not in record:
            raise ValueError(f"no key {key!r} (keys: {', '.join(sorted(record)) or 'none'})")
        if not isinstance(record[key], str):
            raise ValueError(f"key {key!r} is {type(record[key]).__name__}, not a string")
        texts.append(record[key])
    return texts


class DocumentEncoder:
    """Tokenizes the documents of a chunk, optionally split into sentences first."""

    def __init__(self, tokenizer, json_keys: list[str], append_eod: bool, splitter=None):
        self.tokenizer = tokenizer
        self.json_keys = list(json_keys)
        self.eod = tokenizer.eod if append_eod else None
        self.splitter = splitter

    def encode_chunk(self, chunk: LineChunk) -> EncodedChunk:
        texts_by_key: dict[str, list[str]] = {key: [] for key in self.json_keys}
        result = EncodedChunk(keys={})
        for offset, line in enumerate(chunk.lines):
            result.input_bytes += len(line)
            if not line.strip():
                result.blank_lines += 1
                continue
            try:
                texts = parse_record(line, self.json_keys)
            except ValueError as error:
                result.bad_lines.append((chunk.first_line_number + offset, str(error)))
                continue
            result.documents += 1
            for key, text in zip(self.json_keys, texts, strict=True):
                texts_by_key[key].append(text)
        for key, texts in texts_by_key.items():
            result.keys[key] = self._encode_documents(texts, result)
        return result

    def _encode_documents(self, texts: list[str], result: EncodedChunk) -> EncodedKey:
        if self.splitter is None:
            sentences_per_doc = [[text] if text.strip() else [] for text in texts]
        else:
            sentences_per_doc = [self.splitter.tokenize(text) for text in texts]
        flat_sentences = [sentence for sentences in sentences_per_doc for sentence in sentences]
        flat_ids = self.tokenizer.tokenize_batch(flat_sentences) if flat_sentences else []

        encoded = EncodedKey(tokens=numpy.empty(0, dtype=numpy.int64))
        pieces = []
        position = 0
        key_tokens = 0
        for sentences in sentences_per_doc:
            doc_ids = [ids for ids in flat_ids[position : position + len(sentences)] if ids]
            position += len(sentences)
            if not doc_ids:
                result.empty_documents += 1
                continue
            if self.eod is not None:
                doc_ids[-1] = [*doc_ids[-1], self.eod]
            lengths = [len(ids) for ids in doc_ids]
            encoded.documents.append(lengths)
            pieces.extend(doc_ids)
            key_tokens += sum(lengths)
        result.token_count += key_tokens
        if pieces:
            encoded.tokens = numpy.fromiter(
                itertools.chain.from_iterable(pieces), dtype=numpy.int64, count=key_tokens
            )
        return encoded


def train_punkt_params(paths: list[str], json_keys: list[str]):
    """nltk Punkt parameters learned from the first PUNKT_TRAINING_BYTES of text in paths."""
    from nltk.tokenize.punkt import PunktTrainer

    trainer = PunktTrainer()
    seen = 0
    for path in paths:
        for chunk in read_line_chunks(path, 1 << 20):
            for line in chunk.lines:
                try:
                    texts = parse_record(line, json_keys)
                except ValueError:
                    continue  # the main pass reports bad lines with their line numbers
                for text in texts:
                    trainer.train(text, finalize=False)
                    seen += len(text)
            if seen >= PUNKT_TRAINING_BYTES:
                break
    trainer.finalize_training()
    return trainer.get_params()


def save_punkt_params(params, path: str) -> None:
    state = {
        "abbrev_types": sorted(params.abbrev_types),
        "collocations": sorted(params.collocations),
        "sent_starters": sorted(params.sent_starters),
        "ortho_context": dict(sorted(params.ortho_context.items())),
    }
    text = json.dumps(state, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    with open(path, "wb") as handle:
        # mtime=0 keeps the file identical when rebuilt from the same text.
        handle.write(gzip.compress(text, mtime=0) if path.endswith(".gz") else text)


def load_punkt_params(path: str):
    from nltk.tokenize.punkt import PunktParameters

    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as handle:
            state = json.load(handle)
        params = PunktParameters()
        params.abbrev_types = set(state["abbrev_types"])
        params.collocations = {tuple(pair) for pair in state["collocations"]}
        params.sent_starters = set(state["sent_starters"])
        for word, flags in state["ortho_context"].items():
            params.add_ortho_context(word, flags)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"Punkt parameters file {path}: cannot load: {error!r}") from None
    return params


def sentence_splitter(params):
    from nltk.tokenize.punkt import PunktSentenceTokenizer

    return PunktSentenceTokenizer(params)
