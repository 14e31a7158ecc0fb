"""How steady each iteration's time per real token can be on a corpus, by the simulator
(the target: within 5 % of the run's median from iteration 5 on).

The trainer's own document order (megatron/trainer/data/documents.py, --split and --seed as
the trainer reads them) and its microbatch plan (data/microbatches.py: --group-by-length,
--pad-to-multiple, and --microbatch-tokens where given) give each iteration's microbatches;
a microbatch costs its rows x padded length, its attention's share growing with the length
(1 + length / (6 x hidden), the FLOPs of one layer per token), the same on every stage. The
simulator (megatron/dpp/sim/simulator.py, backward twice the forward, half of it W) runs 1F1B and
ZB-H1 fed DPP's cost order and DPP's rule (its default W placement) on each iteration; a
row gives the largest deviation of an iteration's makespan per real token from the median
over the iterations after the warm-up. No host cost, hop or recording: what the microbatches alone make vary.
Two last tables give, on the same plans, DPP's speed over each schedule (the median over
those iterations of the schedule's makespan over DPP's) and the most any schedule could gain
over each: its makespan over the memory-free lower bound (megatron/dpp/sim/bounds.py: every
schedule, at any memory and in any order, is at least that long).

    python profiling/corpus_steadiness.py --data-path /tmp/varlen/corpus_text_document \
        --microbatch-tokens 2048 [--log RUN.log]
    python profiling/corpus_steadiness.py --seq-length-cv 0.5 --microbatch-tokens 2048

`--seq-length-cv X` plans from the lengths the trainer draws under `--seq-length-cv X
--microbatch-tokens N` (data.DrawnLengthSamples, --seed as the trainer's) instead of a corpus.

`--log`: a GPU run's log of the same corpus and layout (profiling/bench_gpt.py's docs-*
configurations): its iteration times fitted, by least squares, to DPP's simulated makespan,
the iteration's microbatch count and a constant (the step's fixed work: optimizer, gradient
reduction), and the largest deviation per real token that the run measured, that the fit
gives (the plan with those costs, no noise) and that the simulator alone gives.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron.dpp.plan import StageConfig  # noqa: E402
from megatron.dpp.policy import microbatch_order_for  # noqa: E402
from megatron.dpp.sim.baselines import largest_deviation  # noqa: E402
from megatron.dpp.sim.bounds import memory_free_bound  # noqa: E402
from megatron.dpp.sim.simulator import CostModel, Durations, simulate  # noqa: E402
from megatron.trainer.data.data import DrawnLengthSamples  # noqa: E402
from megatron.trainer.data.documents import (  # noqa: E402
    DocumentDataConfig,
    build_document_datasets,
)
from megatron.trainer.data.microbatches import BatchLayout, plan_global_batch  # noqa: E402
from megatron.trainer.launch import read_iterations  # noqa: E402

ITERATION_MS = "elapsed time per iteration (ms)"

SCHEDULES = ("1f1b natural", "1f1b ordered", "zb-h1 ordered", "dpp")
BOUND = "lower bound"


def iteration_costs(dataset, layout: BatchLayout, iteration: int,
                    hidden_size: int) -> tuple[list[float], int]:
    """Each microbatch's cost (in 1,000s of token-layers) and the real tokens of one
    iteration, on data-parallel rank 0."""
    plan = plan_global_batch(dataset, iteration * layout.global_batch_size, layout)
    costs = [len(rows) * length * (1 + length / (6 * hidden_size)) / 1000
             for rows, length in zip(plan.samples[0], plan.lengths[0], strict=True)]
    return costs, sum(plan.real_tokens[0])


def per_real_token(costs: list[float], real_tokens: int, pp_size: int) -> dict[str, float]:
    """Each schedule's makespan, and the lower bound on any schedule's, over the iteration's
    real tokens."""
    model = CostModel()
    backward = model.backward_ratio * model.forward
    durations = Durations(
        [[model.forward * c for c in costs] for _ in range(pp_size)],
        [[backward * (1 - model.weight_share) * c for c in costs] for _ in range(pp_size)],
        costs,
        [[backward * model.weight_share * c for c in costs] for _ in range(pp_size)])
    m = len(costs)
    order = microbatch_order_for(StageConfig(0, pp_size, 1, m, slack=0, split_backward=True),
                                 costs)
    runs = {
        "1f1b natural": simulate("1f1b", pp_size, m, durations),
        "1f1b ordered": simulate("1f1b", pp_size, m, durations, microbatch_order=order),
        "zb-h1 ordered": simulate("zb-h1", pp_size, m, durations, microbatch_order=order),
        "dpp": simulate("dpp", pp_size, m, durations, slack=0, microbatch_costs=costs,
                        microbatch_order=order, split_backward=True),
    }
    bound = memory_free_bound(durations.by_kind(split_backward=True), pp_size, m)
    return {BOUND: bound / real_tokens,
            **{name: result.makespan / real_tokens for name, result in runs.items()}}


def steadiness(dataset, layout: BatchLayout, pp_size: int, hidden_size: int, iterations: int,
               warmup: int) -> dict:
    """The microbatch counts met, each schedule's largest deviation after `warmup`,
    `dpp_speedup`: per schedule, the median over those iterations of its makespan over
    DPP's, and `headroom`: the same over the lower bound on any schedule's makespan."""
    times = {name: [] for name in (*SCHEDULES, BOUND)}
    counts = []
    for iteration in range(iterations):
        costs, real_tokens = iteration_costs(dataset, layout, iteration, hidden_size)
        counts.append(len(costs))
        for name, value in per_real_token(costs, real_tokens, pp_size).items():
            times[name].append(value)

    def over(reference: str) -> dict[str, float]:
        return {name: statistics.median(t / r for t, r in zip(times[name][warmup:],
                                                              times[reference][warmup:],
                                                              strict=True))
                for name in SCHEDULES}

    return {"microbatches": (min(counts), max(counts)), "dpp_speedup": over("dpp"),
            "headroom": over(BOUND),
            **{name: largest_deviation(times[name][warmup:]) for name in SCHEDULES}}


def fit_to_run(dataset, layout: BatchLayout, pp_size: int, hidden_size: int,
               log_lines: list[str], warmup: int) -> dict:
    """A run's iteration times after `warmup` against DPP's simulated makespan of the same
    iterations (iteration k plans the global batch at (k - 1) x global batch): the fitted
    ms per makespan unit, ms per microbatch and fixed ms, R^2, and the largest deviation per
    real token measured, fitted and simulated."""
    times = {int(row["iteration"]): row[ITERATION_MS]
             for row in read_iterations(log_lines) if ITERATION_MS in row}
    iterations = [k for k in sorted(times) if k > warmup]
    if len(iterations) < 4:
        raise SystemExit(f"the log has {len(iterations)} iteration times after the warm-up "
                         f"of {warmup}: too few to fit three costs")
    features, real = [], []
    for k in iterations:
        costs, real_tokens = iteration_costs(dataset, layout, k - 1, hidden_size)
        makespan = per_real_token(costs, real_tokens, pp_size)["dpp"] * real_tokens
        features.append([makespan, len(costs), 1.0])
        real.append(real_tokens)
    design, measured = np.array(features), np.array([times[k] for k in iterations])
    coefficients = np.linalg.lstsq(design, measured, rcond=None)[0]
    fitted, real = design @ coefficients, np.array(real, dtype=float)
    return {"iterations": (iterations[0], iterations[-1]),
            "per_makespan": float(coefficients[0]), "per_microbatch_ms": float(coefficients[1]),
            "fixed_ms": float(coefficients[2]),
            "r2": float(1 - np.var(measured - fitted) / np.var(measured)),
            "residual_ms": float(np.std(measured - fitted)),
            "measured": largest_deviation(list(measured / real)),
            "fitted": largest_deviation(list(fitted / real)),
            "simulated": largest_deviation(list(design[:, 0] / real))}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--data-path", help="a .bin/.idx prefix")
    source.add_argument("--seq-length-cv", type=float,
                        help="instead of a corpus: the trainer's drawn lengths, one per sample, "
                             "as --seq-length-cv under --microbatch-tokens draws them")
    parser.add_argument("--split", default="98,1,1")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--hidden-size", type=int, default=2048)
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--global-batch-size", type=int, default=32)
    parser.add_argument("--pad-to-multiple", type=int, default=128)
    parser.add_argument("--microbatch-tokens", type=int, default=None,
                        help="also a row with this token budget per microbatch")
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=4, help="iterations left out")
    parser.add_argument("--log", type=Path, default=None,
                        help="a GPU run's log of this corpus and layout: fit its iteration "
                             "times (the module's docstring)")
    args = parser.parse_args(argv)
    log_lines = args.log.read_text(errors="replace").splitlines() if args.log else []
    logged = [int(row["iteration"]) for row in read_iterations(log_lines)]
    samples = max([args.iterations, *logged]) * args.global_batch_size
    if args.data_path is None:
        train = DrawnLengthSamples(None, args.seq_length, args.seq_length_cv, args.seed)
    else:
        train, _, _ = build_document_datasets(
            DocumentDataConfig([args.data_path], None, args.split, args.seq_length, args.seed),
            (samples, 0, 0))
    layouts = {f"{args.micro_batch_size} rows, grouped by length": BatchLayout(
        args.micro_batch_size, args.global_batch_size, group_by_length=True,
        pad_to_multiple=args.pad_to_multiple)}
    if args.microbatch_tokens is not None:
        layouts[f"token budget {args.microbatch_tokens}, grouped by length"] = BatchLayout(
            args.micro_batch_size, args.global_batch_size, group_by_length=True,
            pad_to_multiple=args.pad_to_multiple, microbatch_tokens=args.microbatch_tokens)
    lines = [f"largest deviation of the time per real token from the median, iterations "
             f"{args.warmup + 1}-{args.iterations}, PP={args.pp}",
             f"{'microbatches':40s} {'count':>8s} " + " ".join(f"{s:>14s}" for s in SCHEDULES)]
    speedups = [f"DPP's speed over each (the median of their makespan over DPP's), PP={args.pp}"]
    headroom = [f"the most any schedule could gain over each (the median of their makespan "
                f"over the lower bound), PP={args.pp}"]
    for name, layout in layouts.items():
        row = steadiness(train, layout, args.pp, args.hidden_size, args.iterations,
                         args.warmup)
        low, high = row["microbatches"]
        lines.append(f"{name:40s} {f'{low}-{high}':>8s} "
                     + " ".join(f"{row[s]:14.1%}" for s in SCHEDULES))
        speedups.append(f"{name:40s} {'':>8s} "
                        + " ".join(f"{row['dpp_speedup'][s]:13.3f}x" for s in SCHEDULES))
        headroom.append(f"{name:40s} {'':>8s} "
                        + " ".join(f"{row['headroom'][s]:13.3f}x" for s in SCHEDULES))
    lines += speedups + headroom
    if args.log:
        fit = fit_to_run(train, layout, args.pp, args.hidden_size, log_lines, args.warmup)
        first, last = fit["iterations"]
        lines += [
            f"{args.log.name}, iterations {first}-{last} (the layout of the last row): ms = "
            f"{fit['per_makespan']:.3f} x DPP's makespan + {fit['per_microbatch_ms']:.2f} ms "
            f"x microbatches + {fit['fixed_ms']:.1f} ms (R^2 {fit['r2']:.2f}, residual "
            f"{fit['residual_ms']:.1f} ms)",
            f"largest deviation per real token: measured {fit['measured']:.1%}, the fit "
            f"{fit['fitted']:.1%}, the simulator alone {fit['simulated']:.1%}"]
    sys.stdout.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
