"""DPP's in-flight slack, chosen from what the first iterations measured.

Pure Python (no torch): the runtime (megatron/dpp/slack_measurement.py) measures each
virtual stage's task times, each pipeline edge's message time (send to usable) and the
activations a microbatch leaves on each rank, and one rank calls `choose_slack`. It runs
the simulator's engine on those numbers with the policy the runtime runs (dynamic or
`static`) at each slack from 0 to `max_slack` and takes the smallest slack whose simulated
iteration is within `tolerance` of the fastest: extra slack costs activation memory, so it
is taken only where it buys time (a hop of a few forwards, task costs that stray from their
medians: stragglers, a noisy machine; a calm pipeline gets 0). A
`MemoryBudget` caps the slack first: at slack s a rank holds its static plan's count of
microbatches plus s (`GreedyPolicy.cap`), and every rank must stay within the budget.

Where CPU ranks outnumber their cores (`Measured.shared_cores`) the simulator shares that
many cores among the pipeline's ranks, and a task's time beyond its median is a wait that
takes none (a straggler's sleep): what one rank fills in its bubble, the rank beside it on
the same core loses. With the split backward a W straggles with its B, and the dynamic rule
orders its pending W tasks as the runtime does (`weights_by_backward`).

With the rule left open (`static=None`) it simulates the plan in order at each slack too
and takes the first of (slack 0, the plan in order), (slack 0, the dynamic rule), (slack 1,
the plan in order), ... within `tolerance` of the fastest of them all: the least memory,
and the plan in order where the dynamic rule's deviations buy less than that (they cost
what the simulator does not see, a decision's host time). Two choices made one after the
other, each within the tolerance, could together end twice as far from the fastest.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass

from megatron.dpp.actions import BACKWARD, FORWARD, WEIGHT
from megatron.dpp.config import MemoryBudget
from megatron.dpp.plan import StageConfig, static_peak
from megatron.dpp.policy import GreedyPolicy
from megatron.dpp.sim.simulator import Durations, simulate

# simulated iteration within this share of the fastest candidate's: the smallest slack wins
SLACK_TOLERANCE = 0.01
# with a measured cost spread, each slack's time is the mean over this many simulated
# iterations whose task times are drawn from it (seeded: every decision is reproducible)
SPREAD_TRIALS = 8


@dataclass(frozen=True)
class Measured:
    """What the first iterations measured. Task times per virtual stage (ms, medians; with
    the split backward `backward_ms` is B's and `weight_ms` W's). `hop_ms[e]`: the message
    time on the edge between pipeline ranks e and e + 1 (the last entry, e = p - 1: from the
    last rank back to rank 0, used by virtual chunks). `activation_bytes[r]`: what one
    microbatch leaves on rank r from its forward to its release (all its chunks); None when
    not measured (every rank then counts alike)."""

    forward_ms: tuple[float, ...]
    backward_ms: tuple[float, ...]
    hop_ms: tuple[float, ...]
    weight_ms: tuple[float, ...] | None = None
    activation_bytes: tuple[float, ...] | None = None
    # each measured F / B over its kind's median (None: every task at its median); a
    # straggling stage or a noisy machine shows here, and slack pays only under such spread
    cost_spread: tuple[float, ...] | None = None
    # the cores the pipeline's ranks share where CPU ranks outnumber them (None: a
    # processor each)
    shared_cores: float | None = None


@dataclass(frozen=True)
class SlackChoice:
    slack: int
    simulated_ms: dict[int, float]  # simulated iteration per slack within the budget
    hop_ms: float  # the slowest edge's
    forward_ms: float  # median over the virtual stages
    held_bytes: tuple[float, ...] | None  # per rank at the chosen slack
    busiest_1f1b_bytes: float | None
    budget: MemoryBudget | None
    max_slack: int
    static: bool  # the rule that runs: the plan in order, else the dynamic rule
    spread_p95: float | None = None  # the 95th percentile of the measured cost spread
    shared_cores: float | None = None  # as Measured's
    # rule left open: the plan in order's simulated iteration per slack (simulated_ms is
    # then the dynamic rule's; None: the rule was given)
    plan_ms: dict[int, float] | None = None
    weights_by_backward: bool = False  # the dynamic rule runs pending W shortest B first

    @property
    def rule_gain(self) -> float | None:
        """Rule left open: the plan in order's simulated iteration over the dynamic rule's
        at the chosen slack (None: the rule was given)."""
        if self.plan_ms is None:
            return None
        return self.plan_ms[self.slack] / self.simulated_ms[self.slack]

    def line(self) -> str:
        """One log line: the choice and why."""
        slacks = sorted(self.simulated_ms)
        base = self.simulated_ms[slacks[0]]

        def speedups(times: dict[int, float]) -> str:
            return "/".join(f"{base / times[s]:.2f}" for s in slacks)

        dynamic = "the dynamic rule" + (" (W tasks shortest B first)"
                                        if self.weights_by_backward else "")
        if self.plan_ms is None:
            rule = dynamic if not self.static else "the plan in order"
            simulated = f"{rule} {speedups(self.simulated_ms)}"
            smallest = "the smallest slack"
        else:
            simulated = (f"{dynamic} {speedups(self.simulated_ms)}, "
                         f"the plan in order {speedups(self.plan_ms)}")
            smallest = "the smallest slack, and there the plan in order before the dynamic rule,"
        forwards = (f"{self.hop_ms / self.forward_ms:.1f}" if self.forward_ms > 0
                    else "?")
        text = (f"DPP slack {self.slack}: measured hop {self.hop_ms:.1f} ms = "
                f"{forwards} forwards ({self.forward_ms:.1f} ms); "
                + (f"task costs up to {self.spread_p95:.2f}x their median (p95); "
                   if self.spread_p95 is not None else "")
                + (f"on {self.shared_cores:g} core{'' if self.shared_cores == 1 else 's'} "
                   "shared by the ranks, " if self.shared_cores is not None else "")
                + f"simulated speedup at slack {'/'.join(map(str, slacks))}: {simulated} "
                f"({smallest} within {100 * SLACK_TOLERANCE:g} % of the fastest)")
        if self.rule_gain is not None:
            text += (f"; the dynamic rule simulated {self.rule_gain:.3f}x the plan in order "
                     f"there: {'the plan in order' if self.static else 'the dynamic rule'} "
                     "runs")
        if self.held_bytes is not None:
            held = "/".join(f"{b / 1e6:.1f}" for b in self.held_bytes)
            text += (f"; activations held per stage {held} MB, 1F1B's busiest stage "
                     f"{self.busiest_1f1b_bytes / 1e6:.1f} MB")
        if self.budget is not None:
            text += f", budget {self.budget.describe()}"
            if slacks[-1] < self.max_slack:
                text += f" (caps the slack at {slacks[-1]})"
        return text


def _stages(pp_size: int, num_microbatches: int, slack: int, num_chunks: int,
            split_backward: bool, defer_weights: bool) -> list[StageConfig]:
    return [StageConfig(r, pp_size, num_chunks, num_microbatches, slack=slack,
                        split_backward=split_backward, defer_weights=defer_weights)
            for r in range(pp_size)]


def held_bytes(measured: Measured, pp_size: int, num_microbatches: int, slack: int,
               num_chunks: int = 1, split_backward: bool = False,
               defer_weights: bool = False) -> list[float]:
    """Per rank: the most activation bytes the policy lets it hold at this slack."""
    per_rank = measured.activation_bytes or (1.0,) * pp_size
    return [GreedyPolicy(stage).cap * per_rank[stage.rank] / num_chunks
            for stage in _stages(pp_size, num_microbatches, slack, num_chunks,
                                 split_backward, defer_weights)]


def busiest_1f1b_bytes(measured: Measured, pp_size: int, num_microbatches: int,
                       num_chunks: int = 1) -> float:
    """What megatron-core's 1F1B (interleaved with chunks) holds on its busiest stage."""
    per_rank = measured.activation_bytes or (1.0,) * pp_size
    return max(static_peak(StageConfig(r, pp_size, num_chunks, num_microbatches))
               * per_rank[r] / num_chunks for r in range(pp_size))


