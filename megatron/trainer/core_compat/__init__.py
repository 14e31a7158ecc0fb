"""megatron-core adaptation: the declared internals (core_overrides), the CPU compatibility
layer, apex stand-ins, the rerun state machine; imports megatron.dpp and megatron-core only,
no other trainer subpackage."""
