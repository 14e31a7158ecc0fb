"""DPP against the best static schedules given the same information, at their memory: with
variable lengths (docs/variable_lengths.md) a static schedule can be fed DPP's cost order
too, so DPP must beat that, not plain 1F1B. Per pipeline depth and seed, the simulator's
cv cost model (a per-microbatch factor, standing for its token count, known before the
iteration) runs:

* plain 1F1B: megatron's natural microbatch order;
* 1F1B fed the cost order DPP runs (`policy.microbatch_order_for`);
* ZB-H1 fed the same order (B and W tasks);
* DPP with the split backward at the given slack (the runtime's rule, token cap included),
  each W after its B (the default: 1F1B's count on every rank) or, with --defer-weights,
  deferred as ZB-H1 defers them.

Memory is counted two ways per rank: microbatches held (F to B for 1F1B, F to W with the
split) and their cost (the tokens they hold, every held microbatch counted whole until its
release, so the split schedules' smaller W-pending memory is not credited). A table row
gives the mean and minimum speed-ups, each rank's largest microbatch count, the
largest per-rank token peak relative to plain 1F1B's (mean and max over the seeds), and
how steady each schedule is: a seed stands for one iteration's batch, and the largest
deviation of an iteration's makespan per unit of work (its time per real token) from the
median over the seeds is what the pipeline's fill and drain alone make it vary by.

    python -m megatron.dpp.sim.baselines --pp 2 4 8 --cv 0.5 --slack 0 --seeds 10
    python -m megatron.dpp.sim.baselines --pp 4 --cv 0.5 --slack 0 --seeds 10 --defer-weights
"""

from __future__ import annotations

import argparse
import statistics
import sys

from megatron.dpp.actions import BACKWARD, FORWARD, WEIGHT
from megatron.dpp.config import DEFAULTS
from megatron.dpp.plan import StageConfig
from megatron.dpp.policy import microbatch_order_for
from megatron.dpp.sim.simulator import CostModel, SimResult, sample_durations, simulate

SCHEDULES = ("1f1b plain", "1f1b ordered", "zb-h1 ordered", "dpp")


def held_cost_peaks(result: SimResult, costs: list[float], split: bool) -> list[float]:
    """Per rank: the most cost held at once, from each F to its release (W with the split,
    else B), from a recorded run's per-rank task order (a rank runs one task at a time)."""
    release = WEIGHT if split else BACKWARD
    peaks = []
    for order in result.orders:
        held = peak = 0.0
        for kind, _, microbatch in order:
            if kind == FORWARD:
                held += costs[microbatch]
                peak = max(peak, held)
            elif kind == release:
                held -= costs[microbatch]
        peaks.append(peak)
    return peaks


def compare_one(pp_size: int, cv: float, slack: int, seed: int, latency: float = 0.0,
                jitter: float = 0.0, defer_weights: bool = DEFAULTS.defer_weights
                ) -> dict[str, dict]:
    """The four schedules on one sample of durations (m = 4p); `latency` (a message's time
    from its task's end to its arrival) and `jitter` (a task's own variation) as in
    simulator.CostModel."""
    m = 4 * pp_size
    durations = sample_durations(CostModel(cv=cv, jitter=jitter), pp_size, 1, m, seed,
                                 split_backward=True)
    costs = list(durations.microbatch_factor)
    order = microbatch_order_for(
        StageConfig(0, pp_size, 1, m, slack=slack, split_backward=True), costs)
    runs = {
        "1f1b plain": (simulate("1f1b", pp_size, m, durations, latency=latency, record=True),
                       False),
        "1f1b ordered": (simulate("1f1b", pp_size, m, durations, microbatch_order=order,
                                  latency=latency, record=True), False),
        "zb-h1 ordered": (simulate("zb-h1", pp_size, m, durations, microbatch_order=order,
                                   latency=latency, record=True), True),
        "dpp": (simulate("dpp", pp_size, m, durations, slack=slack, microbatch_costs=costs,
                         microbatch_order=order, split_backward=True, latency=latency,
                         record=True, defer_weights=defer_weights), True),
    }
    work = sum(costs)
    return {name: {"makespan": result.makespan,
                   "per_work": result.makespan / work,
                   "held": result.peak_in_flight,
                   "held_cost": max(held_cost_peaks(result, costs, split))}
            for name, (result, split) in runs.items()}


