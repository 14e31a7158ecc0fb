"""Host time of the DPP cost-order choice (`policy.choose_cost_order`: the rule run in the
simulator's engine once per candidate order), which every rank pays once per iteration
under --seq-length-cv.

    python profiling/bench_cost_order.py                      # p = 8, m = 32, slack 2
    python profiling/bench_cost_order.py --pp 16 --microbatches 64

Prints the best of --repeat timings (each the mean of --number calls) as CPU time of this
process and as wall time; on a shared machine the CPU time is the steadier of the two.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
import timeit
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the repository's packages
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron.dpp.policy import (  # noqa: E402
    ORDER_CHOICE_MAX_TASKS,
    choose_cost_order,
    cost_order,
    simulated_makespan,
)


def best_ms(func, number: int, repeat: int, timer) -> float:
    return min(timeit.Timer(func, timer=timer).repeat(number=number, repeat=repeat)) / number * 1e3


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pp", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=32)
    parser.add_argument("--slack", type=int, default=2)
    parser.add_argument("--cv", type=float, default=0.5, help="lognormal cost spread")
    parser.add_argument("--number", type=int, default=50)
    parser.add_argument("--repeat", type=int, default=9)
    args = parser.parse_args(argv)
    rng = random.Random(0)
    sigma = math.sqrt(math.log1p(args.cv ** 2))
    costs = [rng.lognormvariate(0.0, sigma) for _ in range(args.microbatches)]
    tasks = 2 * args.pp * args.microbatches
    if tasks > ORDER_CHOICE_MAX_TASKS:
        parser.error(f"{tasks} tasks per candidate: above ORDER_CHOICE_MAX_TASKS "
                     f"({ORDER_CHOICE_MAX_TASKS}) the choice simulates nothing")
    order = cost_order(costs)
    rows = [
        ("choose_cost_order", lambda: choose_cost_order(costs, args.pp, args.slack)),
        ("one simulated_makespan", lambda: simulated_makespan(costs, args.pp, args.slack,
                                                              order)),
    ]
    sys.stdout.write(f"p = {args.pp}, m = {args.microbatches}, slack {args.slack}, "
                     f"{tasks} tasks per candidate\n")
    for name, func in rows:
        cpu = best_ms(func, args.number, args.repeat, time.process_time)
        wall = best_ms(func, args.number, args.repeat, time.perf_counter)
        sys.stdout.write(f"{name:24s} {cpu:7.3f} ms CPU  {wall:7.3f} ms wall\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
