"""The DPP settings and their defaults, in one torch-free place.

The trainer (`--dpp-max-inflight`, `--dpp-transport`, `--dpp-timeout`), the runtime
schedule, the simulator, tracing and the profiling tools all read the defaults from here,
so none of them keeps a copy.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

TRANSPORTS = ("auto", "torch", "shm", "rdma")
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(x|gib|gb|mib|mb)\s*$", re.IGNORECASE)
_UNITS = {"gb": 1e9, "gib": 2.0 ** 30, "mb": 1e6, "mib": 2.0 ** 20}


@dataclass(frozen=True)
class MemoryBudget:
    """The activations a stage may hold: `factor` times what megatron-core's 1F1B holds on
    its busiest stage, or `limit_bytes` on every stage."""

    factor: float | None = None
    limit_bytes: float | None = None

    def __post_init__(self):
        if (self.factor is None) == (self.limit_bytes is None):
            raise ValueError("a memory budget is a factor of 1F1B's busiest stage or a size")
        value = self.limit_bytes if self.factor is None else self.factor
        if value <= 0:
            raise ValueError(f"a memory budget must be > 0, got {value:g}")

    @classmethod
    def parse(cls, text: str) -> MemoryBudget:
        """'1.15x' (of 1F1B's busiest stage) or a size per stage: '12GB', '800MB', '2GiB'."""
        match = _SIZE.match(text)
        if not match:
            raise ValueError(f"memory budget {text!r}: expected a factor of 1F1B's busiest "
                             "stage (e.g. 1.15x) or activations per stage (e.g. 12GB, 800MB)")
        value, unit = float(match.group(1)), match.group(2).lower()
        if unit == "x":
            return cls(factor=value)
        return cls(limit_bytes=value * _UNITS[unit])

    def limit(self, busiest_1f1b_bytes: float) -> float:
        return self.limit_bytes if self.factor is None else self.factor * busiest_1f1b_bytes

    def describe(self) -> str:
        if self.factor is not None:
            return f"{self.factor:g}x 1F1B's busiest stage"
        return f"{self.limit_bytes / 1e6:.1f} MB a stage"


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
    on the same runtime, to compare the dynamic one with); None (with adaptive): choose
    between it and the dynamic rule from the measurements too. adaptive: choose the slack, at
    most `slack`, from what the first iterations measure (megatron/dpp/slack_choice.py);
    the trainer's default unless --dpp-max-inflight forces one. memory_budget: with
    adaptive, the activations a stage may hold (`MemoryBudget.parse`: '1.15x' of 1F1B's
    busiest stage, or '12GB' a stage); None: no cap beyond `slack`."""

    slack: int = 2
    transport: str = "auto"
    timeout: float = 60.0
    weight_slices: int = 4
    defer_weights: bool = False
    static: bool | None = False
    adaptive: bool = False
    memory_budget: str | None = None

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
        if self.static is None and not self.adaptive:
            raise ValueError("DPP chooses its rule (static None) only where it chooses its "
                             "slack (adaptive)")
        if self.memory_budget is not None:
            if not self.adaptive:
                raise ValueError("a DPP memory budget caps the slack DPP chooses; a forced "
                                 "slack (--dpp-max-inflight) takes none")
            MemoryBudget.parse(self.memory_budget)

    @property
    def budget(self) -> MemoryBudget | None:
        return None if self.memory_budget is None else MemoryBudget.parse(self.memory_budget)

    @classmethod
    def from_args(cls, args) -> DppOptions:
        """From the trainer's flags; a flag left unset (None) takes the default, and
        without --dpp-max-inflight the slack is chosen from measurements (`adaptive`), and
        so is the rule unless --dpp-static or --no-dpp-static gives it."""
        forced = getattr(args, "dpp_max_inflight", None)
        static = getattr(args, "dpp_static", None)
        given = {"slack": forced, "adaptive": forced is None,
                 "memory_budget": getattr(args, "dpp_memory_budget", None),
                 "transport": getattr(args, "dpp_transport", None),
                 "timeout": getattr(args, "dpp_timeout", None),
                 "defer_weights": getattr(args, "dpp_defer_weights", None),
                 "static": static}
        options = {name: value for name, value in given.items() if value is not None}
        if static is None and forced is None:
            options["static"] = None
        return cls(**options)


DEFAULTS = DppOptions()


def slack_flag_problems(slack: int | None, budget: str | None) -> list[str]:
    """What is wrong with --dpp-max-inflight and --dpp-memory-budget together, one line per
    problem (the trainer's validation and the Megatron-LM plugin's both ask)."""
    problems = []
    if slack is not None and slack < 0:
        problems.append(f"--dpp-max-inflight {slack} must be >= 0")
    if budget is not None:
        if slack is not None:
            problems.append(f"--dpp-memory-budget {budget} caps the slack DPP chooses; "
                            f"--dpp-max-inflight {slack} forces one: give one of them")
        try:
            MemoryBudget.parse(budget)
        except ValueError as error:
            problems.append(f"--dpp-memory-budget: {error}")
    return problems
