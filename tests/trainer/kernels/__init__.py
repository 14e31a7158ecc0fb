"""Tests of megatron/trainer/kernels: Triton and GEMM kernels, fused layers."""
