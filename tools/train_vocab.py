"""Trains a tokenizer vocabulary on a JSON-lines file with HF `tokenizers`.

wordpiece: a BERT vocab.txt with [PAD] [UNK] [CLS] [SEP] [MASK] first (for BertWordPiece*).
bpe: a GPT-2 style byte-level vocab.json + merges.txt with <|endoftext|> (for GPT2BPETokenizer).

    python tools/train_vocab.py --input datasets_bert/dataset.json --kind wordpiece \
        --lower-case --vocab-size 8192 --output-dir datasets_bert
"""

import argparse
import json
import logging
import os
import sys

logger = logging.getLogger("train_vocab")

BERT_SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
GPT2_EOD_TOKEN = "<|endoftext|>"


def iter_texts(path: str, json_keys: list[str]):
    with open(path, encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                yield from (record[key] for key in json_keys)
            except (json.JSONDecodeError, KeyError, TypeError) as error:
                raise ValueError(f"{path}:{line_number}: {error!r}") from None


def train_wordpiece(texts, vocab_size: int, lower_case: bool, output_dir: str) -> str:
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=lower_case)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size, special_tokens=BERT_SPECIAL_TOKENS, min_frequency=2
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    vocab = tokenizer.get_vocab()
    path = os.path.join(output_dir, "vocab.txt")
    with open(path, "w", encoding="utf-8") as out:
        for token, _ in sorted(vocab.items(), key=lambda item: item[1]):
            out.write(token + "\n")
    return path


def train_byte_level_bpe(texts, vocab_size: int, output_dir: str) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[GPT2_EOD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.model.save(output_dir)
    return os.path.join(output_dir, "vocab.json")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True, help="JSON-lines file of documents")
    parser.add_argument("--json-keys", nargs="+", default=["text"])
    parser.add_argument("--kind", choices=["wordpiece", "bpe"], required=True)
    parser.add_argument("--vocab-size", type=int, required=True)
    parser.add_argument("--lower-case", action="store_true", help="wordpiece: lowercase text")
    parser.add_argument("--output-dir", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    os.makedirs(args.output_dir, exist_ok=True)
    texts = iter_texts(args.input, args.json_keys)
    if args.kind == "wordpiece":
        path = train_wordpiece(texts, args.vocab_size, args.lower_case, args.output_dir)
    else:
        path = train_byte_level_bpe(texts, args.vocab_size, args.output_dir)
    logger.info("wrote %s", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
