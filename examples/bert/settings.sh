# BERT settings, sourced by examples/launch_common.sh: the entry point, the sample data and
# the model sizes; MODEL_SIZE=<name> picks a size.
# Columns: layers hidden heads seq-length. NUM_LAYERS, HIDDEN_SIZE, NUM_HEADS, SEQ_LENGTH
# override single values.
#   tiny   the CPU default: runs in about a minute on 2 cores
#   seed   the GPU default: the size of the original DPP examples (BERT-large: 24 layers,
#          hidden 1024, seq 512)
#   base   BERT-base (12 layers, hidden 768)
model_preset() {
    case "$1" in
        tiny) echo "4 128 4 128" ;;
        seed) echo "24 1024 16 512" ;;
        base) echo "12 768 12 512" ;;
        *) return 1 ;;
    esac
}
MODEL_PRESETS="tiny seed base"

MODEL_ENTRY=pretrain_bert.py
# --split for the sample data: 5 % each for validation and test give each split a few
# samples even at the GPU size's 2,048-token sequences (Megatron's 969,30,1 leaves the test
# split less than one)
SAMPLE_SPLIT=90,5,5
SAMPLE_DIR=datasets_bert
SAMPLE_PREFIX=datasets_bert/bert_text_sentence
SAMPLE_TOKENIZER=BertWordPieceLowerCase
SAMPLE_VOCAB=datasets_bert/vocab.txt
SAMPLE_MERGES=
# micro-batch size on GPUs (CPU: 2)
GPU_MICRO_BATCH=8
