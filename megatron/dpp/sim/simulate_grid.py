"""The simulator's comparison grid: DPP against 1F1B (and, with the split backward, ZB-H1
fed DPP's microbatch order) over pipeline depths, cost models and seeds, as rows and as the
markdown tables of docs/benchmarks/simulator.md and simulator_split.md
(`python -m megatron.dpp.sim.simulate --grid [--split-backward]`).
"""

from __future__ import annotations

from megatron.dpp.config import DEFAULTS
from megatron.dpp.plan import StageConfig
from megatron.dpp.policy import microbatch_order_for
from megatron.dpp.sim.simulator import CostModel, SimResult, sample_durations, simulate

GRID_PP = (2, 4, 8, 16, 32, 64)
GRID_SLACKS = (0, 2)


# the comparison grid's cost models; GRID_EXTRA_MODELS run only when named (--grid-models)
GRID_MODELS = ("uniform", "cv 0.5", "jitter 0.3", "slow stage 1.3x")
GRID_EXTRA_MODELS = ("cv 0.5 + jitter 0.3",)


def grid_cost_models(pp_size: int, names: tuple[str, ...] = GRID_MODELS) -> dict[str, CostModel]:
    models = {
        "uniform": CostModel(),
        "cv 0.5": CostModel(cv=0.5),
        "jitter 0.3": CostModel(jitter=0.3),
        "slow stage 1.3x": CostModel(slow_stage=pp_size // 2, slow_factor=1.3),
        # DPP knows the per-microbatch factor, not the jitter on top of it
        "cv 0.5 + jitter 0.3": CostModel(cv=0.5, jitter=0.3),
    }
    unknown = [name for name in names if name not in models]
    if unknown:
        raise ValueError(f"unknown grid cost models {unknown}; choose from {list(models)}")
    return {name: models[name] for name in names}


def _grid_unit(args):
    pp_size, model_name, seed, slacks, known_costs = args
    cost = grid_cost_models(pp_size, (model_name,))[model_name]
    m = 4 * pp_size
    durations = sample_durations(cost, pp_size, 1, m, seed)
    static = simulate("1f1b", pp_size, m, durations)
    out = {"pp": pp_size, "model": model_name, "seed": seed, "1f1b": _summary(static)}
    for slack in slacks:
        costs = durations.microbatch_factor if known_costs else None
        out[f"dpp+{slack}"] = _summary(
            simulate("dpp", pp_size, m, durations, slack=slack, microbatch_costs=costs))
    return out


def _summary(result: SimResult) -> dict:
    return {
        "makespan": result.makespan,
        "mean_bubble": result.mean_bubble,
        "peak_in_flight": max(result.peak_in_flight),
    }


def _split_grid_unit(args):
    """One (p, cost model, seed) of the split-backward grid: per slack, DPP with W tasks,
    and 1F1B and ZB-H1 fed DPP's microbatch order."""
    pp_size, model_name, seed, slacks, known_costs, weight_slices, defer_weights = args
    cost = grid_cost_models(pp_size, (model_name,))[model_name]
    m = 4 * pp_size
    durations = sample_durations(cost, pp_size, 1, m, seed, split_backward=True)
    costs = durations.microbatch_factor if known_costs else None
    out = {"pp": pp_size, "model": model_name, "seed": seed}
    for slack in slacks:
        stage = StageConfig(0, pp_size, 1, m, slack=slack, split_backward=True)
        order = microbatch_order_for(stage, costs)
        runs = {name: simulate(name, pp_size, m, durations, microbatch_order=order)
                for name in ("1f1b", "zb-h1")}
        runs["dpp"] = simulate("dpp", pp_size, m, durations, slack=slack,
                               microbatch_costs=costs, microbatch_order=order,
                               split_backward=True, weight_slices=weight_slices,
                               defer_weights=defer_weights)
        out[slack] = {name: _split_summary(result, runs["1f1b"])
                      for name, result in runs.items()}
    return out


def _split_summary(result: SimResult, one_f_one_b: SimResult) -> dict:
    return {
        "makespan": result.makespan,
        "mean_bubble": result.mean_bubble,
        # microbatches held from F to W (to B for 1F1B), the most on any rank
        "peak_in_flight": max(result.peak_in_flight),
        # from F to B, the most any rank holds beyond what it holds in 1F1B
        "activations_over_1f1b": max(
            ours - theirs for ours, theirs in zip(result.peak_activations,
                                                  one_f_one_b.peak_activations, strict=True)),
    }


def run_grid(
    pps,
    slacks,
    seeds: int,
    jobs: int,
    known_costs: bool = True,
    seed_offset: int = 0,
    models: tuple[str, ...] = GRID_MODELS,
    split_backward: bool = False,
    weight_slices: int = DEFAULTS.weight_slices,
    defer_weights: bool = DEFAULTS.defer_weights,
) -> list[dict]:
    """Every (p, cost model, seed) of the comparison grid; one row per (p, model, slack).
    known_costs: DPP knows each microbatch's cost factor in advance (not the jitter).
    Random models run seeds seed_offset .. seed_offset + seeds - 1 (held-out seeds: an
    offset past the grid's 10); a deterministic model runs once. `split_backward`: DPP
    with W tasks (each in `weight_slices` parts, deferred as ZB-H1 defers them with
    `defer_weights`) against 1F1B and ZB-H1 fed its microbatch order (`format_split_grid`)."""
    models = tuple(models)
    units = [
        (p, name, seed_offset + seed, tuple(slacks), known_costs)
        for p in sorted(pps, reverse=True)  # biggest first: better load balance
        for name, cost in grid_cost_models(p, models).items()
        for seed in range(seeds if cost.is_random else 1)
    ]
    if split_backward:
        unit = _split_grid_unit
        units = [u + (weight_slices, defer_weights) for u in units]
    else:
        unit = _grid_unit
    if jobs > 1:
        import multiprocessing

        with multiprocessing.get_context("fork").Pool(jobs) as pool:
            outputs = pool.map(unit, units, chunksize=1)
    else:
        outputs = [unit(u) for u in units]
    rows = []
    for p in sorted(pps):
        for name in grid_cost_models(p, models):
            cell = [o for o in outputs if o["pp"] == p and o["model"] == name]
            for slack in slacks:
                if split_backward:
                    rows.append(_split_row(p, name, slack, [o[slack] for o in cell]))
                    continue
                ratios = [o["1f1b"]["makespan"] / o[f"dpp+{slack}"]["makespan"] for o in cell]
                rows.append(
                    {
                        "pp": p,
                        "microbatches": 4 * p,
                        "model": name,
                        "slack": slack,
                        "seeds": len(cell),
                        "ratio_mean": sum(ratios) / len(ratios),
                        "ratio_min": min(ratios),
                        "bubble_1f1b": _mean(o["1f1b"]["mean_bubble"] for o in cell),
                        "bubble_dpp": _mean(o[f"dpp+{slack}"]["mean_bubble"] for o in cell),
                        "peak_1f1b": max(o["1f1b"]["peak_in_flight"] for o in cell),
                        "peak_dpp": max(o[f"dpp+{slack}"]["peak_in_flight"] for o in cell),
                    }
                )
    return rows


def _split_row(p: int, model: str, slack: int, runs: list[dict]) -> dict:
    row = {"pp": p, "microbatches": 4 * p, "model": model, "slack": slack, "seeds": len(runs)}
    for base in ("1f1b", "zb-h1"):
        ratios = [run[base]["makespan"] / run["dpp"]["makespan"] for run in runs]
        row[f"ratio_{base}_mean"] = _mean(ratios)
        row[f"ratio_{base}_min"] = min(ratios)
    for name in ("1f1b", "zb-h1", "dpp"):
        row[f"bubble_{name}"] = _mean(run[name]["mean_bubble"] for run in runs)
        row[f"peak_{name}"] = max(run[name]["peak_in_flight"] for run in runs)
        row[f"activations_over_1f1b_{name}"] = max(run[name]["activations_over_1f1b"]
                                                   for run in runs)
    return row


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def format_grid(rows: list[dict]) -> str:
    lines = [
        "| p | m | cost model | slack | DPP / 1F1B mean | min | bubble 1F1B | bubble DPP "
        "| peak in-flight 1F1B | peak in-flight DPP |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['pp']} | {row['microbatches']} | {row['model']} | +{row['slack']} "
            f"| {row['ratio_mean']:.3f}x | {row['ratio_min']:.3f}x "
            f"| {row['bubble_1f1b']:.3f} | {row['bubble_dpp']:.3f} "
            f"| {row['peak_1f1b']} | {row['peak_dpp']} |"
        )
    # "variance cells": every non-uniform cost model (cv, jitter, slow stage); the random
    # ones alone (cv, jitter) are reported too
    variance = [r for r in rows if r["model"] != "uniform" and r["pp"] <= 8]
    every_model = GRID_MODELS + GRID_EXTRA_MODELS
    random_models = {
        name for name, cost in grid_cost_models(2, every_model).items() if cost.is_random
    }
    for slack in sorted({r["slack"] for r in rows}):
        cells = [r["ratio_mean"] for r in variance if r["slack"] == slack]
        if cells:
            lines.append(
                f"\nslack +{slack}: mean DPP / 1F1B over variance cells with p <= 8: "
                f"{_mean(cells):.3f}x"
            )
        cells = [
            r["ratio_mean"]
            for r in variance
            if r["slack"] == slack and r["model"] in random_models
        ]
        if cells:
            lines.append(
                f"slack +{slack}: mean over the random cells (cv, jitter) with p <= 8: "
                f"{_mean(cells):.3f}x"
            )
        worst = min(r["ratio_mean"] for r in rows if r["slack"] == slack)
        lines.append(f"slack +{slack}: worst cell mean {worst:.3f}x")
    return "\n".join(lines)


def format_split_grid(rows: list[dict]) -> str:
    """The split-backward grid: DPP (with W tasks) against 1F1B and ZB-H1, both fed DPP's
    microbatch order; memory as the most any rank holds from F to W, and the most any
    rank holds from F to B beyond its 1F1B count."""
    lines = [
        "| p | m | cost model | slack | DPP / 1F1B mean | min | DPP / ZB-H1 mean | min "
        "| bubble ZB-H1 | bubble DPP | F-to-W peak 1F1B / ZB-H1 / DPP "
        "| F-to-B over 1F1B ZB-H1 / DPP |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['pp']} | {row['microbatches']} | {row['model']} | +{row['slack']} "
            f"| {row['ratio_1f1b_mean']:.3f}x | {row['ratio_1f1b_min']:.3f}x "
            f"| {row['ratio_zb-h1_mean']:.3f}x | {row['ratio_zb-h1_min']:.3f}x "
            f"| {row['bubble_zb-h1']:.3f} | {row['bubble_dpp']:.3f} "
            f"| {row['peak_1f1b']} / {row['peak_zb-h1']} / {row['peak_dpp']} "
            f"| +{row['activations_over_1f1b_zb-h1']} / +{row['activations_over_1f1b_dpp']} |"
        )
    variance = [r for r in rows if r["model"] != "uniform" and r["pp"] <= 8]
    for slack in sorted({r["slack"] for r in rows}):
        cells = [r for r in variance if r["slack"] == slack]
        if cells:
            lines.append(
                f"\nslack +{slack}: mean over variance cells with p <= 8: DPP / ZB-H1 "
                f"{_mean(r['ratio_zb-h1_mean'] for r in cells):.3f}x, DPP / 1F1B "
                f"{_mean(r['ratio_1f1b_mean'] for r in cells):.3f}x")
        same = [r for r in rows if r["slack"] == slack]
        lines.append(f"slack +{slack}: worst cell mean DPP / 1F1B "
                     f"{min(r['ratio_1f1b_mean'] for r in same):.3f}x, worst single run "
                     f"{min(r['ratio_1f1b_min'] for r in same):.3f}x; DPP / ZB-H1 worst cell "
                     f"mean {min(r['ratio_zb-h1_mean'] for r in same):.3f}x")
    return "\n".join(lines)
