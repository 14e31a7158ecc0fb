#!/usr/bin/env bash
# Tokenizes datasets_gpt/dataset.json into datasets_gpt/gpt_text_document.{bin,idx} once;
# --force redoes it. Train with --data-path datasets_gpt/gpt_text_document.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ "${1:-}" != "--force" && -f datasets_gpt/gpt_text_document.idx ]]; then
    exit 0
fi
"${PYTHON:-python}" tools/preprocess_data.py \
    --input datasets_gpt/dataset.json \
    --output-prefix datasets_gpt/gpt \
    --tokenizer-type GPT2BPETokenizer \
    --vocab-file datasets_gpt/vocab.json \
    --merge-file datasets_gpt/merges.txt \
    --append-eod --workers 2
