"""The DPP settings and their defaults, in one torch-free place.

The trainer (`--dpp-max-inflight`, `--dpp-transport`, `--dpp-timeout`), the runtime
schedule, the simulator, tracing and the profiling tools all read the defaults from here,
so none of them keeps a copy.
"""

from __future__ import annotations

from dataclasses import dataclass

TRANSPORTS = ("auto", "torch", "shm", "rdma")


@dataclass(frozen=True)
class DppOptions:
    """slack: microbatches a stage may hold in flight beyond megatron-core's schedule (2:
    the knee of the simulator's grid, docs/benchmarks/simulator.md). transport: the
    backend choice per pipeline edge. timeout: seconds a stage waits for a peer before it
    raises, naming what it waited for. weight_slices: with the split backward, the parts
    each W runs in, each a decision of the policy (4: docs/benchmarks/simulator_split.md;
    8 gains 0.1 % more in the simulator, and each part is a task-loop step). defer_weights:
    with the split, place each W as ZB-H1 does, up to p - 1 backwards after its B, so that
    every stage holds up to stage 0's count of microbatches from F to W; off (the default),
    each W follows its own B and every stage holds what megatron-core's 1F1B holds there
    (plan.weight_delay, docs/benchmarks/). static: run the
    plan in order, each task once its input is here, never deviating (the static schedule
    on the same runtime, to compare the dynamic one with)."""

    slack: int = 2
    transport: str = "auto"
    timeout: float = 60.0
    weight_slices: int = 4
    defer_weights: bool = False
    static: bool = False

    def __post_init__(self):
        if self.slack < 0:
            raise ValueError(f"DPP slack must be >= 0, got {self.slack}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"DPP transport {self.transport!r}: choose one of "
                             f"{', '.join(TRANSPORTS)}")
        if self.timeout <= 0:
            raise ValueError(f"DPP timeout must be > 0 seconds, got {self.timeout}")
        if self.weight_slices < 1:
            raise ValueError(f"DPP weight_slices must be >= 1, got {self.weight_slices}")

    @classmethod
    def from_args(cls, args) -> DppOptions:
        """From the trainer's flags; a flag left unset (None) takes the default."""
        given = {"slack": getattr(args, "dpp_max_inflight", None),
                 "transport": getattr(args, "dpp_transport", None),
                 "timeout": getattr(args, "dpp_timeout", None),
                 "defer_weights": getattr(args, "dpp_defer_weights", None),
                 "static": getattr(args, "dpp_static", None)}
        return cls(**{name: value for name, value in given.items() if value is not None})


DEFAULTS = DppOptions()
