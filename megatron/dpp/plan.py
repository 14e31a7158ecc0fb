"""Static plans as per-rank action lists, a checker that proves a set of them complete and
deadlock-free, and a command line that prints them.

    python -m megatron.dpp.plan --schedule 1f1b --pp 4 --microbatches 8
    python -m megatron.dpp.plan --schedule interleaved --pp 4 --microbatches 8 --chunks 2 \
        --rank 0 --csv
    python -m megatron.dpp.plan --schedule zb-h1 --pp 4 --microbatches 8

Plans: megatron-core's 1F1B (`forward_backward_pipelining_without_interleaving`), its
interleaved 1F1B (`forward_backward_pipelining_with_interleaving`; tests/golden holds what
megatron-core 0.16.1 executes, and the plans here equal it), GPipe, and ZB-H1 (Qi et al.,
"Zero Bubble Pipeline Parallelism", 2024): 1F1B with each backward split into B (input
gradient) and W (weight gradient), the W deferred to fill the bubbles (`split_skeleton`).
The DPP policy's plan is megatron's with extra warmup forwards (`plan_order`'s
`extra_warmup`), split the same way under `StageConfig.split_backward`.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, replace
from functools import lru_cache

from megatron.dpp.actions import (
    BACKWARD,
    FORWARD,
    WEIGHT,
    Task,
    format_actions,
    in_flight_profile,
)
from megatron.dpp.engine import DeadlockError, StaticReplay, run_pipeline, task_table
from megatron.dpp.topology import PipelineTopology

SCHEDULES = ("1f1b", "interleaved", "gpipe", "zb-h1")


@dataclass(frozen=True)
class StageConfig:
    """One pipeline rank's view of the schedule.

    `microbatch_group_size` is megatron's microbatch_group_size_per_vp_stage (default
    pp_size); it only matters with num_chunks > 1. `slack` is the DPP policy's (extra
    microbatches in flight); the static plans ignore it. `split_backward`: every backward
    is a B and a W task (`split_skeleton`). `defer_weights` (with the split): each W
    follows its B `weight_delay` backwards later, as in ZB-H1 (every rank then holds up to
    rank 0's 1F1B count from F to W), or, when False, right after its B (every rank holds
    its own 1F1B count: 1F1B's memory). `weight_slices`: the DPP policy runs each W in
    this many parts, each one a decision of its own (the plans hold each W once).
    `weights_by_backward`: the DPP rule runs, of its pending W tasks, the one whose B was
    shortest first (it needs each B's time: the trainer's where the host times tasks, CPU,
    with a WeightGradStore that sums in B order whatever the W order).
    """

    rank: int
    pp_size: int
    num_chunks: int = 1
    num_microbatches: int = 1
    slack: int = 0
    forward_only: bool = False
    microbatch_group_size: int | None = None
    split_backward: bool = False
    defer_weights: bool = True
    weight_slices: int = 1
    weights_by_backward: bool = False

    def __post_init__(self):
        if self.pp_size < 1:
            raise ValueError(f"StageConfig: pp_size must be >= 1, got {self.pp_size}")
        if not 0 <= self.rank < self.pp_size:
            raise ValueError(f"StageConfig: rank {self.rank} not in [0, {self.pp_size})")
        if self.num_chunks < 1:
            raise ValueError(f"StageConfig: num_chunks must be >= 1, got {self.num_chunks}")
        if self.num_microbatches < 1:
            raise ValueError(
                f"StageConfig: num_microbatches must be >= 1, got {self.num_microbatches}"
            )
        if self.slack < 0:
            raise ValueError(f"StageConfig: slack must be >= 0, got {self.slack}")
        if self.weight_slices < 1:
            raise ValueError(f"StageConfig: weight_slices must be >= 1, got "
                             f"{self.weight_slices}")
        if self.num_chunks > 1:
            self._check_interleaving()

    def _check_interleaving(self):
        # the same limits megatron-core 0.16.1 enforces for its interleaved schedule
        group, p, m = self.group_size, self.pp_size, self.num_microbatches
        if not p <= group <= m:
            raise ValueError(
                f"StageConfig: with num_chunks={self.num_chunks}, microbatch group size "
                f"{group} must be in [pp_size={p}, num_microbatches={m}]"
            )
        remainder = m % group
        if 0 < remainder < p:
            raise ValueError(
                f"StageConfig: with num_chunks={self.num_chunks}, num_microbatches={m} "
                f"leaves a last microbatch group of {remainder} < pp_size={p} "
                f"(group size {group}); megatron-core rejects this too"
            )

    @property
    def group_size(self) -> int:
        return self.microbatch_group_size or self.pp_size

    @property
    def topology(self) -> PipelineTopology:
        return PipelineTopology(self.pp_size, self.num_chunks)


def _interleaved_table(stage: StageConfig) -> list[tuple[int, int]]:
    """(microbatch, chunk) of each forward, in megatron's interleaved forward order: groups
    of `group_size` microbatches, each group through chunk 0, then chunk 1, ..."""
    m, chunks, group = stage.num_microbatches, stage.num_chunks, stage.group_size
    table = []
    for first in range(0, m, group):
        last = m if first + group >= m else first + group
        table.extend((i, c) for c in range(chunks) for i in range(first, last))
    return table


@lru_cache(maxsize=256)
def plan_skeleton(stage: StageConfig, extra_warmup: int = 0) -> tuple[tuple[str, int, int], ...]:
    """The plan as (kind, chunk, k): the k-th microbatch of the plan's microbatch order.

    One chunk: 1F1B (p - r - 1 warmup forwards, then one forward one backward, then the
    cooldown backwards). Several: megatron-core's interleaved 1F1B (warmup 2 (p - r - 1) +
    (chunks - 1) group), whose backward k runs chunk chunks - 1 - chunk(k) on the
    microbatch of forward k. `extra_warmup` more warmup forwards (the DPP plan). With
    `stage.split_backward`, each backward is a B and its W (`split_skeleton`)."""
    if stage.split_backward and not stage.forward_only:
        unsplit = plan_skeleton(replace(stage, split_backward=False), extra_warmup)
        return split_skeleton(unsplit, weight_delay(stage))
    p, r, chunks = stage.pp_size, stage.rank, stage.num_chunks
    m = stage.num_microbatches
    table = [(i, 0) for i in range(m)] if chunks == 1 else _interleaved_table(stage)
    forwards = [(FORWARD, c, i) for i, c in table]
    if stage.forward_only:
        return tuple(forwards)
    backwards = [(BACKWARD, chunks - 1 - c, i) for i, c in table]
    total = len(table)
    if chunks == 1:
        warmup = p - r - 1
    else:
        warmup = 2 * (p - r - 1) + (chunks - 1) * stage.group_size
    warmup = min(warmup + extra_warmup, total)
    order = forwards[:warmup]
    for k in range(total - warmup):
        order.append(forwards[warmup + k])
        order.append(backwards[k])
    order.extend(backwards[total - warmup:])
    return tuple(order)


def static_peak(stage: StageConfig) -> int:
    """The most microbatches megatron-core's static schedule (1F1B / interleaved) holds in
    flight on this rank: p - r with one chunk, min(m, ...) in general."""
    count = peak = 0
    for kind, _, _ in plan_skeleton(replace(stage, split_backward=False, forward_only=False)):
        count += 1 if kind == FORWARD else -1
        peak = max(peak, count)
    return peak


def weight_delay(stage: StageConfig) -> int:
    """How many later B tasks a rank runs before the W of a microbatch in the split plan:
    0 without `stage.defer_weights`, else rank 0's static peak minus this rank's (r with
    one chunk, 2r interleaved). Every rank
    then holds at most as many microbatches from F to W as rank 0 holds in 1F1B, and
    exactly 1F1B's count of its own from F to B. With one chunk this is ZB-H1: under
    F = B = W its bubble is (p - 1) F against 1F1B's 3 (p - 1) F; W right after B (delay 0)
    keeps every rank's F-to-W count at 1F1B's but leaves 2 (p - 1) F of bubble (the last
    rank then alternates F, B, W strictly, and the last B waits for all of it)."""
    if not stage.defer_weights:
        return 0
    return static_peak(replace(stage, rank=0)) - static_peak(stage)


def split_skeleton(skeleton, delay: int) -> tuple[tuple[str, int, int], ...]:
    """A plan with whole backwards as one with B and W tasks: each B keeps its place and the
    W of the same microbatch follows the B `delay` backwards later (the last `delay` W
    tasks close the plan, in B order). W tasks of a chunk run in its B order."""
    out, backwards = [], []
    for entry in skeleton:
        out.append(entry)
        if entry[0] == BACKWARD:
            backwards.append(entry)
            if len(backwards) > delay:
                _, chunk, k = backwards[-1 - delay]
                out.append((WEIGHT, chunk, k))
    out.extend((WEIGHT, chunk, k) for _, chunk, k in backwards[max(len(backwards) - delay, 0):])
    return tuple(out)


def plan_order(stage: StageConfig, extra_warmup: int = 0,
               microbatch_order: list[int] | None = None) -> list[Task]:
    """This rank's megatron-core order with `extra_warmup` more warmup forwards.
    `microbatch_order`, a permutation of range(num_microbatches) (default: the natural
    order), is the order in which the microbatches go through the schedule; every rank
    must use the same one."""
    m = stage.num_microbatches
    if microbatch_order is not None:
        check_permutation(microbatch_order, m)
    order = range(m) if microbatch_order is None else microbatch_order
    return [task_table(kind, chunk, m)[order[k]]
            for kind, chunk, k in plan_skeleton(stage, extra_warmup)]


def static_order(stage: StageConfig, microbatch_order: list[int] | None = None) -> list[Task]:
    """This rank's task order in megatron-core's static schedule (1F1B, or interleaved
    1F1B with num_chunks > 1; split into B and W under `stage.split_backward`: ZB-H1 with
    one chunk), the microbatches in `microbatch_order` (default 0..m-1)."""
    return plan_order(stage, microbatch_order=microbatch_order)


def gpipe_order(stage: StageConfig) -> list[Task]:
    """All forwards (chunk by chunk), then all backwards (last chunk first)."""
    m, chunks = stage.num_microbatches, stage.num_chunks
    order = [Task(FORWARD, c, i) for c in range(chunks) for i in range(m)]
    order += [Task(BACKWARD, c, i) for c in reversed(range(chunks)) for i in range(m)]
    return order


def check_permutation(order, m: int) -> None:
    if sorted(order) != list(range(m)):
        raise ValueError(f"microbatch order {list(order)} is not a permutation of range({m})")


def build_plans(schedule: str, pp_size: int, num_microbatches: int, num_chunks: int = 1,
                microbatch_group_size: int | None = None) -> list[list[Task]]:
    """Every rank's action list of a static schedule."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose from {', '.join(SCHEDULES)}")
    if schedule == "1f1b" and num_chunks != 1:
        raise ValueError("schedule 1f1b has one chunk per rank; use interleaved")
    if schedule == "interleaved" and num_chunks < 2:
        raise ValueError("schedule interleaved needs num_chunks >= 2")
    if schedule == "zb-h1" and num_chunks != 1:
        raise ValueError("schedule zb-h1 has one chunk per rank")
    stages = [StageConfig(r, pp_size, num_chunks, num_microbatches,
                          microbatch_group_size=microbatch_group_size,
                          split_backward=schedule == "zb-h1") for r in range(pp_size)]
    make = gpipe_order if schedule == "gpipe" else static_order
    return [make(stage) for stage in stages]


