"""Tests of megatron/trainer/checkpoint: save, load, checkpoint arguments."""
