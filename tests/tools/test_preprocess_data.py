"""tools/preprocess_data.py: round trips through IndexedDataset, sentences, every bad input."""

import hashlib
import json
import logging
import os
import sys

import pytest

from tests import REPO as REPO_ROOT

sys.path.insert(0, str(REPO_ROOT))

from megatron.core.datasets.indexed_dataset import IndexedDataset  # noqa: E402

from megatron.trainer.data import tokenizer_record  # noqa: E402
from megatron.trainer.data.tokenizer import build_tokenizer  # noqa: E402
from tools.preprocess_data import PreprocessError, main, parse_args, preprocess  # noqa: E402

GPT_DIR = os.path.join(REPO_ROOT, "datasets_gpt")
BERT_DIR = os.path.join(REPO_ROOT, "datasets_bert")
GPT_FLAGS = [
    "--tokenizer-type", "GPT2BPETokenizer",
    "--vocab-file", os.path.join(GPT_DIR, "vocab.json"),
    "--merge-file", os.path.join(GPT_DIR, "merges.txt"),
]
BERT_FLAGS = [
    "--tokenizer-type", "BertWordPieceLowerCase",
    "--vocab-file", os.path.join(BERT_DIR, "vocab.txt"),
]
TEXTS = [
    "A first document.\nIt has two lines.",
    "Ünïcödé, 日本語 and an emoji 🎉 survive the round trip.",
    "  leading and trailing whitespace\t\n\n",
    "Quotes “curly” and \"straight\", and <|endoftext|> as plain text.",
    *(f"Document number {i}: the quick brown fox jumps over the lazy dog." for i in range(40)),
]


@pytest.fixture(scope="module")
def gpt2():
    return build_tokenizer(GPT_FLAGS[1], vocab_file=GPT_FLAGS[3], merge_file=GPT_FLAGS[5])


def write_lines(path, lines):
    with open(path, "wb") as handle:
        for line in lines:
            handle.write(line if isinstance(line, bytes) else line.encode("utf-8"))
            handle.write(b"\n")
    return str(path)


def json_line(text, key="text"):
    return json.dumps({key: text}, ensure_ascii=False)


def run(input_path, prefix, *flags):
    return preprocess(parse_args(["--input", input_path, "--output-prefix", str(prefix), *flags]))


def documents(prefix):
    """Each document of the dataset as a list of its sequences (token-id lists)."""
    dataset = IndexedDataset(prefix)
    bounds = dataset.document_indices
    return [
        [dataset[i].tolist() for i in range(bounds[d], bounds[d + 1])]
        for d in range(len(bounds) - 1)
    ]


@pytest.mark.parametrize("workers", [1, 2])
def test_gpt2_round_trip_with_eod(tmp_path, gpt2, workers):
    source = write_lines(tmp_path / "in.json", [json_line(text) for text in TEXTS])
    summary = run(source, tmp_path / "out", *GPT_FLAGS, "--append-eod",
                  "--workers", str(workers), "--chunk-bytes", "300")
    assert summary.outputs == [str(tmp_path / "out_text_document")]
    docs = documents(summary.outputs[0])
    assert len(docs) == len(TEXTS) == summary.documents
    for text, sequences in zip(TEXTS, docs, strict=True):
        assert len(sequences) == 1
        assert sequences[0][-1] == gpt2.eod
        assert gpt2.detokenize(sequences[0]) == text + "<|endoftext|>"
        assert gpt2.eod not in sequences[0][:-1]


def test_each_output_records_its_tokenizer(tmp_path):
    """The record the launch scripts read to train on the data without tokenizer settings:
    the type and each file's absolute path and SHA-256."""
    source = write_lines(tmp_path / "in.json", [json_line(text) for text in TEXTS])
    summary = run(source, tmp_path / "out", *GPT_FLAGS, "--json-keys", "text")
    (prefix,) = summary.outputs
    record = tokenizer_record.read(prefix)
    vocab, merges = os.path.abspath(GPT_FLAGS[3]), os.path.abspath(GPT_FLAGS[5])
    assert record == {
        "tokenizer_type": "GPT2BPETokenizer",
        "vocab_file": {"path": vocab, "sha256": tokenizer_record.file_digest(vocab)},
        "merge_file": {"path": merges, "sha256": tokenizer_record.file_digest(merges)}}
    with open(vocab, "rb") as stream:
        assert record["vocab_file"]["sha256"] == hashlib.sha256(stream.read()).hexdigest()


