"""The tokenizer a dataset was made with, recorded next to it: tools/preprocess_data.py
writes `<prefix>.tokenizer.json` beside each `<prefix>.bin/.idx`, and the launch scripts read
it to train on a user's data without tokenizer settings (megatron/trainer/launch.py).

Files are recorded by absolute path and SHA-256, so a copy of the same vocabulary (the
sample's GPT-2 files, say) is recognised wherever it lies. Only the standard library: the
launch scripts read it before torch is importable."""

from __future__ import annotations

import hashlib
import json
import os

# --tokenizer-type's choices (here, in a module of the standard library only, so that
# tools/preprocess_data.py --help imports no megatron.core)
TOKENIZER_TYPES = (
    "GPT2BPETokenizer",
    "BertWordPieceLowerCase",
    "BertWordPieceCase",
    "HuggingFaceTokenizer",
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "NullTokenizer",
)
SUFFIX = ".tokenizer.json"
# the tokenizer flag of each recorded file
FILE_FLAGS = {"vocab_file": "--vocab-file", "merge_file": "--merge-file",
              "tokenizer_model": "--tokenizer-model"}


def file_digest(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def describe(tokenizer_type: str, files: dict[str, str | None], vocab_size: int | None) -> dict:
    """The record of a tokenizer: its type, each given file with its digest, and the
    --vocab-size of a NullTokenizer."""
    record: dict = {"tokenizer_type": tokenizer_type}
    for key, path in files.items():
        if path is not None and os.path.isfile(path):
            record[key] = {"path": os.path.abspath(path), "sha256": file_digest(path)}
    if vocab_size is not None:
        record["vocab_size"] = vocab_size
    return record


def write(prefix: str, record: dict) -> str:
    path = prefix + SUFFIX
    with open(path, "w", encoding="utf-8") as stream:
        json.dump(record, stream, indent=1)
        stream.write("\n")
    return path


def read(prefix: str) -> dict | None:
    """The record beside `prefix`; None where there is none (data made elsewhere, or before
    records were written). A record that is not JSON raises ValueError."""
    path = prefix + SUFFIX
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as stream:
        try:
            record = json.load(stream)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}: not a tokenizer record: {error}") from None
    if not isinstance(record, dict) or "tokenizer_type" not in record:
        raise ValueError(f"{path}: not a tokenizer record (no tokenizer_type)")
    return record


def locate(record: dict, candidates: dict[str, str | None]) -> dict[str, str | None]:
    """Where each file of `record` is here: the candidate of the same key (e.g. the sample's
    vocabulary) when its contents match, else the recorded path when it still holds the
    same contents, else None."""
    found: dict[str, str | None] = {}
    for key in FILE_FLAGS:
        if key not in record:
            continue
        wanted = record[key]["sha256"]
        found[key] = None
        for path in (candidates.get(key), record[key]["path"]):
            if path and os.path.isfile(path) and file_digest(path) == wanted:
                found[key] = path
                break
    return found
