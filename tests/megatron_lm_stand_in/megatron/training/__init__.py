"""A minimal stand-in for Megatron-LM's trainer (megatron.training) where megatron-core < 0.17
ships none: only the hooks the DPP plugin uses, in Megatron-LM's shape (read, not copied)."""
