"""The training run: start-up, the loop, optimizer, failures, checks, timers, metrics and
profiling; may import config, checkpoint, data, model, kernels and core_compat."""