class PlanError(ValueError):
    """A set of per-rank plans that is incomplete or deadlocks; the message names the rank
    and the action."""


@dataclass
class PlanCheck:
    peak_in_flight: list[int]  # per rank, from F to the release (W when the plans split)
    peak_activations: list[int]  # per rank, from F to B
    makespan: float  # with F = 1, B = 2 (B = W = 1 when the plans split the backward)


def check_plans(plans: list[list[Task]], topology: PipelineTopology,
                num_microbatches: int) -> PlanCheck:
    """Proves per-rank plans runnable: every rank has each task exactly once (forwards of
    every chunk and microbatch; backwards, and W tasks, when any rank's plan has them) and
    a dry run through the simulator's engine finishes. Raises PlanError naming the first
    rank and action that is wrong, or that can never run."""
    if len(plans) != topology.pp_size:
        raise PlanError(f"{len(plans)} plans for {topology.pp_size} ranks")
    kinds = [FORWARD] + [kind for kind in (BACKWARD, WEIGHT)
                         if any(t.kind == kind for plan in plans for t in plan)]
    for rank, plan in enumerate(plans):
        _check_complete(rank, plan, kinds, topology.num_chunks, num_microbatches)
    runners = [StaticReplay(r, topology, plan) for r, plan in enumerate(plans)]
    unit = {FORWARD: 1.0, BACKWARD: 1.0 if WEIGHT in kinds else 2.0, WEIGHT: 1.0}
    durations = {kind: [[unit[kind]] * num_microbatches] * topology.num_virtual_stages
                 for kind in kinds}
    try:
        result = run_pipeline(topology, runners, durations)
    except DeadlockError as error:
        raise PlanError(_deadlock_message(runners, topology, error.ranks)) from None
    return PlanCheck([max(in_flight_profile(plan)) for plan in plans],
                     [max(in_flight_profile(plan, BACKWARD)) for plan in plans],
                     result.makespan)


