"""Lower bounds on a pipeline's makespan from the task durations alone (kind -> [virtual
stage][microbatch], as the simulator's `Durations.by_kind` gives them). They say how much
faster than a given schedule any schedule could be:

* `memory_free_bound`, valid for every schedule at any memory and in any order: per rank r,
  the cheapest microbatch's forwards on the ranks before r, then all of rank r's work
  (a measured run's too: profiling/sim_compare.py);
* `rank0_bound`, valid for every schedule that runs each kind (F, B, W) of rank 0 in the
  microbatch order and holds at most p microbatches there from F to W (ZB-H1, and DPP at
  slack 0, whatever it decides): after its p warm-up forwards rank 0 can only run B(j), W(j),
  F(j + p) in turn (F(j + p) needs W(j); running W(j), F(j + p) before a ready B(j + 1) never
  delays anything), and B(j) waits for its gradient, which here travels through the other
  ranks without waiting for them (their contention dropped);
* `shared_cores_bound`, valid for every schedule where the ranks share a number of cores
  (megatron/dpp/engine.py): all ranks' compute over the cores;
* `in_order_bound`, valid for every schedule that runs each rank's forwards and backwards in
  one microbatch order (megatron-core's, ZB-H1, DPP's plan and rule) and holds at most
  held[r] microbatches from F to W on rank r: rank r starts F of the order's n-th
  microbatch no earlier than that microbatch's forwards could reach it if the ranks before it
  ran only their forwards, in order (a late forward upstream delays every later one), and
  from then on runs all its tasks of that and the later microbatches; its last B is the last
  microbatch's, which the B tasks of that microbatch on the ranks before it and then rank
  0's W of it follow, while rank r can run only the W tasks of the microbatches it holds (at
  most held[r], the last microbatch among them: its W follows that last B). Where one
  rank's work dominates, every such schedule takes, for the worst n, that arrival, that
  work and what of that tail its W tasks cannot cover. It is also no less than
  `release_tail_bound`. With `weights_in_order` it holds for the schedules that run each
  rank's W tasks in that order too (megatron-core's, ZB-H1, DPP's plan, and DPP's rule
  without `StageConfig.weights_by_backward`, as the trainer runs it on GPUs): the W tasks
  pending at the last B are then the last ones of the order;
* `release_tail_bound`, valid for every schedule that runs each rank's forwards and
  backwards in one microbatch order, at any memory: each task of rank r is released no
  earlier than its inputs could reach it if the ranks ran only the chains it depends on
  (forwards alone in order up to it; for a B, also the backwards alone in order after the
  last rank) and is followed by its successors' shortest chain (its tail); rank r then takes
  at least the preemptive Jackson schedule of its tasks (among the released ones the one
  with the longest tail runs, interrupted by a release with a longer one), which is the
  least the largest end plus tail can be when tasks may be interrupted. It counts what the
  arrival bound leaves out: a rank's earlier microbatches' tasks that cannot run before a
  late forward arrives either.
"""

from __future__ import annotations

import heapq

from megatron.dpp.actions import BACKWARD, FORWARD, WEIGHT, Task
from megatron.dpp.topology import PipelineTopology


def memory_free_bound(times: dict[str, list[list[float]]], p: int, m: int,
                      topology: PipelineTopology | None = None) -> float:
    """With `topology` (several chunks a rank) a rank's work is its virtual stages', and its
    lead-in the forwards of the virtual stages before its first. Without W in `times` (a
    backward run whole) B is the whole backward."""
    topology = topology or PipelineTopology(p, 1)
    work = [0.0] * p
    for v in range(topology.num_virtual_stages):
        work[topology.placement(v)[0]] += sum(sum(times[kind][v]) for kind in times)
    first = [min(v for v in range(topology.num_virtual_stages) if topology.placement(v)[0] == r)
             for r in range(p)]
    forward = times[FORWARD]
    return max(min(sum(forward[v][k] for v in range(first[r])) for k in range(m)) + work[r]
               for r in range(p))


def shared_cores_bound(times: dict[str, list[list[float]]],
                       waits: dict[str, list[list[float]]] | None, cores: float) -> float:
    """All the tasks' time but their waits (`waits`: as `times`, or None), over `cores`."""
    total = sum(sum(row) for table in times.values() for row in table)
    if waits is not None:
        total -= sum(sum(row) for table in waits.values() for row in table)
    return total / cores


def rank0_bound(times: dict[str, list[list[float]]], p: int, m: int,
                order: list[int]) -> float:
    """Rank 0's finish when it runs B(j) W(j) F(j + p) as early as the uncontended
    gradient of j allows (the module's docstring); one chunk a rank, the split backward."""
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


def in_order_bound(times: dict[str, list[list[float]]], p: int, m: int, held: list[int],
                   order: list[int] | None = None, weights_in_order: bool = False) -> float:
    """The module docstring's third bound, one chunk a rank; `order`: the microbatch order
    (default 0..m-1). Without W in `times` (a backward run whole) the tail is the B tasks'."""
    order = list(range(m)) if order is None else order
    return max(_arrival_bound(times, p, m, held, order, weights_in_order),
               release_tail_bound(times, p, m, order))


