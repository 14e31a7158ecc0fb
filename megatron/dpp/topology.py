"""The pipeline's shape: which rank and chunk hold a virtual stage, where a task's input
comes from and where its output goes. Pure Python; the plans, the policy, the simulator,
the runtime and the transport set-up all ask this module, and no other file computes a
virtual stage.

megatron-core's layout: `pp_size` ranks each hold `num_chunks` model chunks; chunk c of
rank r is virtual stage c * pp_size + r, so the virtual stages run around the ranks
`num_chunks` times (the last rank's chunk c feeds rank 0's chunk c + 1).

Dependencies of a task of virtual stage v on microbatch i:
* F needs the activation of F(v - 1, i) (v = 0: the data, local);
* B needs F(v, i) on the same rank and the gradient of B(v + 1, i) (v = last: the loss,
  local);
* W (split backward) needs B(v, i) on the same rank, nothing from another rank.
"""

from __future__ import annotations

from megatron.dpp.actions import BACKWARD, FORWARD, WEIGHT, Task

# the kind of task whose completion on the same rank a task needs first
LOCAL_PREDECESSOR = {BACKWARD: FORWARD, WEIGHT: BACKWARD}


class PipelineTopology:
    """`stage_of[rank][chunk]` is the virtual stage; `routes[rank][kind][chunk]` is
    (destination rank, destination chunk) of that task's output, or None where the output
    stays on the rank (the last forward, the first backward, every W). Both are plain
    lists and dicts for the simulator's inner loop."""

    def __init__(self, pp_size: int, num_chunks: int = 1):
        if pp_size < 1 or num_chunks < 1:
            raise ValueError(f"PipelineTopology: pp_size {pp_size} and num_chunks {num_chunks} "
                             "must be >= 1")
        self.pp_size = pp_size
        self.num_chunks = num_chunks
        self.num_virtual_stages = pp_size * num_chunks
        self.stage_of = [[chunk * pp_size + rank for chunk in range(num_chunks)]
                         for rank in range(pp_size)]
        self._placement = [(v % pp_size, v // pp_size) for v in range(self.num_virtual_stages)]
        last = self.num_virtual_stages - 1
        self.routes = []
        for rank in range(pp_size):
            stages = self.stage_of[rank]
            self.routes.append({
                FORWARD: [None if v == last else self._placement[v + 1] for v in stages],
                BACKWARD: [None if v == 0 else self._placement[v - 1] for v in stages],
                WEIGHT: [None] * num_chunks,
            })

    def __repr__(self) -> str:
        return f"PipelineTopology(pp_size={self.pp_size}, num_chunks={self.num_chunks})"

    def virtual_stage(self, rank: int, chunk: int) -> int:
        self._check(rank, chunk)
        return self.stage_of[rank][chunk]

    def placement(self, virtual_stage: int) -> tuple[int, int]:
        """(rank, chunk) holding the virtual stage."""
        if not 0 <= virtual_stage < self.num_virtual_stages:
            raise ValueError(f"virtual stage {virtual_stage} not in "
                             f"[0, {self.num_virtual_stages}) for {self}")
        return self._placement[virtual_stage]

    def is_first(self, rank: int, chunk: int) -> bool:
        return self.virtual_stage(rank, chunk) == 0

    def is_last(self, rank: int, chunk: int) -> bool:
        return self.virtual_stage(rank, chunk) == self.num_virtual_stages - 1

    def input_is_local(self, rank: int, task: Task) -> bool:
        """True when no other rank sends this task's input: F of the first virtual stage
        (data), B of the last (the loss), every W."""
        v = self.virtual_stage(rank, task.chunk)
        if task.kind == FORWARD:
            return v == 0
        if task.kind == BACKWARD:
            return v == self.num_virtual_stages - 1
        return True

    def source(self, rank: int, task: Task) -> tuple[int, Task] | None:
        """(rank, task) whose output is this task's input, or None when it is local."""
        v = self.virtual_stage(rank, task.chunk)
        if task.kind == FORWARD:
            neighbour = v - 1
        elif task.kind == BACKWARD:
            neighbour = v + 1
        else:
            return None
        if not 0 <= neighbour < self.num_virtual_stages:
            return None
        src, chunk = self._placement[neighbour]
        return src, Task(task.kind, chunk, task.microbatch)

    def destination(self, rank: int, task: Task) -> tuple[int, Task] | None:
        """(rank, task) that consumes this task's output, or None when no other stage
        does."""
        self._check(rank, task.chunk)
        route = self.routes[rank][task.kind][task.chunk]
        if route is None:
            return None
        dst, chunk = route
        return dst, Task(task.kind, chunk, task.microbatch)

    @staticmethod
    def local_predecessor(task: Task) -> Task | None:
        """The task of the same rank that must have run before this one (B: its F; W: its
        B), or None."""
        kind = LOCAL_PREDECESSOR.get(task.kind)
        return None if kind is None else Task(kind, task.chunk, task.microbatch)

    def message_edges(self) -> list[tuple[int, int, str]]:
        """Every (source rank, destination rank, task kind) some output travels along, in
        a canonical order: activations follow the virtual stages up (closing the ring
        from the last rank to rank 0 with several chunks), gradients come back down."""
        edges = set()
        for rank in range(self.pp_size):
            for kind, targets in self.routes[rank].items():
                edges.update((rank, route[0], kind) for route in targets if route is not None)
        return sorted(edges)

    def _check(self, rank: int, chunk: int) -> None:
        if not (0 <= rank < self.pp_size and 0 <= chunk < self.num_chunks):
            raise ValueError(f"rank {rank}, chunk {chunk} not in {self}")
