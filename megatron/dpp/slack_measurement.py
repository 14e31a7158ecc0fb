"""The runtime's side of choosing DPP's slack (megatron/dpp/slack_choice.py): what the first
training iterations measure, and the one decision every rank then follows.

During the first `MEASURED_ITERATIONS` training calls the schedule runs at slack 0 and an
`IterationRecord` keeps, per rank: each task's time (CUDA events on a GPU; on CPU the host
clock less the time the rank waited for a core, so that ranks sharing cores do not show
each other's work as their own cost spread), when each message was sent and when its
consumer first saw it, and the bytes each forward saved for its backward (the activations
a microbatch holds; parameters excluded), and on CPU its host and the cores it may run on
(ranks that outnumber their cores are simulated sharing them). A message's time from send
to usable is taken where its consumer was blocked waiting for it (it then saw it as it
landed); ranks of one host share CLOCK_MONOTONIC, and across hosts the clock offset cancels
in the mean of an edge's two directions (a one-way estimate from the round trip). After the
last measured call every rank sends its records to global rank 0 over a gloo group; rank 0
chooses the slack (`choose_slack`), logs why, and broadcasts it, so that every rank of every
pipeline runs the same slack.
"""

from __future__ import annotations

import functools
import logging
import os
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron.dpp.actions import BACKWARD, FORWARD, WEIGHT, Task
from megatron.dpp.slack_choice import Measured, MemoryBudget, SlackChoice, choose_slack
from megatron.dpp.topology import PipelineTopology

log = logging.getLogger(__name__)

# training calls measured at slack 0 before the slack is chosen: the first pays one-time
# costs (allocations, the first kernels), the medians over both shrug them off
MEASURED_ITERATIONS = 2
# Linux's per-thread scheduler statistics: time on a core, time waiting for one (ns), ...
SCHEDSTAT = "/proc/thread-self/schedstat"