def test_gpt2_without_eod_and_several_keys(tmp_path, gpt2):
    lines = [json.dumps({"title": f"Title {i}", "body": text}) for i, text in enumerate(TEXTS)]
    source = write_lines(tmp_path / "in.json", lines)
    summary = run(source, tmp_path / "out", *GPT_FLAGS, "--json-keys", "title", "body")
    assert summary.outputs == [str(tmp_path / "out_title_document"),
                               str(tmp_path / "out_body_document")]
    titles, bodies = (documents(prefix) for prefix in summary.outputs)
    assert [gpt2.detokenize(doc[0]) for doc in titles] == [f"Title {i}" for i in range(len(TEXTS))]
    assert [gpt2.detokenize(doc[0]) for doc in bodies] == TEXTS


def test_bert_split_sentences_gives_sentences_within_documents(tmp_path):
    texts = [
        "The cat sat on the mat. The dog ran to the park. Birds fly south in winter.",
        "One sentence only here",
        "Mr. Smith went to Washington. He arrived on Monday.",
    ] * 5
    source = write_lines(tmp_path / "in.json", [json_line(text) for text in texts])
    summary = run(source, tmp_path / "out", *BERT_FLAGS, "--split-sentences")
    assert summary.outputs == [str(tmp_path / "out_text_sentence")]
    bert = build_tokenizer("BertWordPieceLowerCase", vocab_file=BERT_FLAGS[3])
    docs = documents(summary.outputs[0])
    assert len(docs) == len(texts)
    first = [bert.detokenize(sentence) for sentence in docs[0]]
    assert first == ["the cat sat on the mat.", "the dog ran to the park.",
                     "birds fly south in winter."]
    assert len(docs[1]) == 1
    assert [len(doc) for doc in docs] == [3, 1, 2] * 5


def test_punkt_parameters_learned_from_input_or_loaded_from_file(tmp_path):
    with open(os.path.join(BERT_DIR, "dataset.json"), encoding="utf-8") as handle:
        lines = [handle.readline().rstrip("\n") for _ in range(200)]
    source = write_lines(tmp_path / "in.json", lines)
    learned = run(source, tmp_path / "learned", *BERT_FLAGS, "--split-sentences",
                  "--punkt-train-on-input")
    shipped = run(source, tmp_path / "shipped", *BERT_FLAGS, "--split-sentences")
    learned_counts = [len(doc) for doc in documents(learned.outputs[0])]
    shipped_counts = [len(doc) for doc in documents(shipped.outputs[0])]
    assert len(learned_counts) == len(shipped_counts) == 200
    assert sum(count > 1 for count in learned_counts) > 100
    assert abs(sum(learned_counts) - sum(shipped_counts)) < 0.1 * sum(shipped_counts)

    broken = write_lines(tmp_path / "broken.json.gz", ["not gzip"])
    with pytest.raises(PreprocessError, match=r"--punkt-params: .*broken.json.gz: cannot load"):
        run(source, tmp_path / "out", *BERT_FLAGS, "--split-sentences", "--punkt-params", broken)


def test_sample_datasets_prepare_with_readme_commands(tmp_path, gpt2):
    gpt_prefix, bert_prefix = tmp_path / "gpt", tmp_path / "bert"
    assert main(["--input", os.path.join(GPT_DIR, "dataset.json"), "--output-prefix",
                 str(gpt_prefix), *GPT_FLAGS, "--append-eod", "--workers", "2"]) == 0
    with open(os.path.join(GPT_DIR, "dataset.json"), encoding="utf-8") as handle:
        first_text = json.loads(handle.readline())["text"]
    gpt_docs = documents(f"{gpt_prefix}_text_document")
    assert gpt2.detokenize(gpt_docs[0][0]) == first_text + "<|endoftext|>"
    assert len(gpt_docs) > 1000

    assert main(["--input", os.path.join(BERT_DIR, "dataset.json"), "--output-prefix",
                 str(bert_prefix), *BERT_FLAGS, "--split-sentences", "--workers", "2"]) == 0
    bert_docs = documents(f"{bert_prefix}_text_sentence")
    assert len(bert_docs) > 500
    assert sum(len(doc) > 1 for doc in bert_docs) > len(bert_docs) // 2