def choose_slack(measured: Measured, pp_size: int, num_microbatches: int, *,
                 num_chunks: int = 1, split_backward: bool = False,
                 defer_weights: bool = False, weight_slices: int = 1,
                 weights_by_backward: bool = False, static: bool | None = False,
                 max_slack: int = 2, budget: MemoryBudget | None = None) -> SlackChoice:
    """The slack to run, with the rule `static` says (None: the rule as well; the module
    docstring). `weights_by_backward`: the dynamic rule runs its pending W tasks shortest B
    first, as the runtime does where no GPU runs them later (StageConfig)."""
    p, m, chunks = pp_size, num_microbatches, num_chunks
    by_backward = weights_by_backward and split_backward
    stages = p * chunks
    if len(measured.forward_ms) != stages or len(measured.backward_ms) != stages:
        raise ValueError(f"measured task times for {len(measured.forward_ms)} virtual stages, "
                         f"the pipeline has {stages}")
    if len(measured.hop_ms) != p:
        raise ValueError(f"measured {len(measured.hop_ms)} edge times for {p} ranks")
    if split_backward and measured.weight_ms is None:
        raise ValueError("the split backward needs measured W times")
    if budget is not None and budget.limit_bytes is not None and not measured.activation_bytes:
        raise ValueError("a memory budget in bytes needs measured activation bytes")
    if max_slack < 0:
        raise ValueError(f"max_slack must be >= 0, got {max_slack}")
    busiest = busiest_1f1b_bytes(measured, p, m, chunks)
    allowed = [0]
    for slack in range(1, max_slack + 1):
        held = held_bytes(measured, p, m, slack, chunks, split_backward, defer_weights)
        if budget is not None and max(held) > budget.limit(busiest) * (1 + 1e-9):
            break
        allowed.append(slack)
    trials = [_durations(measured, m, random.Random(seed) if measured.cost_spread else None)
              for seed in range(SPREAD_TRIALS if measured.cost_spread else 1)]
    latency = _edge_latency(measured.hop_ms, p)

    def simulated_ms(schedule: str, slack: int) -> float:
        return statistics.fmean(simulate(
            schedule, p, m, durations, num_chunks=chunks, slack=slack, latency=latency,
            split_backward=split_backward, weight_slices=weight_slices if split_backward else 1,
            defer_weights=defer_weights, cores=measured.shared_cores,
            weights_by_backward=by_backward).makespan
            for durations in trials)

    simulated = {slack: simulated_ms("dpp-static" if static else "dpp", slack)
                 for slack in allowed}
    plans = None
    if static is None:
        plans = {slack: simulated_ms("dpp-static", slack) for slack in allowed}
        within = (1 + SLACK_TOLERANCE) * min(*simulated.values(), *plans.values())
        slack, static = next((s, plan) for s in allowed for plan in (True, False)
                             if (plans if plan else simulated)[s] <= within)
    else:
        fastest = min(simulated.values())
        slack = min(s for s, t in simulated.items() if t <= fastest * (1 + SLACK_TOLERANCE))
    measured_bytes = measured.activation_bytes is not None
    return SlackChoice(
        slack, simulated, max(measured.hop_ms), statistics.median(measured.forward_ms),
        tuple(held_bytes(measured, p, m, slack, chunks, split_backward, defer_weights))
        if measured_bytes else None,
        busiest if measured_bytes else None, budget, max_slack, static,
        quantile(measured.cost_spread, 0.95) if measured.cost_spread else None,
        measured.shared_cores, plans, by_backward)