def core_wait_s() -> float:
    """Seconds the calling thread has spent runnable but waiting for a core; 0.0 where the
    kernel keeps no such count (then a CPU task's time includes that wait)."""
    try:
        with open(SCHEDSTAT, "rb") as stats:
            return int(stats.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


@dataclass
class IterationRecord:
    """One rank's measurements of one training call (module docstring)."""

    task_ms: dict[tuple[str, int], list[float]] = field(default_factory=lambda: defaultdict(list))
    sent: dict[tuple[int, Task], float] = field(default_factory=dict)  # (dst, task) -> time
    # (src, task) -> (time first seen, whether the rank was blocked waiting for it)
    seen: dict[tuple[int, Task], tuple[float, bool]] = field(default_factory=dict)
    looked_for: set = field(default_factory=set)  # inputs found missing at a look
    saved_bytes: list[int] = field(default_factory=list)  # per forward
    waiting: bool = False  # inside the schedule's wait for an input
    _events: list = field(default_factory=list)  # CUDA: (kind, chunk, start, end)
    # CPU: (output, parameter storages) of forwards whose saved tensors are not counted yet
    _graphs: list = field(default_factory=list)

    def message_sent(self, dst: int, task: Task) -> None:
        self.sent[dst, task] = time.monotonic()

    def input_looked_at(self, src: int, task: Task, here: bool) -> None:
        key = (src, task)
        if not here:
            self.looked_for.add(key)
        elif key not in self.seen:
            self.seen[key] = (time.monotonic(), self.waiting and key in self.looked_for)

    def timed(self, task: Task, device: torch.device):
        return _TaskTimer(self, task, device)

    def saving(self, parameters, device: torch.device):
        """A context around a forward that counts the activations it leaves, given the
        forward's output (`keep`): on a GPU the allocator's growth; on CPU the tensors its
        autograd graph saved (once per storage, parameters left out), walked once the
        task's time is taken (`count_saved`). The walk reads the graph as it stands, so a
        backward that reads attributes of a saved weight (main_grad under the fused
        weight-gradient accumulation) finds them, as saved-tensor hooks would not let it."""
        if device.type == "cuda":
            return _AllocatedBytes(self, device)
        return _SavedGraph(self, {p.untyped_storage().data_ptr() for p in parameters})

    def count_saved(self) -> None:
        """CPU: the bytes each pending forward's graph saved (`saving`)."""
        for output, parameters in self._graphs:
            self.saved_bytes.append(saved_tensor_bytes(output.grad_fn, parameters))
        self._graphs.clear()

    def resolve(self) -> None:
        """CUDA: the task times from their events (after the stream finished them)."""
        if not self._events:
            return
        self._events[-1][3].synchronize()
        for kind, chunk, start, end in self._events:
            self.task_ms[kind, chunk].append(start.elapsed_time(end))
        self._events.clear()


class _TaskTimer:
    def __init__(self, record: IterationRecord, task: Task, device: torch.device):
        self.record, self.task, self.cuda = record, task, device.type == "cuda"

    def __enter__(self):
        if self.cuda:
            self.start = torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.start, self.waited = time.perf_counter(), core_wait_s()
        return self

    def __exit__(self, *exc):
        kind, chunk = self.task[0], self.task[1]
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.record._events.append((kind, chunk, self.start, end))
        else:
            elapsed = time.perf_counter() - self.start - (core_wait_s() - self.waited)
            self.record.task_ms[kind, chunk].append(1e3 * max(0.0, elapsed))
            self.record.count_saved()  # after the time is taken: the walk is not the task's
        return False


class _AllocatedBytes:
    def __init__(self, record: IterationRecord, device: torch.device):
        self.record, self.device = record, device

    def __enter__(self):
        self.before = torch.cuda.memory_allocated(self.device)
        return self

    def keep(self, output) -> None:
        """Nothing to keep: the allocator's growth is the count."""

    def __exit__(self, *exc):
        grown = torch.cuda.memory_allocated(self.device) - self.before
        self.record.saved_bytes.append(max(0, grown))
        return False


class _SavedGraph:
    def __init__(self, record: IterationRecord, parameter_storages: set[int]):
        self.record, self.parameters = record, parameter_storages

    def __enter__(self):
        return self

    def keep(self, output) -> None:
        """The forward's output, whose graph holds what the forward saved."""
        if isinstance(output, torch.Tensor) and output.grad_fn is not None:
            self.record._graphs.append((output, self.parameters))

    def __exit__(self, *exc):
        return False


def saved_tensor_bytes(root, skip: set[int]) -> int:
    """The bytes the autograd graph from node `root` back saved for its backward: every
    storage once, those in `skip` (the parameters') left out."""
    nodes, storages, total = set(), set(), 0
    pending = [root]
    while pending:
        node = pending.pop()
        if node is None or node in nodes:
            continue
        nodes.add(node)
        for tensor in _saved_tensors(node):
            storage = tensor.untyped_storage()
            pointer = storage.data_ptr()
            if pointer not in skip and pointer not in storages:
                storages.add(pointer)
                total += storage.nbytes()
        pending.extend(next_node for next_node, _ in node.next_functions)
    return total


@functools.lru_cache(maxsize=1024)
def _saved_names(node_type: type) -> tuple[str, ...]:
    """The attributes through which nodes of this type expose what they saved (`dir` is
    slow, and each operation has its own node type)."""
    return tuple(name for name in dir(node_type)
                 if name.startswith("_saved_") or name == "saved_tensors")


def _saved_tensors(node) -> list[torch.Tensor]:
    """What one graph node saved: a built-in node's `_saved_*` attributes, a custom
    Function's saved_tensors."""
    values = []
    for name in _saved_names(type(node)):
        try:
            values.append(getattr(node, name))
        except RuntimeError:  # freed already (a backward ran through it): holds nothing
            continue
    found = []
    for value in values:
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, torch.Tensor):
                found.append(item)
    return found


@dataclass(frozen=True)
class PipelineShape:
    """What the decision needs of the pipeline a rank belongs to."""

    ranks: tuple[int, ...]  # global ranks of the pipeline, by stage
    stage: int
    num_chunks: int
    num_microbatches: int
    split_backward: bool
    defer_weights: bool
    weight_slices: int
    cpu: bool = False  # the ranks compute on the host (their cores may be shared)
    weights_by_backward: bool = False  # the dynamic rule's W order (StageConfig's)


