"""The span recorder behind --trace: each rank writes its forward, backward, weight, send,
receive-wait, grad-sync and optimizer-step spans, with microbatch, chunk and stage, to
DIR/trace-rank<R>.jsonl; profiling/aggregate.py merges the ranks into one Chrome trace.
Under DPP each rank also writes the actions it executed, in order, to
DIR/trace-rank<R>.actions.csv (megatron/dpp/actions.py's CSV with an iteration column);
profiling/sim_compare.py replays them in the simulator.

Clocks: the host's monotonic clock on CPU; on GPU, CUDA events on the current stream,
resolved at the end of each traced iteration (the hot path never waits for the device).
Ranks on rank 0's host share its monotonic clock; a rank on another host measures its
clock's offset to rank 0's at start by ping-pong (best of a few round trips), so all spans
share rank 0's time axis, across processes and nodes.

Tracing off: the trainer holds a `NullTracer`, whose spans are one shared no-op context.
Static schedules: megatron.core reports its compute, p2p and grad-sync phases through
`config.timers`; `MegatronTimers` turns those into spans and labels the k-th forward and
backward of an iteration with the k-th of `megatron.dpp.plan.static_order`.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import socket
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from megatron.dpp.actions import FORWARD, write_actions
from megatron.dpp.plan import StageConfig, static_order

FORMAT = "megatron-dpp-trace"
VERSION = 1
KINDS = ("forward", "backward", "weight", "send", "recv_wait", "grad_sync",
         "optimizer")
DEFAULT_DIR = "traces"
_SYNC_ROUNDS = 8


def trace_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"trace-rank{rank}.jsonl")


def actions_path(trace_file: str) -> str:
    """The executed actions' CSV beside a rank's span file."""
    return os.path.splitext(trace_file)[0] + ".actions.csv"


class NullTracer:
    """Tracing off: every method is a no-op."""

    active = False
    _NO_SPAN = contextlib.nullcontext()

    def span(self, kind: str, microbatch: int | None = None, chunk: int | None = None):
        return self._NO_SPAN

    def start(self, kind: str, microbatch: int | None = None, chunk: int | None = None):
        return None

    def stop(self, token) -> None:
        pass

    def record_actions(self, stage: int, actions) -> None:
        pass

    def note_schedule(self, slack: int, static: bool) -> None:
        pass

    def begin_iteration(self, iteration: int, num_microbatches: int) -> None:
        pass

    def end_iteration(self) -> None:
        pass

    def megatron_timers(self, label_compute: bool):
        return None

    def close(self) -> None:
        pass


class _WallClock:
    def __init__(self, origin_ns: int):
        self.origin_ns = origin_ns

    def anchor(self) -> None:
        pass

    def mark(self) -> int:
        return time.perf_counter_ns()

    def resolve(self, marks: list) -> list[float]:
        return [(m - self.origin_ns) / 1000.0 for m in marks]


class _CudaClock:
    """Events are placed on the host axis through a reference event recorded while the
    device is idle (after a synchronize at the iteration's start)."""

    def __init__(self, origin_ns: int, device: torch.device):
        self.origin_ns = origin_ns
        self.device = device
        self._ref = None
        self._ref_host_ns = 0

    def anchor(self) -> None:
        torch.cuda.synchronize(self.device)
        self._ref = torch.cuda.Event(enable_timing=True)
        self._ref.record()
        self._ref_host_ns = time.perf_counter_ns()

    def mark(self):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def resolve(self, marks: list) -> list[float]:
        torch.cuda.synchronize(self.device)
        base = (self._ref_host_ns - self.origin_ns) / 1000.0
        return [base + self._ref.elapsed_time(m) * 1000.0 for m in marks]


class _Span:
    __slots__ = ("tracer", "token")

    def __init__(self, tracer: Tracer, token):
        self.tracer, self.token = tracer, token

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.tracer.stop(self.token)
        return False


class Tracer:
    """Records spans of the iterations in `iterations` (None: all) and appends them to
    `path` at the end of each. `meta` (rank, stage, ...) goes into the file's header line."""

    def __init__(self, path: str, meta: dict, device: torch.device, origin_ns: int,
                 iterations=None):
        self._clock = (_CudaClock(origin_ns, device) if device.type == "cuda"
                       else _WallClock(origin_ns))
        self.device = device
        self.meta = meta
        self.iterations = None if iterations is None else set(iterations)
        self.active = False
        self._records: list[tuple] = []
        self._iteration = 0
        self._num_microbatches = 0
        self._labels = {"forward": [], "backward": []}
        self._counts = {"forward": 0, "backward": 0}
        self._schedule: dict = {}  # this iteration's DPP slack and rule (note_schedule)
        self._start_mark = None
        self._actions: dict[int, list] = {}  # stage -> this iteration's executed actions
        self._actions_path = actions_path(path)
        self._actions_file = None  # opened at the first record (DPP only)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self._file = open(path, "w")
        self._write({"format": FORMAT, "version": VERSION, **meta,
                     "timing": "cuda-events" if device.type == "cuda" else "host-clock"})

    def span(self, kind: str, microbatch: int | None = None, chunk: int | None = None):
        if not self.active:
            return NullTracer._NO_SPAN
        return _Span(self, (kind, microbatch, chunk, self._clock.mark()))

    def start(self, kind: str, microbatch: int | None = None, chunk: int | None = None):
        if not self.active:
            return None
        return (kind, microbatch, chunk, self._clock.mark())

    def stop(self, token) -> None:
        if token is not None and self.active:
            self._records.append((*token, self._clock.mark()))

    def record_actions(self, stage: int, actions) -> None:
        """The actions a DPP schedule call ran, in order; written at the iteration's end."""
        if self.active:
            self._actions.setdefault(stage, []).extend(actions)

    def note_schedule(self, slack: int, static: bool) -> None:
        """The slack and rule DPP's training call of this iteration runs (the header's
        slack is the largest it may choose): written into the iteration's record."""
        if self.active:
            self._schedule = {"dpp_slack": slack, "dpp_static": static}

    def next_label(self, kind: str) -> tuple[int | None, int | None]:
        """(microbatch, chunk) of this iteration's next `kind` task in the static order."""
        count = self._counts[kind]
        self._counts[kind] = count + 1
        labels = self._labels[kind]
        return labels[count] if count < len(labels) else (None, None)

    def begin_iteration(self, iteration: int, num_microbatches: int) -> None:
        self.active = self.iterations is None or iteration in self.iterations
        if not self.active:
            return
        self._iteration, self._num_microbatches = iteration, num_microbatches
        self._counts = {"forward": 0, "backward": 0}
        self._schedule = {}
        if self.meta["schedule"] != "dpp":
            self._labels = _static_labels(self.meta, num_microbatches)
        self._clock.anchor()
        self._start_mark = self._clock.mark()

    def end_iteration(self) -> None:
        if not self.active:
            return
        end_mark = self._clock.mark()
        marks = [self._start_mark, end_mark]
        for record in self._records:
            marks += [record[3], record[4]]
        times = self._clock.resolve(marks)
        times = [round(t, 3) for t in times]
        self._write({"iteration": self._iteration, "microbatches": self._num_microbatches,
                     "start_us": times[0], "end_us": times[1],
                     "peak_memory_bytes": peak_memory_bytes(self.device), **self._schedule})
        for index, (kind, microbatch, chunk, _, _) in enumerate(self._records):
            start, end = times[2 + 2 * index], times[3 + 2 * index]
            self._write({"kind": kind, "it": self._iteration, "mb": microbatch, "chunk": chunk,
                         "start_us": start, "dur_us": round(max(0.0, end - start), 3)})
        self._file.flush()
        self._records.clear()
        if self._actions:
            first = self._actions_file is None
            if first:
                self._actions_file = open(self._actions_path, "w", newline="")
            write_actions(self._actions_file, self._actions, self._iteration, header=first)
            self._actions_file.flush()
            self._actions.clear()
        self.active = False

    def megatron_timers(self, label_compute: bool) -> MegatronTimers:
        return MegatronTimers(self, label_compute)

    def close(self) -> None:
        for file in (self._file, self._actions_file):
            if file is not None and not file.closed:
                file.close()

    def _write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")


def _static_labels(meta: dict, num_microbatches: int) -> dict[str, list]:
    stage = StageConfig(meta["stage"], meta["pp_size"], meta["num_chunks"], num_microbatches)
    order = static_order(stage)
    return {
        "forward": [(t.microbatch, t.chunk) for t in order if t.kind == FORWARD],
        "backward": [(t.microbatch, t.chunk) for t in order if t.kind != FORWARD],
    }


class _TimerSpan:
    __slots__ = ("tracer", "kind", "labelled", "token")

    def __init__(self, tracer: Tracer, kind: str | None, labelled: bool):
        self.tracer, self.kind, self.labelled, self.token = tracer, kind, labelled, None

    def start(self, barrier: bool = False) -> None:
        # megatron's barrier option is ignored: a barrier would change what is measured
        if self.kind is None or not self.tracer.active:
            return
        microbatch, chunk = self.tracer.next_label(self.kind) if self.labelled else (None, None)
        self.token = self.tracer.start(self.kind, microbatch, chunk)

    def stop(self, barrier: bool = False) -> None:
        token, self.token = self.token, None
        self.tracer.stop(token)


class MegatronTimers:
    """Stands in for megatron.core's `config.timers`: core calls `timers(name).start()` and
    `.stop()` around forward/backward compute, p2p sends and receives and the grad sync.
    A combined send-and-receive (e.g. forward-send-backward-recv) blocks until its receive
    completes and counts as receive-wait. `label_compute` False (DPP, which traces its own
    tasks): only the grad sync is taken from the timers."""

    def __init__(self, tracer: Tracer, label_compute: bool):
        self.tracer = tracer
        self.label_compute = label_compute
        self._timers: dict[str, _TimerSpan] = {}

    def __call__(self, name: str, log_level: int | None = None) -> _TimerSpan:
        timer = self._timers.get(name)
        if timer is None:
            kind = _timer_kind(name)
            if not self.label_compute and kind != "grad_sync":
                kind = None
            timer = _TimerSpan(self.tracer, kind, kind in ("forward", "backward"))
            self._timers[name] = timer
        return timer


def _timer_kind(name: str) -> str | None:
    if name == "forward-compute":
        return "forward"
    if name == "backward-compute":
        return "backward"
    if name == "all-grads-sync":
        return "grad_sync"
    if name.endswith("-recv"):
        return "recv_wait"
    if name.endswith("-send"):
        return "send"
    return None


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated CUDA memory on GPU; the process's peak resident set on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def gather_peak_memory(device: torch.device) -> list[int]:
    """Every rank's `peak_memory_bytes` (a collective: all ranks call it)."""
    mine = torch.tensor([peak_memory_bytes(device)], dtype=torch.int64, device=device)
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    return [int(t.item()) for t in gathered]


def memory_line(peaks: list[int], device: torch.device) -> str:
    what = "max allocated" if device.type == "cuda" else "max RSS"
    return f"memory per rank ({what}, MB): " + " | ".join(
        f"{rank}: {value / 2**20:.1f}" for rank, value in enumerate(peaks))


def _clock_offset_ns(device: torch.device) -> tuple[int, int]:
    """(offset to rank 0's perf_counter_ns, round trip of the best sample). Ranks on rank
    0's host read the same system-wide monotonic clock: offset 0, exactly (a measured one
    would only add its error, up to half a round trip, which grows with the host's load).
    Ranks on other hosts measure it by ping-pong; rank 0 answers each in turn."""
    hosts: list = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    remote = [r for r in range(1, len(hosts)) if hosts[r] != hosts[0]]
    buffer = torch.zeros(1, dtype=torch.int64, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *_: None)
    rank = dist.get_rank()
    if rank == 0:
        for peer in remote:
            for _ in range(_SYNC_ROUNDS):
                dist.recv(buffer, peer)
                sync(device)
                buffer.fill_(time.perf_counter_ns())
                dist.send(buffer, peer)
        return 0, 0
    if rank not in remote:
        return 0, 0
    best = None
    for _ in range(_SYNC_ROUNDS):
        sent = time.perf_counter_ns()
        dist.send(buffer, 0)
        dist.recv(buffer, 0)
        remote_ns = int(buffer.item())
        received = time.perf_counter_ns()
        sample = (received - sent, remote_ns - (sent + received) // 2)
        best = sample if best is None or sample[0] < best[0] else best
    return best[1], best[0]


def open_tracer(device: torch.device, num_chunks: int, schedule: str, slack: int | None,
                directory: str | None = None,
                iterations: Sequence[int] | None = None) -> Tracer:
    """A Tracer for this rank, writing under `directory` (default DEFAULT_DIR) the
    `iterations` (default all); `schedule` ("dpp", "1f1b", "interleaved" or "none") and
    DPP's `slack` go into its header. Every rank calls this (the clock sync is collective)."""
    from megatron.core import parallel_state

    offset_ns, round_trip_ns = _clock_offset_ns(device)
    anchor = torch.tensor([time.perf_counter_ns(), time.time_ns()], dtype=torch.int64,
                          device=device)
    dist.broadcast(anchor, 0)
    origin_rank0_ns, run_wall_ns = (int(v) for v in anchor.tolist())
    meta = {
        "run_id": run_wall_ns, "rank": dist.get_rank(), "world_size": dist.get_world_size(),
        "stage": parallel_state.get_pipeline_model_parallel_rank(),
        "pp_size": parallel_state.get_pipeline_model_parallel_world_size(),
        "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
        "dp_rank": parallel_state.get_data_parallel_rank(), "num_chunks": num_chunks,
        "schedule": schedule, "dpp_slack": slack, "device": str(device),
        "host": socket.gethostname(),
        "clock_offset_us": offset_ns / 1000.0, "clock_round_trip_us": round_trip_ns / 1000.0,
    }
    return Tracer(trace_path(directory or DEFAULT_DIR, dist.get_rank()), meta, device,
                  origin_ns=origin_rank0_ns - offset_ns,
                  iterations=iterations)
