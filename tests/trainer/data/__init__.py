"""Tests of megatron/trainer/data: datasets, tokenizers, microbatches, variable lengths."""