class SlackAdapter:
    """Runs the measured calls at slack 0, then the slack chosen from them (module
    docstring). `max_slack`: the largest candidate; `budget`: caps it by memory; `static`:
    the rule (None: chosen too, the plan in order running while measuring)."""

    def __init__(self, max_slack: int, static: bool | None,
                 budget: MemoryBudget | None = None):
        self.max_slack, self.static, self.budget = max_slack, static, budget
        self.records: list[IterationRecord] = []
        self.choice: SlackChoice | None = None

    def next_call(self, forward_only: bool) -> tuple[int, IterationRecord | None]:
        """The slack of the next call and, while measuring (training calls only), the
        record it fills."""
        if self.choice is not None:
            return self.choice.slack, None
        if forward_only:
            return 0, None
        return 0, IterationRecord()

    @property
    def runs_static(self) -> bool:
        """Whether the next call runs the plan in order."""
        if self.static is not None:
            return self.static
        return self.choice is None or self.choice.static

    def finished(self, record: IterationRecord, shape: PipelineShape) -> None:
        """After a measured call: keeps its record; after the last, chooses the slack (a
        collective over all ranks, which all reach it in the same training call)."""
        record.resolve()
        self.records.append(record)
        if len(self.records) < MEASURED_ITERATIONS:
            return
        group = dist.new_group(backend="gloo")
        mine = _summary(self.records, shape)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine, group=group)
        # the choice, or why there is none: every rank raises then, none waits on
        decision = [None]
        if dist.get_rank() == 0:
            try:
                decision[0] = self._decide(gathered, shape)
                log.info(decision[0].line())
            except ValueError as error:
                decision[0] = f"DPP cannot choose its slack: {error}"
        dist.broadcast_object_list(decision, src=0, group=group)
        dist.destroy_process_group(group)
        if isinstance(decision[0], str):
            raise RuntimeError(decision[0])
        self.choice = decision[0]
        self.records = []

    def _decide(self, summaries: list[dict], shape: PipelineShape) -> SlackChoice:
        measured = measured_from(summaries)
        budget = self.budget
        if budget is not None and budget.limit_bytes is not None \
                and measured.activation_bytes is None:
            raise ValueError(f"memory budget {budget.describe()}: the activations were "
                             "not measured (no forward saved any); give a factor such as "
                             "1.15x")
        return choose_slack(measured, len(shape.ranks), shape.num_microbatches,
                            num_chunks=shape.num_chunks, split_backward=shape.split_backward,
                            defer_weights=shape.defer_weights,
                            weight_slices=shape.weight_slices,
                            weights_by_backward=shape.weights_by_backward, static=self.static,
                            max_slack=self.max_slack, budget=self.budget)


def _summary(records: list[IterationRecord], shape: PipelineShape) -> dict:
    """What one rank sends to the deciding rank."""
    task_ms = defaultdict(list)
    for record in records:
        for key, values in record.task_ms.items():
            task_ms[key] += values
    # a W runs in parts, each timed alone; the decision simulates whole W tasks
    parts = {kind: shape.weight_slices if kind == WEIGHT else 1 for kind, _ in task_ms}
    saved = [b for record in records for b in record.saved_bytes if b > 0]
    # each F and B of the last measured call against its kind's median: how far a task
    # strays from the cost the decision assumes (the first call pays one-time costs)
    medians = {key: statistics.median(values) for key, values in task_ms.items()}
    spread = [value / medians[key] for key, values in records[-1].task_ms.items()
              if key[0] in (FORWARD, BACKWARD) and medians[key] > 0 for value in values]
    return {
        "ranks": shape.ranks, "stage": shape.stage, "chunks": shape.num_chunks,
        # CPU: the host, the cores this rank may run on and its compute threads
        "host": os.uname().nodename,
        "cpus": sorted(os.sched_getaffinity(0)) if shape.cpu else None,
        "threads": torch.get_num_threads(),
        "task_ms": {key: parts[key[0]] * statistics.median(values)
                    for key, values in task_ms.items()},
        # per forward of a chunk; a microbatch saves this once per chunk
        "saved_bytes": shape.num_chunks * statistics.median(saved) if saved else None,
        "spread": spread,
        "sent": [{(dst, tuple(task)): t for (dst, task), t in r.sent.items()} for r in records],
        "seen": [{(src, tuple(task)): v for (src, task), v in r.seen.items()} for r in records],
    }


