"""megatron.trainer.data.tokenizer: shipped vocabularies, every tokenizer type, file errors."""

import importlib.util
import json
import os
import sys

import pytest

from tests import REPO as REPO_ROOT

sys.path.insert(0, str(REPO_ROOT))

from megatron.trainer.data.tokenizer import (  # noqa: E402
    GPT2BPETokenizer,
    TokenizerError,
    TokenizerFileError,
    _HFBackedTokenizer,
    build_tokenizer,
)

GPT_DIR = os.path.join(REPO_ROOT, "datasets_gpt")
BERT_DIR = os.path.join(REPO_ROOT, "datasets_bert")
GPT_VOCAB = os.path.join(GPT_DIR, "vocab.json")
GPT_MERGES = os.path.join(GPT_DIR, "merges.txt")
BERT_VOCAB = os.path.join(BERT_DIR, "vocab.txt")
TRICKY_TEXT = (
    "Hello world!  Two  spaces,\ttabs,\n\nblank lines, trailing space \n"
    "ünïcödé, 日本語, emoji 🎉, quotes “like this” and <|endoftext|> as plain text."
)


@pytest.fixture(scope="module")
def gpt2():
    return build_tokenizer("GPT2BPETokenizer", vocab_file=GPT_VOCAB, merge_file=GPT_MERGES)


@pytest.fixture(scope="module")
def bert():
    return build_tokenizer("BertWordPieceLowerCase", vocab_file=BERT_VOCAB)


def sample_texts(path, count):
    with open(path, encoding="utf-8") as handle:
        return [json.loads(next(handle))["text"] for _ in range(count)]


def test_gpt2_files_are_gpt2s_vocabulary(gpt2):
    # Reference ids of GPT-2's published encoder for these strings.
    assert gpt2.tokenize("Hello world") == [15496, 995]
    assert gpt2.tokenize(" the") == [262]
    assert gpt2.vocab_size == 50257
    assert gpt2.eod == 50256
    assert gpt2.inv_vocab[gpt2.eod] == "<|endoftext|>"


def test_gpt2_round_trip_is_exact(gpt2):
    ids = gpt2.tokenize(TRICKY_TEXT)
    assert gpt2.eod not in ids, "<|endoftext|> in text must not become the EOD id"
    assert gpt2.detokenize(ids) == TRICKY_TEXT
    assert gpt2.detokenize([*ids, gpt2.eod]) == TRICKY_TEXT + "<|endoftext|>"


@pytest.mark.skipif(importlib.util.find_spec("tiktoken") is None, reason="tiktoken not installed")
def test_gpt2_tiktoken_engine_matches_hf_tokenizers(gpt2):
    assert gpt2.engine == "tiktoken"
    texts = [TRICKY_TEXT, *sample_texts(os.path.join(GPT_DIR, "dataset.json"), 300)]
    assert gpt2.tokenize_batch(texts) == _HFBackedTokenizer.tokenize_batch(gpt2, texts)


def test_gpt2_works_as_megatron_core_dataset_tokenizer(gpt2):
    identifiers = gpt2.unique_identifiers
    assert identifiers["tokenizer_type"] == "GPT2BPETokenizer"
    assert identifiers["vocab_file"] == GPT_VOCAB
    json.dumps(identifiers)
    with pytest.raises(NotImplementedError, match="padding"):
        gpt2.pad  # noqa: B018 - megatron.core falls back to its own pad id on this error


def test_bert_wordpiece_special_tokens_and_lower_case(bert):
    vocab = bert.vocab
    assert (bert.pad, bert.cls, bert.sep, bert.mask) == (
        vocab["[PAD]"], vocab["[CLS]"], vocab["[SEP]"], vocab["[MASK]"]
    )
    assert bert.eod == bert.sep
    assert bert.vocab_size == len(vocab) == sum(1 for _ in open(BERT_VOCAB, encoding="utf-8"))
    ids = bert.tokenize("The Devil's Dictionary, by Ambrose Bierce.")
    assert bert.detokenize(ids).replace(" ' ", "'") == "the devil's dictionary, by ambrose bierce."
    assert all(bert.inv_vocab[i] in vocab for i in ids)


def test_bert_cased_keeps_case():
    cased = build_tokenizer("BertWordPieceCase", vocab_file=BERT_VOCAB)
    assert cased.tokenize("Hello") != cased.tokenize("hello")


