"""Tests of megatron/trainer, by its subpackages."""