def measured_from(summaries: list[dict]) -> Measured:
    """Every rank's summary as the decision's input: per virtual stage the median over the
    ranks that hold it (data and tensor parallel replicas), per edge the message time."""
    first = summaries[0]
    p, chunks = len(first["ranks"]), first["chunks"]
    topology = PipelineTopology(p, chunks)
    times: dict[tuple[str, int], list[float]] = defaultdict(list)
    saved: dict[int, list[float]] = defaultdict(list)
    hops: dict[int, list[float]] = defaultdict(list)
    by_rank = {summary["ranks"][summary["stage"]]: summary for summary in summaries}
    for summary in summaries:
        stage = summary["stage"]
        for (kind, chunk), value in summary["task_ms"].items():
            times[kind, topology.virtual_stage(stage, chunk)].append(value)
        if summary["saved_bytes"]:
            saved[stage].append(summary["saved_bytes"])
    for pipeline in {tuple(s["ranks"]) for s in summaries}:
        for edge, hop in _edge_hops([by_rank[rank] for rank in pipeline], p).items():
            hops[edge].append(hop)
    virtual = topology.num_virtual_stages

    def per_stage(kind: str) -> tuple[float, ...]:
        return tuple(statistics.median(times[kind, v]) if times[kind, v] else 0.0
                     for v in range(virtual))

    weight = per_stage(WEIGHT) if any(kind == WEIGHT for kind, _ in times) else None
    activation = None
    if len(saved) == p:
        activation = tuple(max(saved[r]) for r in range(p))
    spread = tuple(sorted(ratio for summary in summaries for ratio in summary["spread"]))
    return Measured(per_stage(FORWARD), per_stage(BACKWARD),
                    tuple(statistics.median(hops[e]) if hops[e] else 0.0 for e in range(p)),
                    weight, activation, spread or None, shared_cores(summaries, p))


def shared_cores(summaries: list[dict], p: int) -> float | None:
    """Where CPU ranks' threads outnumber the cores of their host, the cores a pipeline of
    p ranks shares: p times the least share of a core a thread gets on any host. None on
    GPUs, or with a core for every thread."""
    if any(summary.get("cpus") is None for summary in summaries):
        return None
    cores: dict[str, set[int]] = defaultdict(set)
    threads: dict[str, int] = defaultdict(int)
    for summary in summaries:
        cores[summary["host"]].update(summary["cpus"])
        threads[summary["host"]] += summary["threads"]
    share = min(len(cores[host]) / threads[host] for host in cores)
    return None if share >= 1 else p * share


def _edge_hops(stages: list[dict], p: int) -> dict[int, float]:
    """Edge e (between stages e and e + 1; p - 1: the last to the first) -> the mean of its
    two directions' median message times, from the messages their consumers waited for
    (else the quickest seen: an upper bound)."""
    waited: dict[tuple[int, int], list[float]] = defaultdict(list)
    loose: dict[tuple[int, int], list[float]] = defaultdict(list)
    for consumer in stages:
        dst = consumer["stage"]
        for index, seen in enumerate(consumer["seen"]):
            for (src, task), (when, tight) in seen.items():
                sent = stages[src]["sent"][index].get((dst, task))
                if sent is None:
                    continue
                (waited if tight else loose)[src, dst].append(when - sent)
    directions = {}
    for key in set(waited) | set(loose):
        values = waited.get(key)
        directions[key] = 1e3 * (statistics.median(values) if values else min(loose[key]))
    hops = {}
    for e in range(p):
        a, b = e, (e + 1) % p
        pair = [directions[key] for key in ((a, b), (b, a)) if key in directions]
        if pair:
            hops[e] = max(0.0, sum(pair) / len(pair))
    return hops
