"""Writes a corpus of documents whose GPT-2 token counts follow a chosen lognormal
distribution, for the variable-length GPU benchmarks (docs/variable_lengths.md).

The shipped sample text (datasets_gpt/dataset.json, the Jargon File of Debian's dict-jargon)
has documents of 153 tokens on average: too short to stand for pretraining documents at
--seq-length 2048. Here each document's length in tokens (the end-of-document token
included, as `preprocess_data.py --append-eod` adds it) is drawn lognormal with the given
mean and coefficient of variation, cut at --max-tokens (a longer draw becomes --max-tokens)
and raised to --min-tokens; its text is a run of whole words of the sample text starting at
a random word (wrapping around at the end), as many as fit. Words are tokenized one at a
time with the space before them; GPT-2's pre-tokenizer splits text at exactly those points,
so a document's token count is the sum of its words' counts, known without tokenizing it
again. The text ends short of the drawn length by less than one word (a few tokens).

    python tools/build_length_corpus.py --output /data/varlen/corpus.json \
        --documents 2000 --seed 1
    python tools/preprocess_data.py --input /data/varlen/corpus.json \
        --output-prefix /data/varlen/corpus --tokenizer-type GPT2BPETokenizer \
        --vocab-file datasets_gpt/vocab.json --merge-file datasets_gpt/merges.txt \
        --append-eod --workers 4

Defaults: mean 1,000 tokens, CV 0.8, cut at 2,048, at least 16; 2,000 documents (about
1.9 M tokens; 1,960 in the train split of --split 98,1,1: 61 iterations of 32 documents,
16 microbatches of 2, without a repeat).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

log = logging.getLogger("build_length_corpus")

ROOT = Path(__file__).resolve().parents[1]


def document_lengths(count: int, mean: float, cv: float, max_tokens: int, min_tokens: int,
                     seed: int) -> np.ndarray:
    """`count` lengths drawn lognormal with the given mean and CV, clipped to
    [min_tokens, max_tokens]."""
    if count < 1 or mean <= 0 or cv <= 0 or not 1 <= min_tokens <= max_tokens:
        raise ValueError(f"need documents >= 1, mean > 0, cv > 0 and 1 <= min <= max tokens; "
                         f"got {count}, {mean}, {cv}, {min_tokens}, {max_tokens}")
    sigma = math.sqrt(math.log1p(cv * cv))
    mu = math.log(mean) - sigma * sigma / 2
    draws = np.random.default_rng(seed).lognormal(mu, sigma, size=count)
    return np.clip(np.rint(draws), min_tokens, max_tokens).astype(np.int64)


def read_words(path: Path) -> list[str]:
    """The words of a JSON-lines text corpus ("text" fields), in order."""
    words = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                words.extend(json.loads(line)["text"].split())
    if not words:
        raise ValueError(f"{path}: no words in its \"text\" fields")
    return words


def word_token_counts(words: list[str], tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """Tokens of each word with a space before it, and without (a document's first word)."""
    unique = sorted(set(words))
    spaced = dict(zip(unique, map(len, tokenizer.tokenize_batch([" " + w for w in unique])),
                      strict=True))
    bare = dict(zip(unique, map(len, tokenizer.tokenize_batch(unique)), strict=True))
    return (np.array([spaced[w] for w in words], dtype=np.int64),
            np.array([bare[w] for w in words], dtype=np.int64))


def build_documents(words: list[str], spaced: np.ndarray, bare: np.ndarray,
                    lengths: np.ndarray, seed: int, eod: bool = True):
    """Yields (text, tokens) per drawn length: words from a random start while they fit in
    the length (one token kept for the end-of-document token when `eod`)."""
    rng = np.random.default_rng([seed, 1])
    starts = rng.integers(len(words), size=len(lengths))
    for target, start in zip(lengths, starts, strict=True):
        room = int(target) - (1 if eod else 0)
        position, chosen = int(start), []
        used = int(bare[position])
        while True:
            chosen.append(words[position])
            position = (position + 1) % len(words)
            if used + spaced[position] > room or len(chosen) == len(words):
                break
            used += int(spaced[position])
        yield " ".join(chosen), used + (1 if eod else 0)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", required=True, help="JSON-lines file to write")
    parser.add_argument("--documents", type=int, default=2000)
    parser.add_argument("--mean-tokens", type=float, default=1000.0)
    parser.add_argument("--cv", type=float, default=0.8)
    parser.add_argument("--max-tokens", type=int, default=2048)
    parser.add_argument("--min-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--text", default=str(ROOT / "datasets_gpt/dataset.json"),
                        help="JSON-lines text whose words are used")
    parser.add_argument("--vocab-file", default=str(ROOT / "datasets_gpt/vocab.json"))
    parser.add_argument("--merge-file", default=str(ROOT / "datasets_gpt/merges.txt"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    from megatron.trainer.data.documents import length_statistics
    from megatron.trainer.data.tokenizer import build_tokenizer

    tokenizer = build_tokenizer("GPT2BPETokenizer", vocab_file=args.vocab_file,
                                merge_file=args.merge_file)
    words = read_words(Path(args.text))
    spaced, bare = word_token_counts(words, tokenizer)
    lengths = document_lengths(args.documents, args.mean_tokens, args.cv, args.max_tokens,
                               args.min_tokens, args.seed)
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    written = []
    partial = output.with_name(output.name + ".partial")
    with open(partial, "w", encoding="utf-8") as handle:
        for text, tokens in build_documents(words, spaced, bare, lengths, args.seed):
            handle.write(json.dumps({"text": text}) + "\n")
            written.append(tokens)
    partial.replace(output)
    for name, values in (("drawn", lengths), ("written", written)):
        stats = length_statistics(values)
        log.info("%s: %d documents, mean %.1f tokens, cv %.3f, min %d, p50 %d, p90 %d, max %d",
                 name, len(values), stats["mean"], stats["cv"], stats["min"], stats["p50"],
                 stats["p90"], stats["max"])
    log.info("wrote %s (%d tokens with end-of-document tokens)", output, sum(written))


if __name__ == "__main__":
    main()
