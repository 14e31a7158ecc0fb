"""Tests of megatron/trainer/run: the training loop, logs, profiler."""
