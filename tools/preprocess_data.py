"""Tokenizes a JSON-lines corpus into megatron.core indexed datasets (.bin + .idx).

One JSON object per input line; each `--json-keys` field is a document. Writes
`{output_prefix}_{key}_document.{bin,idx}` (`_sentence` with --split-sentences, where each
sentence is one sequence of its document), readable by
megatron.core.datasets.indexed_dataset.IndexedDataset. Outputs are written under temporary
names and renamed into place only when complete.

    python tools/preprocess_data.py --input datasets_gpt/dataset.json \
        --output-prefix datasets_gpt/gpt --tokenizer-type GPT2BPETokenizer \
        --vocab-file datasets_gpt/vocab.json --merge-file datasets_gpt/merges.txt \
        --append-eod --workers 2
"""

import argparse
import contextlib
import logging
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass, field

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.trainer.data.tokenizer_record import TOKENIZER_TYPES  # noqa: E402
from tools.document_encoder import (  # noqa: E402
    DocumentEncoder,
    EncodedChunk,
    load_punkt_params,
    read_line_chunks,
    sentence_splitter,
    train_punkt_params,
)

logger = logging.getLogger("preprocess_data")

MAX_REPORTED_BAD_LINES = 10
DEFAULT_PUNKT_PARAMS = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                    "punkt_english.json.gz")


class PreprocessError(RuntimeError):
    """Bad input or arguments; the message names the file, line or flag."""


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_argument_group("input data")
    group.add_argument("--input", required=True, help="JSON-lines file, one document per line")
    group.add_argument("--json-keys", nargs="+", default=["text"],
                       help="keys to extract from each JSON object (default: text)")
    group.add_argument("--split-sentences", action="store_true",
                       help="split documents into sentences with nltk Punkt")
    group.add_argument("--punkt-params", default=DEFAULT_PUNKT_PARAMS,
                       help="Punkt parameters from tools/build_punkt_params.py "
                            "(default: English, learned from the sample datasets)")
    group.add_argument("--punkt-train-on-input", action="store_true",
                       help="learn Punkt parameters from the input instead (needs MBs of text)")
    group.add_argument("--skip-bad-lines", action="store_true",
                       help="count and skip lines that are not UTF-8 JSON objects with the keys")
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    group.add_argument("--vocab-file", help="vocab.json (GPT2BPETokenizer) or vocab.txt (BERT)")
    group.add_argument("--merge-file", help="merges.txt (GPT2BPETokenizer)")
    group.add_argument("--tokenizer-model", help="tokenizer.json or sentencepiece .model")
    group.add_argument("--vocab-size", type=int, help="vocabulary size (NullTokenizer)")
    group.add_argument("--append-eod", action="store_true",
                       help="append the end-of-document token to each document")
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", required=True,
                       help="path prefix; outputs are {prefix}_{key}_{document|sentence}.bin/.idx")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    group.add_argument("--log-interval", type=int, default=1000,
                       help="documents between progress lines")
    group.add_argument("--chunk-bytes", type=int, default=1 << 20,
                       help="input bytes handed to a worker at a time")
    args = parser.parse_args(argv)
    for flag, value, minimum in (("--workers", args.workers, 1),
                                 ("--log-interval", args.log_interval, 1),
                                 ("--chunk-bytes", args.chunk_bytes, 1)):
        if value < minimum:
            parser.error(f"{flag} must be >= {minimum}, got {value}")
    return args


@dataclass
class Summary:
    documents: int = 0
    tokens: int = 0
    input_bytes: int = 0
    bad_lines: int = 0
    empty_documents: int = 0
    blank_lines: int = 0
    seconds: float = 0.0
    outputs: list[str] = field(default_factory=list)

    @property
    def megabytes_per_second(self) -> float:
        return self.input_bytes / 1e6 / max(self.seconds, 1e-9)


