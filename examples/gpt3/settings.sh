# GPT settings, sourced by examples/launch_common.sh: the entry point, the sample data and
# the model sizes; MODEL_SIZE=<name> picks a size.
# Columns: layers hidden heads seq-length. NUM_LAYERS, HIDDEN_SIZE, NUM_HEADS, SEQ_LENGTH
# override single values.
#   tiny   the CPU default: runs in about a minute on 2 cores
#   seed   the GPU default: the size of the original DPP examples (16 layers, hidden 2048)
#   gpu-md the benchmark GPT of the trainer issue (24 layers, hidden 2048, seq 2048)
#   345m, 857m, 175b  the configurations listed in Megatron-LM's GPT guide
#          (its examples/gpt3/README.md)
model_preset() {
    case "$1" in
        tiny)   echo "4 128 4 128" ;;
        seed)   echo "16 2048 16 2048" ;;
        gpu-md) echo "24 2048 16 2048" ;;
        345m)   echo "12 512 8 1024" ;;
        857m)   echo "24 1024 16 2048" ;;
        175b)   echo "96 12288 96 2048" ;;
        *) return 1 ;;
    esac
}
MODEL_PRESETS="tiny seed gpu-md 345m 857m 175b"

MODEL_ENTRY=pretrain_gpt.py
# --split for the sample data: 5 % each for validation and test give each split a few
# samples even at the GPU size's 2,048-token sequences (Megatron's 969,30,1 leaves the test
# split less than one)
SAMPLE_SPLIT=90,5,5
SAMPLE_DIR=datasets_gpt
SAMPLE_PREFIX=datasets_gpt/gpt_text_document
SAMPLE_TOKENIZER=GPT2BPETokenizer
SAMPLE_VOCAB=datasets_gpt/vocab.json
SAMPLE_MERGES=datasets_gpt/merges.txt
# micro-batch size on GPUs (CPU: 2)
GPU_MICRO_BATCH=2
