"""The shortest schedule of given task times that runs each rank's forwards, backwards and W
tasks in one microbatch order (as the trainer runs its W tasks on GPUs, where it cannot time
a B) and holds at most held[r] microbatches from F to W on rank r, found by OR-tools' CP-SAT
solver: what `bounds.in_order_bound(..., weights_in_order=True)` bounds from below, and what a
schedule that knew every task's time in advance could reach. One chunk a rank, the split
backward, no message time.

OR-tools is not among the project's requirements (`pip install ortools` apart); without it
`shortest_in_order` raises `ExactSolverMissing`, which names the package.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.dpp.actions import BACKWARD, FORWARD, WEIGHT

_KINDS = (FORWARD, BACKWARD, WEIGHT)


class ExactSolverMissing(ImportError):
    """OR-tools is not installed."""


@dataclass(frozen=True)
class ExactResult:
    makespan: float
    proven: bool  # the solver proved no shorter schedule exists (else: the best it found)


def shortest_in_order(times: dict[str, list[list[float]]], p: int, m: int, held: list[int],
                      order: list[int] | None = None, seconds: float = 60.0,
                      resolution: float = 1e-4) -> ExactResult:
    """`times`: kind -> [rank][microbatch] with W (`Durations.by_kind(split_backward=True)`);
    durations are rounded to `resolution` (the solver works in integers); `seconds`: the
    solver's time limit (ValueError where it finds no schedule in it)."""
    try:
        from ortools.sat.python import cp_model
    except ImportError:
        raise ExactSolverMissing("the exact in-order schedule needs OR-tools: pip install "
                                 "ortools (not a requirement of this project)") from None
    order = list(range(m)) if order is None else order
    duration = {kind: [[round(t / resolution) for t in row] for row in times[kind]]
                for kind in _KINDS}
    horizon = sum(sum(sum(row) for row in table) for table in duration.values())
    model = cp_model.CpModel()
    start, end = {}, {}
    for r in range(p):
        intervals = []
        for kind in _KINDS:
            for n, k in enumerate(order):
                start[kind, r, n] = model.NewIntVar(0, horizon, "")
                end[kind, r, n] = model.NewIntVar(0, horizon, "")
                intervals.append(model.NewIntervalVar(start[kind, r, n], duration[kind][r][k],
                                                      end[kind, r, n], ""))
        model.AddNoOverlap(intervals)
    for r in range(p):
        for n in range(m):
            if r:
                model.Add(start[FORWARD, r, n] >= end[FORWARD, r - 1, n])
            model.Add(start[BACKWARD, r, n] >= end[FORWARD, r, n])
            if r < p - 1:
                model.Add(start[BACKWARD, r, n] >= end[BACKWARD, r + 1, n])
            model.Add(start[WEIGHT, r, n] >= end[BACKWARD, r, n])
            if n + 1 < m:
                for kind in _KINDS:
                    model.Add(start[kind, r, n + 1] >= end[kind, r, n])
            # in order, the held microbatches are consecutive: the n-th one's W ends before
            # the F of the one held[r] later starts
            if n + held[r] < m:
                model.Add(start[FORWARD, r, n + held[r]] >= end[WEIGHT, r, n])
    makespan = model.NewIntVar(0, horizon, "")
    model.AddMaxEquality(makespan, [end[WEIGHT, r, m - 1] for r in range(p)])
    model.Minimize(makespan)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = seconds
    status = solver.Solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise ValueError(f"CP-SAT found no schedule in {seconds} s "
                         f"({solver.StatusName(status)}): give it more time")
    return ExactResult(solver.ObjectiveValue() * resolution, status == cp_model.OPTIMAL)
