"""How far static ZB-H1 is from the best schedule on the split-backward grid's variance
cells (docs/benchmarks/simulator_split.md), by the two lower bounds on the makespan of
megatron/dpp/sim/bounds.py: memory-free (every schedule) and rank 0 at slack 0 (every schedule
that keeps rank 0 in the microbatch order at 1F1B's memory).

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

from megatron.dpp.plan import StageConfig  # noqa: E402
from megatron.dpp.policy import microbatch_order_for  # noqa: E402
from megatron.dpp.sim.bounds import memory_free_bound, rank0_bound  # noqa: E402
from megatron.dpp.sim.simulate_grid import grid_cost_models  # noqa: E402
from megatron.dpp.sim.simulator import sample_durations, simulate  # noqa: E402

VARIANCE_MODELS = ("cv 0.5", "jitter 0.3", "slow stage 1.3x")


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