def test_null_tokenizer_needs_no_files():
    null = build_tokenizer("NullTokenizer", vocab_size=100)
    assert null.vocab_size == 100
    assert null.eod == 99
    assert null.tokenize("1 2 98") == [1, 2, 98]
    assert null.detokenize([1, 2, 98]) == "1 2 98"
    with pytest.raises(ValueError, match="'100' is not a token id"):
        null.tokenize("1 100")


def test_huggingface_tokenizer_json(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    model = Tokenizer(models.BPE(unk_token="<unk>"))
    model.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>", "</s>"])
    model.train_from_iterator(["the cat sat on the mat", "the dog sat on the log"], trainer)
    model.save(str(tmp_path / "tokenizer.json"))

    for path in (tmp_path, tmp_path / "tokenizer.json"):
        hf = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(path))
        assert hf.eod == hf.vocab["</s>"]
        assert hf.detokenize(hf.tokenize("the cat sat")) == "the cat sat"
    with pytest.raises(TokenizerFileError, match="missing.json"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "missing.json"))


def test_sentencepiece_model(tmp_path):
    """A model trained here on the sample text: ids round-trip, EOD is its </s>, a piece
    it lacks (padding) is an error naming it, a file that is no model is named."""
    import sentencepiece

    model = tmp_path / "m.model"
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(sample_texts(os.path.join(GPT_DIR, "dataset.json"), 200)),
        model_prefix=str(tmp_path / "m"), vocab_size=300, model_type="bpe", minloglevel=2)
    tokenizer = build_tokenizer("SentencePieceTokenizer", tokenizer_model=str(model))
    processor = sentencepiece.SentencePieceProcessor(model_file=str(model))
    assert tokenizer.vocab_size == len(tokenizer.vocab) == 300
    assert tokenizer.eod == tokenizer.vocab["</s>"] == processor.eos_id()
    assert tokenizer.bos == tokenizer.vocab["<s>"]
    text = "The Devil's Dictionary, by Ambrose Bierce."  # no runs of spaces to normalise
    ids = tokenizer.tokenize(text)
    assert ids == processor.encode(text) and len(ids) > 3
    assert tokenizer.detokenize(ids) == text
    with pytest.raises(NotImplementedError, match="padding"):
        tokenizer.pad  # noqa: B018
    (tmp_path / "bad.model").write_bytes(b"not a model")
    with pytest.raises(TokenizerFileError, match="bad.model: cannot load"):
        build_tokenizer("SentencePieceTokenizer", tokenizer_model=str(tmp_path / "bad.model"))


def test_sentencepiece_missing_package_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "sentencepiece", None)  # as if not installed
    with pytest.raises(TokenizerError, match="pip install sentencepiece"):
        build_tokenizer("SentencePieceTokenizer", tokenizer_model=str(tmp_path / "m.model"))


def test_missing_files_are_named(tmp_path):
    missing = str(tmp_path / "nope.json")
    with pytest.raises(TokenizerFileError, match="vocab file .*nope.json: no such file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=missing, merge_file=GPT_MERGES)
    with pytest.raises(TokenizerFileError, match="merges file .*nope.json: no such file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=GPT_VOCAB, merge_file=missing)
    with pytest.raises(TokenizerFileError, match="vocab file .*nope.json: no such file"):
        build_tokenizer("BertWordPieceLowerCase", vocab_file=missing)
    with pytest.raises(ValueError, match="GPT2BPETokenizer needs --merge-file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=GPT_VOCAB)


def test_mismatched_vocab_and_merges_are_named(tmp_path):
    merges = tmp_path / "merges.txt"
    merges.write_text("#version: 0.2\nĠ t\nq xyzzy_no_such_token\n", encoding="utf-8")
    with pytest.raises(TokenizerFileError,
                       match=r"merges.txt:3: token 'xyzzy_no_such_token' is not in vocab file"):
        GPT2BPETokenizer(GPT_VOCAB, str(merges))
    with pytest.raises(TokenizerFileError, match=r"vocab file .*vocab.txt: not a JSON vocabulary"):
        GPT2BPETokenizer(BERT_VOCAB, GPT_MERGES)
    with pytest.raises(TokenizerFileError, match=r"vocab.json: not a BERT WordPiece vocab"):
        build_tokenizer("BertWordPieceLowerCase", vocab_file=GPT_VOCAB)


def test_unknown_type_lists_the_known_ones():
    with pytest.raises(ValueError, match="GPT2BPETokenizer, BertWordPieceLowerCase"):
        build_tokenizer("Gpt2")
