"""Tests of megatron/trainer/model: the layer spec, MLA, CUDA graphs."""
