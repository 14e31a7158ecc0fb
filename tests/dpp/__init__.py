"""Tests of megatron/dpp: the schedule, its plans, policy, simulator, transport and the B/W split."""
