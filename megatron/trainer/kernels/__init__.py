"""Compute that replaces megatron-core's: Triton and GEMM-epilogue kernels, fused layers, torch
norms, the _gemm_epilogues extension; may import core_compat only."""
