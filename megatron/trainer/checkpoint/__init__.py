"""Saving and loading checkpoints and the arguments stored in them; may import core_compat."""
