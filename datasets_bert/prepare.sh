#!/usr/bin/env bash
# Tokenizes datasets_bert/dataset.json into datasets_bert/bert_text_sentence.{bin,idx} once;
# --force redoes it. Train with --data-path datasets_bert/bert_text_sentence.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ "${1:-}" != "--force" && -f datasets_bert/bert_text_sentence.idx ]]; then
    exit 0
fi
"${PYTHON:-python}" tools/preprocess_data.py \
    --input datasets_bert/dataset.json \
    --output-prefix datasets_bert/bert \
    --tokenizer-type BertWordPieceLowerCase \
    --vocab-file datasets_bert/vocab.txt \
    --split-sentences --workers 2
