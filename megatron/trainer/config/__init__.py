"""The flags: parsing, validation, typed configurations and the fast-path defaults; may import
data, checkpoint, kernels and core_compat."""