def output_files(directory):
    return sorted(name for name in os.listdir(directory) if not name.startswith("in"))


BAD_LINES = {
    "not JSON": (b'{"text": "unterminated', "not valid JSON"),
    "missing key": (json_line("x", key="body").encode(), "no key 'text' (keys: body)"),
    "not UTF-8": (b'{"text": "caf\xe9"}', "not UTF-8"),
    "not an object": (b'["text", "a list"]', "not a JSON object but list"),
    "not a string": (b'{"text": 42}', "key 'text' is int, not a string"),
}


@pytest.mark.parametrize("case", sorted(BAD_LINES))
def test_bad_line_stops_with_file_line_and_reason(tmp_path, case):
    bad_line, reason = BAD_LINES[case]
    source = write_lines(tmp_path / "in.json", [json_line("good one"), json_line("two"), bad_line])
    with pytest.raises(PreprocessError) as error:
        run(source, tmp_path / "out", *GPT_FLAGS, "--workers", "2")
    assert f"{source}:3: {reason}" in str(error.value)
    assert "--skip-bad-lines" in str(error.value)
    assert output_files(tmp_path) == [], "nothing may be left under final or temporary names"


def test_skip_bad_lines_counts_them(tmp_path, gpt2, caplog):
    lines = [json_line("kept 1")] + [line for line, _ in BAD_LINES.values()] + [json_line("kept 2")]
    source = write_lines(tmp_path / "in.json", lines)
    with caplog.at_level(logging.WARNING, logger="preprocess_data"):
        summary = run(source, tmp_path / "out", *GPT_FLAGS, "--skip-bad-lines")
    assert summary.bad_lines == len(BAD_LINES)
    assert summary.documents == 2
    assert f"{source}:2: not valid JSON" in caplog.text
    assert [gpt2.detokenize(doc[0]) for doc in documents(summary.outputs[0])] == ["kept 1",
                                                                                  "kept 2"]


def test_empty_documents_are_skipped_and_counted(tmp_path, gpt2):
    lines = [json_line("first"), json_line(""), json_line("  \n\t "), "", json_line("last")]
    source = write_lines(tmp_path / "in.json", lines)
    summary = run(source, tmp_path / "out", *GPT_FLAGS, "--append-eod")
    assert (summary.empty_documents, summary.blank_lines, summary.documents) == (2, 1, 4)
    docs = documents(summary.outputs[0])
    assert [gpt2.detokenize(doc[0]) for doc in docs] == ["first<|endoftext|>", "last<|endoftext|>"]


def test_missing_and_mismatched_vocab_files_are_named(tmp_path, caplog):
    source = write_lines(tmp_path / "in.json", [json_line("text")])
    missing = str(tmp_path / "gone.json")
    flags = ["--input", source, "--output-prefix", str(tmp_path / "out"),
             "--tokenizer-type", "GPT2BPETokenizer", "--merge-file", GPT_FLAGS[5]]
    with caplog.at_level(logging.ERROR, logger="preprocess_data"):
        assert main([*flags, "--vocab-file", missing]) == 1
    assert f"vocab file {missing}: no such file" in caplog.text

    merges = write_lines(tmp_path / "merges.txt", ["#version: 0.2", "Ġ t", "Ġt nosuchtoken"])
    with pytest.raises(PreprocessError, match=r"merges file .*merges.txt:3: token 'nosuchtoken'"):
        run(source, tmp_path / "out", "--tokenizer-type", "GPT2BPETokenizer",
            "--vocab-file", GPT_FLAGS[3], "--merge-file", merges)
    with pytest.raises(PreprocessError, match=r"--input .*absent.json: no such file"):
        run(str(tmp_path / "absent.json"), tmp_path / "out", *GPT_FLAGS)
    assert output_files(tmp_path) == ["merges.txt"]


