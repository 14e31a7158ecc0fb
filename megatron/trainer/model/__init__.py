"""The model chunks on megatron-core's local layers (specs, attention, MLP, CUDA graphs of the
blocks); may import data (the shapes of the microbatches), kernels and core_compat."""