def quantile(values, share: float) -> float:
    """The value `share` of the way up the sorted values (0.95: the 95th percentile)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def _durations(measured: Measured, m: int, rng: random.Random | None) -> Durations:
    """Every task at its stage's median, each F and B scaled by a draw from the measured
    spread where `rng` is given, and each W by its B's draw (the same work straggles, as
    megatron/dpp/variability.py draws it); what a draw adds beyond the median is the task's
    stretch (a wait where the cores are shared)."""
    stretch: dict[str, list[list[float]]] = {}

    def draws() -> list[float]:
        return [1.0] * m if rng is None else [rng.choice(measured.cost_spread)
                                              for _ in range(m)]

    def row(kind: str, median: float, factors: list[float]) -> list[float]:
        stretch.setdefault(kind, []).append([median * max(0.0, f - 1) for f in factors])
        return [median * f for f in factors]

    forward = [row(FORWARD, t, draws()) for t in measured.forward_ms]
    backward_draws = [draws() for _ in measured.backward_ms]
    backward = [row(BACKWARD, t, factors)
                for t, factors in zip(measured.backward_ms, backward_draws, strict=True)]
    weight = None if measured.weight_ms is None else [
        row(WEIGHT, t, factors)
        for t, factors in zip(measured.weight_ms, backward_draws, strict=True)]
    return Durations(forward, backward, [1.0] * m, weight, stretch)


def _edge_latency(hop_ms: tuple[float, ...], pp_size: int):
    """The engine's latency function: the measured time of the edge a message crosses."""

    def latency(src: int, dst: int, task) -> float:
        low, high = min(src, dst), max(src, dst)
        if high - low == 1:
            return hop_ms[low]
        return hop_ms[pp_size - 1]  # between the last rank and rank 0 (virtual chunks)

    return latency
