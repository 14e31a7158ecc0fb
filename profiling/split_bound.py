"""How far static ZB-H1 is from the best schedule on the split-backward grid's variance
cells (docs/benchmarks/simulator_split.md), by two lower bounds on the makespan:

* memory-free, valid for every schedule at any memory and in any order: per rank r, the
  cheapest microbatch's forwards on the ranks before r, then all of rank r's work;
* rank 0 at slack 0, valid for every schedule that runs each kind (F, B, W) of rank 0 in
  the microbatch order and holds at most p microbatches there from F to W (ZB-H1, and DPP
  at slack 0, whatever it decides): after its p warm-up forwards rank 0 can only run
  B(j), W(j), F(j + p) in turn (F(j + p) needs W(j); running W(j), F(j + p) before a
  ready B(j + 1) never delays anything), and B(j) waits for its gradient, which here
  travels through the other ranks without waiting for them (their contention dropped).

    python profiling/split_bound.py                    # p = 2 4 8, seeds 0-9
    python profiling/split_bound.py --pp 2 4 8 --seeds 30 --seed-offset 100

Prints, per cell, ZB-H1's makespan over each bound (mean over the seeds; 1.030 means no
schedule of that class is more than 1.030x faster than ZB-H1), and the means over cells.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the repository's packages
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron.dpp.actions import BACKWARD, FORWARD, WEIGHT  # noqa: E402
from megatron.dpp.plan import StageConfig  # noqa: E402
from megatron.dpp.policy import microbatch_order_for  # noqa: E402
from megatron.dpp.simulate_grid import grid_cost_models  # noqa: E402
from megatron.dpp.simulator import sample_durations, simulate  # noqa: E402

VARIANCE_MODELS = ("cv 0.5", "jitter 0.3", "slow stage 1.3x")


def memory_free_bound(times, p: int, m: int) -> float:
    forward, backward, weight = times[FORWARD], times[BACKWARD], times[WEIGHT]
    return max(min(sum(forward[s][k] for s in range(r)) for k in range(m))
               + sum(forward[r][k] + backward[r][k] + weight[r][k] for k in range(m))
               for r in range(p))


def rank0_bound(times, p: int, m: int, order: list[int]) -> float:
    """Rank 0's finish when it runs B(j) W(j) F(j + p) as early as the uncontended
    gradient of j allows (module docstring)."""
    forward, backward, weight = times[FORWARD], times[BACKWARD], times[WEIGHT]
    trip = [sum(forward[s][k] + backward[s][k] for s in range(1, p)) for k in range(m)]
    now, arrival = 0.0, [0.0] * m
    for k in order[:p]:
        now += forward[0][k]
        arrival[k] = now + trip[k]
    for n, j in enumerate(order):
        now = max(now, arrival[j]) + backward[0][j] + weight[0][j]
        if n + p < m:
            k = order[n + p]
            now += forward[0][k]
            arrival[k] = now + trip[k]
    return now


def cell(p: int, model: str, seeds: range) -> tuple[float, float]:
    """(ZB-H1 / memory-free bound, ZB-H1 / the larger bound), means over the seeds."""
    m = 4 * p
    cost = grid_cost_models(p, (model,))[model]
    seeds = seeds if cost.is_random else seeds[:1]
    free, both = [], []
    for seed in seeds:
        durations = sample_durations(cost, p, 1, m, seed, split_backward=True)
        stage = StageConfig(0, p, 1, m, split_backward=True)
        order = microbatch_order_for(stage, durations.microbatch_factor)
        zb_h1 = simulate("zb-h1", p, m, durations, microbatch_order=order).makespan
        times = durations.by_kind(split_backward=True)
        bound = memory_free_bound(times, p, m)
        free.append(zb_h1 / bound)
        both.append(zb_h1 / max(bound, rank0_bound(times, p, m, order)))
    return sum(free) / len(free), sum(both) / len(both)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--seed-offset", type=int, default=0)
    args = parser.parse_args(argv)
    if min(args.pp) < 2 or args.seeds < 1 or args.seed_offset < 0:
        parser.error("need --pp values >= 2, --seeds >= 1, --seed-offset >= 0")
    seeds = range(args.seed_offset, args.seed_offset + args.seeds)
    lines = ["| p | cost model | ZB-H1 / memory-free bound | ZB-H1 / the larger of both (slack 0) |",
             "|---|---|---|---|"]
    cells = []
    for p in args.pp:
        for model in VARIANCE_MODELS:
            free, both = cell(p, model, seeds)
            cells.append((free, both))
            lines.append(f"| {p} | {model} | {free:.3f}x | {both:.3f}x |")
    lines.append(f"\nmean over the cells: {sum(c[0] for c in cells) / len(cells):.3f}x / "
                 f"{sum(c[1] for c in cells) / len(cells):.3f}x")
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
