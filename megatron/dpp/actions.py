"""Actions as data: a task is (kind, chunk, microbatch) on one pipeline rank.

Plans (megatron/dpp/plan.py) are per-rank lists of tasks; the policy chooses tasks, the
simulator's engine and the runtime execute them, and the runtime records the order it ran.
All of them share this one representation and its CSV form:

    rank,kind,chunk,microbatch          one action per line, in execution order per rank
    0,F,0,0

A file that holds several iterations (the runtime's record under --trace) has a leading
`iteration` column. `chunk` is the rank's local model chunk (megatron's vp_stage).
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

FORWARD = "F"
BACKWARD = "B"  # the whole backward, or (with the split backward) the input gradient
WEIGHT = "W"  # the weight gradient of a split backward
KINDS = (FORWARD, BACKWARD, WEIGHT)

COLUMNS = ("rank", "kind", "chunk", "microbatch")
ITERATION_COLUMN = "iteration"


class Task(NamedTuple):
    """One action of one rank. A tuple, so hashing and comparing are cheap (the simulator
    handles millions of them)."""

    kind: str
    chunk: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}(chunk {self.chunk}, microbatch {self.microbatch})"


def releasing_kind(order: Iterable[Task]) -> str:
    """The kind after which a microbatch's activations are freed: its backward, or its
    weight-gradient task when the order splits the backward."""
    return WEIGHT if any(task.kind == WEIGHT for task in order) else BACKWARD


def in_flight_profile(order: Sequence[Task], release: str | None = None) -> list[int]:
    """Microbatches in flight (forward done, activations not yet freed) after each prefix
    of one rank's `order`; `release` (default `releasing_kind(order)`) is the kind that
    ends a microbatch's count: BACKWARD counts from F to B even in a split order."""
    release = release or releasing_kind(order)
    counts = [0]
    for task in order:
        step = 1 if task.kind == FORWARD else -1 if task.kind == release else 0
        counts.append(counts[-1] + step)
    return counts


class ActionFileError(ValueError):
    """A malformed actions CSV; the message names the file and line."""


def write_actions(file, plans: Mapping[int, Sequence[Task]], iteration: int | None = None,
                  header: bool = True) -> None:
    """Rows of `plans` (rank -> its tasks in order) to a text file; with `iteration`, the
    leading iteration column."""
    writer = csv.writer(file, lineterminator="\n")
    lead = [] if iteration is None else [iteration]
    if header:
        writer.writerow(([ITERATION_COLUMN] if iteration is not None else []) + list(COLUMNS))
    for rank in sorted(plans):
        for task in plans[rank]:
            writer.writerow(lead + [rank, task.kind, task.chunk, task.microbatch])


def format_actions(plans: Mapping[int, Sequence[Task]]) -> str:
    buffer = io.StringIO()
    write_actions(buffer, plans)
    return buffer.getvalue()


def read_actions(path: str) -> dict[int | None, dict[int, list[Task]]]:
    """iteration (None without the column) -> rank -> tasks in file order."""
    with open(path, newline="") as file:
        return parse_actions(file, path)


def parse_actions(lines: Iterable[str], name: str = "<actions>"
                  ) -> dict[int | None, dict[int, list[Task]]]:
    reader = csv.reader(lines)
    header = next(reader, None)
    with_iteration = header == [ITERATION_COLUMN, *COLUMNS]
    if header != list(COLUMNS) and not with_iteration:
        raise ActionFileError(f"{name}:1: header {header} is not "
                              f"{','.join(COLUMNS)} (optionally after '{ITERATION_COLUMN}')")
    out: dict[int | None, dict[int, list[Task]]] = {}
    for line, row in enumerate(reader, start=2):
        if not row:
            continue
        fields = list(row)
        try:
            iteration = int(fields.pop(0)) if with_iteration else None
            rank, kind, chunk, microbatch = fields
            rank, chunk, microbatch = int(rank), int(chunk), int(microbatch)
        except ValueError:
            raise ActionFileError(f"{name}:{line}: expected {len(header)} fields "
                                  f"({','.join(header)}), got {row}") from None
        if kind not in KINDS or min(rank, chunk, microbatch) < 0:
            raise ActionFileError(f"{name}:{line}: bad action {row}: kind must be one of "
                                  f"{'/'.join(KINDS)}, rank, chunk and microbatch >= 0")
        out.setdefault(iteration, {}).setdefault(rank, []).append(Task(kind, chunk, microbatch))
    return out
