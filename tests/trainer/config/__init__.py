"""Tests of megatron/trainer/config: flags, validation, typed configurations."""