class IndexedDatasetWriters:
    """One IndexedDatasetBuilder per JSON key, under temporary names until commit()."""

    def __init__(self, output_prefix: str, json_keys: list[str], level: str, vocab_size: int,
                 tokenizer_record: dict):
        self.tokenizer_record = tokenizer_record
        from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

        directory = os.path.dirname(os.path.abspath(output_prefix))
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as error:
            raise PreprocessError(f"--output-prefix {output_prefix}: cannot create the directory "
                                  f"{directory}: {error.strerror}") from error
        dtype = DType.optimal_dtype(vocab_size)
        self.final_prefixes = {key: f"{output_prefix}_{key}_{level}" for key in json_keys}
        self.temp_prefixes = {
            key: f"{prefix}.partial-{os.getpid()}" for key, prefix in self.final_prefixes.items()
        }
        self.builders = {
            key: IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
            for key, prefix in self.temp_prefixes.items()
        }

    def add(self, chunk: EncodedChunk) -> None:
        for key, encoded in chunk.keys.items():
            builder = self.builders[key]
            start = 0
            for sentence_lengths in encoded.documents:
                end = start + sum(sentence_lengths)
                builder.add_document(encoded.tokens[start:end], sentence_lengths)
                start = end

    def commit(self) -> list[str]:
        """Finish the index files and rename both files of each dataset into place, each
        with the record of its tokenizer (megatron/trainer/data/tokenizer_record.py)."""
        from megatron.trainer.data import tokenizer_record

        for key, builder in self.builders.items():
            builder.finalize(self.temp_prefixes[key] + ".idx")
        for key, final in self.final_prefixes.items():
            # The .idx goes last: a reader never sees a final .idx without its final .bin.
            if os.path.exists(final + ".idx"):
                os.remove(final + ".idx")
            os.replace(self.temp_prefixes[key] + ".bin", final + ".bin")
            os.replace(self.temp_prefixes[key] + ".idx", final + ".idx")
            tokenizer_record.write(final, self.tokenizer_record)
        return list(self.final_prefixes.values())

    def abort(self) -> None:
        for key, builder in self.builders.items():
            builder.data_file.close()
            for suffix in (".bin", ".idx"):
                path = self.temp_prefixes[key] + suffix
                if os.path.exists(path):
                    os.remove(path)


def _build_tokenizer(args):
    from megatron.trainer.data.tokenizer import build_tokenizer

    try:
        return build_tokenizer(
            args.tokenizer_type,
            vocab_file=args.vocab_file,
            merge_file=args.merge_file,
            tokenizer_model=args.tokenizer_model,
            vocab_size=args.vocab_size,
        )
    except (ValueError, ImportError) as error:
        raise PreprocessError(str(error)) from error


def _tokenizer_record(args) -> dict:
    from megatron.trainer.data import tokenizer_record

    files = {"vocab_file": args.vocab_file, "merge_file": args.merge_file,
             "tokenizer_model": args.tokenizer_model}
    vocab_size = args.vocab_size if args.tokenizer_type == "NullTokenizer" else None
    return tokenizer_record.describe(args.tokenizer_type, files, vocab_size)


