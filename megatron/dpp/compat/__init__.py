"""The megatron-core internals both layers rely on, declared and checked in one place
(core_internals.py): megatron/dpp's own, and the machinery the trainer declares its own with
(megatron/trainer/core_compat/core_overrides.py). Imports megatron-core and the standard
library only, no other project module, so megatron/dpp and megatron/trainer may both use it
without one depending on the other."""
