"""Tests of megatron/trainer/core_compat: megatron-core adaptation."""