class _Progress:
    def __init__(self, summary: Summary, interval: int, start: float) -> None:
        self.summary, self.interval, self.start = summary, interval, start
        self.next_report = interval

    def update(self) -> None:
        if self.summary.documents < self.next_report:
            return
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        logger.info(
            "processed %d documents (%.0f docs/s, %.2f MB/s)",
            self.summary.documents,
            self.summary.documents / elapsed,
            self.summary.input_bytes / 1e6 / elapsed,
        )
        self.next_report = (self.summary.documents // self.interval + 1) * self.interval


def _account(chunk: EncodedChunk, args, summary: Summary) -> None:
    for line_number, reason in chunk.bad_lines:
        summary.bad_lines += 1
        message = f"{args.input}:{line_number}: {reason}"
        if not args.skip_bad_lines:
            raise PreprocessError(message + " (use --skip-bad-lines to skip such lines)")
        if summary.bad_lines <= MAX_REPORTED_BAD_LINES:
            logger.warning("skipping bad line %s", message)
    summary.documents += chunk.documents
    summary.empty_documents += chunk.empty_documents
    summary.blank_lines += chunk.blank_lines
    summary.tokens += chunk.token_count
    summary.input_bytes += chunk.input_bytes


def _encoded_chunks(encoder: DocumentEncoder, chunks, workers: int):
    if workers == 1:
        yield from map(encoder.encode_chunk, chunks)
        return
    # fork: workers inherit the loaded tokenizer instead of re-importing torch and megatron.core.
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    context = multiprocessing.get_context(method)
    with context.Pool(workers, initializer=_init_worker, initargs=(encoder,)) as pool:
        yield from pool.imap(_encode_in_worker, chunks)


class _WorkerEncoder:
    """Holds the encoder a pool worker received at start-up (pool tasks are plain functions)."""

    encoder: DocumentEncoder | None = None


def _init_worker(encoder: DocumentEncoder) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["OMP_NUM_THREADS"] = "1"
    _WorkerEncoder.encoder = encoder


def _encode_in_worker(chunk) -> EncodedChunk:
    return _WorkerEncoder.encoder.encode_chunk(chunk)


def _punkt_params(args):
    if args.punkt_train_on_input:
        logger.info("learning nltk Punkt parameters from %s", args.input)
        return train_punkt_params([args.input], args.json_keys)
    try:
        return load_punkt_params(args.punkt_params)
    except ValueError as error:
        raise PreprocessError(f"--punkt-params: {error}") from error


def preprocess(args: argparse.Namespace) -> Summary:
    """Runs the whole conversion; raises PreprocessError with file:line on bad input."""
    if not os.path.isfile(args.input):
        raise PreprocessError(f"--input {args.input}: no such file")
    tokenizer = _build_tokenizer(args)
    if args.append_eod:
        try:
            tokenizer.eod  # noqa: B018 - fail before any work when there is no EOD token
        except NotImplementedError as error:
            raise PreprocessError(f"--append-eod: {error}") from error
    splitter = None
    if args.split_sentences:
        splitter = sentence_splitter(_punkt_params(args))
    encoder = DocumentEncoder(tokenizer, args.json_keys, args.append_eod, splitter)

    level = "sentence" if args.split_sentences else "document"
    summary = Summary()
    start = time.perf_counter()
    writers = IndexedDatasetWriters(args.output_prefix, args.json_keys, level,
                                    tokenizer.vocab_size, _tokenizer_record(args))
    progress = _Progress(summary, args.log_interval, start)
    try:
        chunks = read_line_chunks(args.input, args.chunk_bytes)
        # closing(): a failure stops the worker pool now, not when the traceback is freed.
        with contextlib.closing(_encoded_chunks(encoder, chunks, args.workers)) as encoded:
            for chunk in encoded:
                _account(chunk, args, summary)
                writers.add(chunk)
                progress.update()
        if summary.documents == summary.empty_documents:
            raise PreprocessError(
                f"--input {args.input}: no documents (the file is empty, or every line was "
                "blank, skipped or had empty text); nothing written")
        summary.outputs = writers.commit()
    except BaseException:
        writers.abort()
        raise
    summary.seconds = time.perf_counter() - start
    return summary


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    # megatron.core's notes at import (which FSDP it found) say nothing about the data
    logging.getLogger("megatron.core").setLevel(logging.WARNING)
    args = parse_args(argv)
    try:
        summary = preprocess(args)
    except PreprocessError as error:
        logger.error("%s", error)
        return 1
    logger.info(
        "done: %d documents, %d tokens, %.2f MB in %.2f s (%.2f MB/s); skipped %d bad lines, "
        "%d empty documents, %d blank lines",
        summary.documents, summary.tokens, summary.input_bytes / 1e6, summary.seconds,
        summary.megabytes_per_second, summary.bad_lines, summary.empty_documents,
        summary.blank_lines,
    )
    for prefix in summary.outputs:
        logger.info("wrote %s.bin and %s.idx", prefix, prefix)
    return 0


if __name__ == "__main__":
    sys.exit(main())