def _check_complete(rank, plan, kinds, num_chunks, m) -> None:
    seen = {}
    for index, task in enumerate(plan):
        if task.kind not in kinds or not (0 <= task.chunk < num_chunks
                                          and 0 <= task.microbatch < m):
            raise PlanError(f"rank {rank}, action {index}: {task} is not a task of this "
                            f"pipeline (kinds {'/'.join(kinds)}, chunks < {num_chunks}, "
                            f"microbatches < {m})")
        if task in seen:
            raise PlanError(f"rank {rank}: {task} appears twice (actions {seen[task]} and "
                            f"{index})")
        seen[task] = index
    for kind in kinds:
        for chunk in range(num_chunks):
            for i in range(m):
                if Task(kind, chunk, i) not in seen:
                    raise PlanError(f"rank {rank}: {Task(kind, chunk, i)} is missing")


def _deadlock_message(runners, topology, stuck) -> str:
    lines = []
    for rank in stuck:
        runner = runners[rank]
        task = runner.order[runner.position]
        predecessor = topology.local_predecessor(task)
        source = topology.source(rank, task)
        if predecessor is not None and not runner.done(predecessor):
            later = predecessor in runner.order[runner.position:]
            why = (f"it needs {predecessor} of the same rank, which comes "
                   f"{'later in its plan' if later else 'nowhere in its plan'}")
        else:
            src, produced = source
            blocked = runners[src]
            why = (f"it needs the output of {produced} on rank {src}, which never runs "
                   f"(rank {src} is stuck at action {blocked.position}: "
                   f"{blocked.order[blocked.position]})")
        lines.append(f"rank {rank}, action {runner.position}: {task} can never run: {why}")
    return "plans deadlock: " + "; ".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m megatron.dpp.plan",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedule", choices=SCHEDULES, required=True)
    parser.add_argument("--pp", type=int, required=True, help="pipeline ranks")
    parser.add_argument("--microbatches", type=int, required=True)
    parser.add_argument("--chunks", type=int, default=None,
                        help="model chunks per rank (default: 2 for interleaved, else 1)")
    parser.add_argument("--microbatch-group-size", type=int, default=None,
                        help="interleaved: megatron's microbatch_group_size_per_vp_stage "
                             "(default: --pp)")
    parser.add_argument("--rank", type=int, default=None, help="print this rank's plan only")
    parser.add_argument("--csv", action="store_true",
                        help="CSV (rank,kind,chunk,microbatch) instead of a table")
    return parser


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    chunks = args.chunks or (2 if args.schedule == "interleaved" else 1)
    for name in ("pp", "microbatches"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.rank is not None and not 0 <= args.rank < args.pp:
        parser.error(f"--rank {args.rank} not in [0, {args.pp})")
    try:
        plans = build_plans(args.schedule, args.pp, args.microbatches, chunks,
                            args.microbatch_group_size)
        check = check_plans(plans, PipelineTopology(args.pp, chunks), args.microbatches)
    except ValueError as error:
        parser.error(str(error))
    ranks = range(args.pp) if args.rank is None else [args.rank]
    shown = {rank: plans[rank] for rank in ranks}
    if args.csv:
        sys.stdout.write(format_actions(shown))
        return 0
    lines = ["rank kind chunk microbatch"]
    lines += [f"{rank:4d} {task.kind:>4s} {task.chunk:5d} {task.microbatch:10d}"
              for rank, plan in shown.items() for task in plan]
    split = args.schedule == "zb-h1"
    lines.append(f"# complete and deadlock-free; peak in flight per rank: "
                 f"{' '.join(map(str, check.peak_in_flight))}"
                 + (f" (F to W; F to B: {' '.join(map(str, check.peak_activations))})"
                    if split else "")
                 + f"; makespan {check.makespan:g} with F = 1, "
                 + ("B = W = 1" if split else "B = 2"))
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