def test_failed_run_leaves_previous_output_intact(tmp_path, gpt2):
    good = write_lines(tmp_path / "in_good.json", [json_line("previous output")])
    prefix = run(good, tmp_path / "out", *GPT_FLAGS).outputs[0]
    bad = write_lines(tmp_path / "in_bad.json", [json_line("new"), b"not json"])
    with pytest.raises(PreprocessError, match="in_bad.json:2: not valid JSON"):
        run(bad, tmp_path / "out", *GPT_FLAGS)
    assert output_files(tmp_path) == ["out_text_document.bin", "out_text_document.idx",
                                      "out_text_document.tokenizer.json"]
    assert gpt2.detokenize(documents(prefix)[0][0]) == "previous output"


def test_flags_are_checked(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--input", "x", "--output-prefix", "y", *GPT_FLAGS, "--workers", "0"])
    assert "--workers must be >= 1, got 0" in capsys.readouterr().err
    source = write_lines(tmp_path / "in.json", [json_line("text")])
    (tmp_path / "a-file").write_text("")
    with pytest.raises(PreprocessError, match="cannot create the directory .*a-file/dir"):
        run(source, tmp_path / "a-file" / "dir" / "out", *GPT_FLAGS)


def test_the_output_directory_is_made(tmp_path):
    source = write_lines(tmp_path / "in.json", [json_line("text")])
    run(source, tmp_path / "data" / "my", *GPT_FLAGS)
    assert (tmp_path / "data" / "my_text_document.idx").is_file()


def test_progress_lines_report_rates(tmp_path, caplog):
    source = write_lines(tmp_path / "in.json", [json_line(text) for text in TEXTS])
    with caplog.at_level(logging.INFO, logger="preprocess_data"):
        run(source, tmp_path / "out", *GPT_FLAGS, "--log-interval", "10", "--chunk-bytes", "200")
    progress = [r.getMessage() for r in caplog.records if r.getMessage().startswith("processed")]
    assert len(progress) >= 3
    assert all("docs/s" in line and "MB/s" in line for line in progress)


@pytest.fixture
def single_process_group(tmp_path):
    """megatron.core's BERT dataset asks torch.distributed for its rank while building."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_outputs_feed_megatron_core_gpt_and_bert_datasets(tmp_path, gpt2, single_process_group):
    from megatron.core.datasets.bert_dataset import (
        BERTMaskedWordPieceDataset,
        BERTMaskedWordPieceDatasetConfig,
    )
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    texts = [" ".join(f"Sentence {j} of document {i} has a few words in it." for j in range(6))
             for i in range(60)]
    source = write_lines(tmp_path / "in.json", [json_line(text) for text in texts])
    gpt_prefix = run(source, tmp_path / "gpt", *GPT_FLAGS, "--append-eod").outputs[0]
    bert_prefix = run(source, tmp_path / "bert", *BERT_FLAGS, "--split-sentences").outputs[0]
    common = dict(random_seed=1234, sequence_length=32, split="90,10,0",
                  path_to_cache=str(tmp_path / "cache"))

    gpt_config = GPTDatasetConfig(blend=([gpt_prefix], None), tokenizer=gpt2,
                                  reset_position_ids=False, reset_attention_mask=False,
                                  eod_mask_loss=False, **common)
    train, valid, _ = BlendedMegatronDatasetBuilder(GPTDataset, [8, 2, None], lambda: True,
                                                    gpt_config).build()
    sample = train[0]
    assert sample["tokens"].shape[0] == 32
    assert "Sentence" in gpt2.detokenize(sample["tokens"].tolist())

    bert = build_tokenizer("BertWordPieceLowerCase", vocab_file=BERT_FLAGS[3])
    bert_config = BERTMaskedWordPieceDatasetConfig(
        blend=([bert_prefix], None), tokenizer=bert, masking_probability=0.15,
        short_sequence_probability=0.1, masking_max_ngram=3, masking_do_full_word=True,
        masking_do_permutation=False, masking_use_longer_ngrams=False,
        masking_use_geometric_distribution=False, classification_head=True, **common)
    train, valid, _ = BlendedMegatronDatasetBuilder(BERTMaskedWordPieceDataset, [8, 2, None],
                                                    lambda: True, bert_config).build()
    sample = train[0]
    assert sample["text"][0] == bert.cls
    assert list(sample["text"]).count(bert.sep) == 2