def _arrival_bound(times: dict[str, list[list[float]]], p: int, m: int, held: list[int],
                   order: list[int], weights_in_order: bool = False) -> float:
    """`in_order_bound` from the arrival of each rank's n-th forward and what follows it."""
    last = order[-1]
    forward, backward = times[FORWARD], times[BACKWARD]
    weight = times.get(WEIGHT)
    # arrival[n]: the earliest end of the n-th forward on the rank before (rank 0: inputs local)
    arrival = [0.0] * m
    bound = 0.0
    for r in range(p):
        tail = sum(backward[q][last] for q in range(r))
        if weight is not None and r:
            tail += weight[0][last]
        remaining = covered = 0.0
        # the W tasks that can cover the tail: the last microbatch's (held from its F until
        # its W, so pending when its B ends) and the held[r] - 1 longest of the others from
        # n on (a min-heap); W in order: the last held[r] of the order from n on
        longest: list[float] = []
        for n in range(m - 1, -1, -1):
            k = order[n]
            remaining += sum(times[kind][r][k] for kind in times)
            if weight is not None and weights_in_order:
                covered += weight[r][k] if n >= m - held[r] else 0.0
            elif weight is not None and held[r] > 0:
                if k == last:
                    covered += weight[r][k]
                elif len(longest) < held[r] - 1:
                    heapq.heappush(longest, weight[r][k])
                    covered += weight[r][k]
                elif longest and weight[r][k] > longest[0]:
                    covered += weight[r][k] - heapq.heapreplace(longest, weight[r][k])
            bound = max(bound, arrival[n] + remaining + max(0.0, tail - covered))
        done = 0.0
        for n, k in enumerate(order):
            done = max(done, arrival[n]) + forward[r][k]
            arrival[n] = done
    return bound


def sums_in_order(orders: list[list[Task]], order: list[int]) -> bool:
    """Whether every rank of a recorded run (one chunk a rank) ran its W tasks, or where it
    ran each backward whole its B tasks, in `order` (`in_order_bound`'s
    `weights_in_order`)."""
    return all(([task.microbatch for task in tasks if task.kind == WEIGHT]
                or [task.microbatch for task in tasks if task.kind == BACKWARD]) == order
               for tasks in orders)


def release_tail_bound(times: dict[str, list[list[float]]], p: int, m: int,
                       order: list[int] | None = None) -> float:
    """The module docstring's last bound, one chunk a rank; `order`: the microbatch order
    (default 0..m-1). Without W in `times` (a backward run whole) B is the whole backward."""
    order = list(range(m)) if order is None else order
    forward, backward = times[FORWARD], times[BACKWARD]
    weight = times.get(WEIGHT)
    # [r][n]: the earliest end of the n-th F (B) on rank r, the chains it needs run alone
    forward_end = [[0.0] * m for _ in range(p)]
    for r in range(p):
        end = 0.0
        for n, k in enumerate(order):
            end = max(end, forward_end[r - 1][n] if r else 0.0) + forward[r][k]
            forward_end[r][n] = end
    backward_end = [[0.0] * m for _ in range(p)]
    for r in range(p - 1, -1, -1):
        end = 0.0
        for n, k in enumerate(order):
            gradient = backward_end[r + 1][n] if r < p - 1 else 0.0
            end = max(end, forward_end[r][n], gradient) + backward[r][k]
            backward_end[r][n] = end
    # [r][k]: the least time from the end of a task to the iteration's (W: none)
    backward_tail = [[0.0] * m for _ in range(p)]
    for r in range(p):
        for k in range(m):
            own = weight[r][k] if weight is not None else 0.0
            below = backward[r - 1][k] + backward_tail[r - 1][k] if r else 0.0
            backward_tail[r][k] = max(own, below)
    forward_tail = [[0.0] * m for _ in range(p)]
    for r in range(p - 1, -1, -1):
        for k in range(m):
            forward_tail[r][k] = (forward[r + 1][k] + forward_tail[r + 1][k] if r < p - 1
                                  else backward[r][k] + backward_tail[r][k])
    bound = 0.0
    for r in range(p):
        tasks = []  # (release, work, tail)
        for n, k in enumerate(order):
            tasks.append((forward_end[r][n] - forward[r][k], forward[r][k], forward_tail[r][k]))
            tasks.append((backward_end[r][n] - backward[r][k], backward[r][k],
                          backward_tail[r][k]))
            if weight is not None:
                tasks.append((backward_end[r][n], weight[r][k], 0.0))
        bound = max(bound, _jackson_preemptive(tasks))
    return bound


def _jackson_preemptive(tasks: list[tuple[float, float, float]]) -> float:
    """The largest end plus tail of (release, work, tail) tasks on one processor, run in the
    preemptive Jackson order: the least any order, interruptions allowed, can reach."""
    tasks = sorted(tasks)
    waiting: list[tuple[float, float]] = []  # (-tail, work left): the longest tail first
    now = latest = 0.0
    i = 0
    while i < len(tasks) or waiting:
        if not waiting:
            now = max(now, tasks[i][0])
        while i < len(tasks) and tasks[i][0] <= now:
            _, work, tail = tasks[i]
            heapq.heappush(waiting, (-tail, work))
            i += 1
        negative_tail, work = heapq.heappop(waiting)
        next_release = tasks[i][0] if i < len(tasks) else float("inf")
        if now + work <= next_release:
            now += work
            latest = max(latest, now - negative_tail)
        else:  # interrupted at the next release, which may have a longer tail
            heapq.heappush(waiting, (negative_tail, work - (next_release - now)))
            now = next_release
    return latest
