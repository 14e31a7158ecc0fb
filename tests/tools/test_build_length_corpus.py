"""tools/build_length_corpus.py at a tiny size: its documents, tokenized by
tools/preprocess_data.py, have the token counts it planned (within the drawn lengths, short
of them by less than a word), and the drawn lengths follow the documented distribution."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from megatron.trainer.data.documents import document_lengths
from megatron.trainer.data.tokenizer import build_tokenizer
from tests import REPO as ROOT
from tools.build_length_corpus import (
    build_documents,
    read_words,
    word_token_counts,
)
from tools.build_length_corpus import (
    document_lengths as drawn_lengths,
)

DOCUMENTS, MEAN, CV, MAX, SEED = 30, 200.0, 0.8, 400, 4


def test_tiny_corpus_has_the_planned_token_counts(tmp_path):
    corpus = tmp_path / "corpus.json"
    subprocess.run([sys.executable, "tools/build_length_corpus.py", "--output", str(corpus),
                    "--documents", str(DOCUMENTS), "--mean-tokens", str(MEAN), "--cv", str(CV),
                    "--max-tokens", str(MAX), "--seed", str(SEED)],
                   cwd=ROOT, check=True, capture_output=True)
    subprocess.run([sys.executable, "tools/preprocess_data.py", "--input", str(corpus),
                    "--output-prefix", str(tmp_path / "corpus"), "--tokenizer-type",
                    "GPT2BPETokenizer", "--vocab-file", "datasets_gpt/vocab.json",
                    "--merge-file", "datasets_gpt/merges.txt", "--append-eod", "--workers", "1"],
                   cwd=ROOT, check=True, capture_output=True)
    tokenized = document_lengths(str(tmp_path / "corpus_text_document"))
    drawn = drawn_lengths(DOCUMENTS, MEAN, CV, MAX, 16, SEED)
    tokenizer = build_tokenizer("GPT2BPETokenizer", vocab_file=str(ROOT / "datasets_gpt/vocab.json"),
                                merge_file=str(ROOT / "datasets_gpt/merges.txt"))
    words = read_words(ROOT / "datasets_gpt/dataset.json")
    spaced, bare = word_token_counts(words, tokenizer)
    planned = [tokens for _, tokens in build_documents(words, spaced, bare, drawn, SEED)]
    assert list(tokenized) == planned  # a document's tokens are its words' tokens, + EOD
    assert np.all(tokenized <= drawn) and np.all(drawn - tokenized < spaced.max())
    assert len(set(corpus.read_text().splitlines())) == DOCUMENTS  # no document twice


def test_drawn_lengths_follow_the_lognormal_before_the_cut():
    """Without a binding cut the draws have the asked mean and CV; the cut clips to it."""
    free = drawn_lengths(20000, 1000.0, 0.8, 10**9, 1, 0)
    assert free.mean() == pytest.approx(1000, rel=0.03)
    assert free.std() / free.mean() == pytest.approx(0.8, rel=0.05)
    cut = drawn_lengths(20000, 1000.0, 0.8, 2048, 16, 0)
    assert cut.max() == 2048 and cut.min() >= 16
    assert np.array_equal(cut, np.clip(free, 16, 2048))
    with pytest.raises(ValueError, match="mean > 0"):
        drawn_lengths(10, -1.0, 0.8, 2048, 16, 0)