def table(pps, cv: float, slack: int, seeds: int, latency: float = 0.0,
          jitter: float = 0.0, defer_weights: bool = DEFAULTS.defer_weights) -> list[dict]:
    rows = []
    for p in pps:
        cells = [compare_one(p, cv, slack, seed, latency, jitter, defer_weights)
                 for seed in range(seeds)]
        row = {"pp": p, "microbatches": 4 * p}
        for base in SCHEDULES[:-1]:
            ratios = [c[base]["makespan"] / c["dpp"]["makespan"] for c in cells]
            row[f"{base} mean"], row[f"{base} min"] = sum(ratios) / len(ratios), min(ratios)
        for name in SCHEDULES:
            # per rank, the most over the seeds
            row[f"{name} held"] = [max(per_rank) for per_rank in
                                   zip(*(c[name]["held"] for c in cells), strict=True)]
            # the cost peak relative to what megatron's plain 1F1B holds on the same batch
            ratios = [c[name]["held_cost"] / c["1f1b plain"]["held_cost"] for c in cells]
            row[f"{name} cost"] = (sum(ratios) / len(ratios), max(ratios))
            row[f"{name} deviation"] = largest_deviation([c[name]["per_work"] for c in cells])
        rows.append(row)
    return rows


def largest_deviation(values: list[float]) -> float:
    """The largest |value / median - 1| of `values`."""
    middle = statistics.median(values)
    return max(abs(value / middle - 1) for value in values)


def format_table(rows: list[dict], cv: float, slack: int, seeds: int,
                 defer_weights: bool = DEFAULTS.defer_weights) -> str:
    placement = "deferred as ZB-H1 defers them" if defer_weights else "each after its B"
    lines = [
        f"cv {cv}, slack {slack}, m = 4p, {seeds} seeds; DPP with the split backward, "
        f"W {placement}",
        "",
        "| p | m | DPP / 1F1B plain mean (min) | DPP / 1F1B ordered mean (min) "
        "| DPP / ZB-H1 ordered mean (min) | peak microbatches per rank 1F1B / 1F1B ord. / "
        "ZB-H1 / DPP "
        "| peak tokens / plain 1F1B's, mean (max): 1F1B ordered / ZB-H1 / DPP "
        "| largest deviation of time per unit of work from the seeds' median: "
        "1F1B / 1F1B ord. / ZB-H1 / DPP |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratios = " | ".join(f"{r[f'{b} mean']:.3f}x ({r[f'{b} min']:.3f}x)"
                            for b in SCHEDULES[:-1])
        held = " / ".join(" ".join(map(str, r[f"{name} held"])) for name in SCHEDULES)
        cost = " / ".join(f"{r[f'{name} cost'][0]:.3f} ({r[f'{name} cost'][1]:.3f})"
                          for name in SCHEDULES[1:])
        deviation = " / ".join(f"{100 * r[f'{name} deviation']:.1f} %" for name in SCHEDULES)
        lines.append(f"| {r['pp']} | {r['microbatches']} | {ratios} | {held} | {cost} "
                     f"| {deviation} |")
    means = {b: sum(r[f"{b} mean"] for r in rows) / len(rows) for b in SCHEDULES[:-1]}
    lines += ["", "mean over the rows: " + ", ".join(
        f"DPP / {b} {value:.3f}x" for b, value in means.items())]
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--cv", type=float, default=0.5)
    parser.add_argument("--slack", type=int, default=0)
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--latency", type=float, default=0.0,
                        help="a message's latency, in forwards (GPU: a hop 0.074 ms against "
                             "a stage's forward of about 1.5 ms, 0.05)")
    parser.add_argument("--jitter", type=float, default=0.0,
                        help="each task's own lognormal variation (CV)")
    parser.add_argument("--defer-weights", action=argparse.BooleanOptionalAction,
                        default=DEFAULTS.defer_weights,
                        help="DPP defers each W as ZB-H1 does (every rank holds up to rank "
                             "0's count from F to W) instead of running it after its B")
    args = parser.parse_args(argv)
    if (min(args.pp) < 2 or args.cv <= 0 or args.slack < 0 or args.seeds < 1
            or args.latency < 0 or args.jitter < 0):
        parser.error("need --pp values >= 2, --cv > 0, --slack >= 0, --seeds >= 1, "
                     "--latency >= 0, --jitter >= 0")
    rows = table(args.pp, args.cv, args.slack, args.seeds, args.latency, args.jitter,
                 args.defer_weights)
    sys.stdout.write(format_table(rows, args.cv, args.slack, args.seeds, args.defer_weights)
                     + "\n")


if __name__ == "__main__":
    main()
