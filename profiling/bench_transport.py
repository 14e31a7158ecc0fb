"""Bandwidth and latency of the DPP transports between two ranks of one host.

    torchrun --nproc_per_node=2 profiling/bench_transport.py --out DIR

On GPUs it measures the shm channel staged through host memory ("shm-staged"), the shm
channel's CUDA IPC path ("ipc") and torch.distributed NCCL send/recv ("nccl"); without
GPUs the shm host path and gloo, as a smoke check. Latency is half a ping-pong round trip
(the median of --repeats runs, which alternate between the transports); bandwidth is a
one-way stream of messages closed by a small acknowledgement. Rank 0
prints a table and writes DIR/bench_transport.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megatron.dpp.transport import native
from megatron.dpp.transport.channel import Edge, MessageKey, MessageKind
from megatron.dpp.transport.native import NativeInbox
from megatron.dpp.transport.shm import ShmBackend

logger = logging.getLogger("bench_transport")

# Round trips before each timed latency run: the first ones pay for lazy set-up (peer
# access, allocator blocks).
WARMUP_ROUND_TRIPS = 20
# Round trips of the smallest message on every transport before anything is timed: without
# them the first size measured came out slower than the next on every transport.
WARMUP_PHASE_ROUND_TRIPS = 2000
FORWARD = Edge(0, 1, MessageKind.ACTIVATION)
BACKWARD = Edge(1, 0, MessageKind.GRADIENT)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for the results")
    parser.add_argument("--min-bytes", type=int, default=4 << 10)
    parser.add_argument("--max-bytes", type=int, default=256 << 20)
    parser.add_argument("--stream-bytes", type=int, default=2 << 30,
                        help="bytes streamed per size for bandwidth (at least 8 messages)")
    parser.add_argument("--pingpongs", type=int, default=500,
                        help="round trips per latency run")
    parser.add_argument("--repeats", type=int, default=5,
                        help="latency runs per size and transport, interleaved across the "
                             "transports; the table shows their median")
    defaults = ShmBackend()
    parser.add_argument("--slots", type=int, default=defaults.slots)
    parser.add_argument("--slot-bytes", type=int, default=defaults.slot_bytes)
    parser.add_argument("--device-slot-bytes", type=int, default=defaults.device_slot_bytes)
    parser.add_argument("--spin-us", type=float, default=None,
                        help="microseconds a wait on a ring slot polls before it sleeps "
                             "(default: native.default_spin_us())")
    parser.add_argument("--inbox-spin-us", type=float, default=None,
                        help="microseconds a wait on the inbox polls before it sleeps "
                             "(default: native.default_spin_us())")
    parser.add_argument("--transports", default=None,
                        help="comma-separated subset of shm-host, shm-staged, ipc, nccl, "
                             "nccl-host, gloo (default: shm-staged, ipc, nccl, nccl-host on "
                             "GPUs; shm-host, gloo on CPU)")
    return parser.parse_args()


def sizes(low: int, high: int) -> list[int]:
    result, size = [], low
    while size <= high:
        result.append(size)
        size *= 4
    return result


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class ChannelPair:
    """One ShmBackend's channels in both directions, driven as mailbox messages."""

    def __init__(self, backend: ShmBackend, rank: int, spin_us: float | None):
        self.rank = rank
        self.inbox = NativeInbox(spin_us)
        self.senders, self.receivers = backend.open([FORWARD, BACKWARD], rank, self.inbox)
        self.counter = 0

    def _key(self, kind: MessageKind) -> MessageKey:
        return MessageKey(kind, 0, self.counter)

    def send(self, tensor: torch.Tensor) -> None:
        edge = FORWARD if self.rank == 0 else BACKWARD
        self.senders[edge].send(MessageKey(edge.kind, 0, self.counter), tensor)

    def recv(self) -> torch.Tensor:
        kind = BACKWARD.kind if self.rank == 0 else FORWARD.kind
        return self.inbox.take(MessageKey(kind, 0, self.counter), timeout=120)

    def step(self) -> None:
        self.counter += 1

    def close(self) -> None:
        for channel in [*self.senders.values(), *self.receivers.values()]:
            channel.close()


class TorchPair:
    """torch.distributed send/recv with the same interface. With `host_visible` the
    receiver synchronizes after each receive, as a mailbox must before it can tell the
    schedule that a message is here; without, NCCL's receives stay ordered on the GPU and
    the host never waits for one (the stream-ordered figure)."""

    def __init__(self, rank: int, host_visible: bool = False):
        self.peer = 1 - rank
        self.host_visible = host_visible
        self.buffer: torch.Tensor | None = None

    def send(self, tensor: torch.Tensor) -> None:
        dist.send(tensor, self.peer)

    def recv(self) -> torch.Tensor:
        dist.recv(self.buffer, self.peer)
        if self.host_visible:
            synchronize(self.buffer.device)
        return self.buffer

    def step(self) -> None:
        pass

    def close(self) -> None:
        pass


def latency(pair, rank: int, tensor: torch.Tensor, pingpongs: int) -> float:
    """One-way latency in us: half the mean of `pingpongs` round trips of `tensor`."""
    device = tensor.device
    if isinstance(pair, TorchPair):
        pair.buffer = torch.empty_like(tensor)
    for _ in range(WARMUP_ROUND_TRIPS):
        _round_trip(pair, rank, tensor)
    synchronize(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(pingpongs):
        _round_trip(pair, rank, tensor)
    synchronize(device)
    return (time.perf_counter() - start) / pingpongs / 2 * 1e6


def bandwidth(pair, rank: int, tensor: torch.Tensor, ack: torch.Tensor, streamed: int) -> float:
    """GB/s of a one-way stream of `streamed` messages like `tensor`, closed by `ack`."""
    device = tensor.device
    if isinstance(pair, TorchPair):
        pair.buffer = torch.empty_like(tensor)
    synchronize(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(streamed):
        if rank == 0:
            pair.send(tensor)
        else:
            pair.recv()
        pair.step()
    if isinstance(pair, TorchPair):
        pair.buffer = torch.empty_like(ack)
    if rank == 0:
        pair.recv()
    else:
        synchronize(device)
        pair.send(ack)
    pair.step()
    synchronize(device)
    seconds = time.perf_counter() - start
    return tensor.numel() * tensor.element_size() * streamed / seconds / 1e9


def _round_trip(pair, rank: int, tensor: torch.Tensor) -> None:
    if rank == 0:
        pair.send(tensor)
        pair.recv()
    else:
        pair.send(pair.recv())
    pair.step()


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args()
    on_gpu = torch.cuda.is_available()
    rank = int(os.environ["RANK"])
    if on_gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl" if on_gpu else "gloo")
    if dist.get_world_size() != 2:
        raise SystemExit("bench_transport.py needs exactly 2 ranks (--nproc_per_node=2)")
    torch.set_num_threads(1)
    gpu = torch.device("cuda", torch.cuda.current_device()) if on_gpu else None
    shm = dict(timeout=120.0, slots=args.slots, slot_bytes=args.slot_bytes,
               device_slot_bytes=args.device_slot_bytes, spin_us=args.spin_us)

    def channels(path: str) -> ChannelPair:
        return ChannelPair(ShmBackend(path=path, **shm), rank, args.inbox_spin_us)

    # name: (make the pair, device of its tensors)
    available = {"shm-host": (lambda: channels("auto"), torch.device("cpu"))}
    if on_gpu:
        available["nccl"] = (lambda: TorchPair(rank), gpu)
        available["nccl-host"] = (lambda: TorchPair(rank, host_visible=True), gpu)
        if native.build_info()["cuda"]:
            available["shm-staged"] = (lambda: channels("staged"), gpu)
            available["ipc"] = (lambda: channels("ipc"), gpu)
    else:
        available["gloo"] = (lambda: TorchPair(rank), torch.device("cpu"))
    default = "shm-staged,ipc,nccl,nccl-host" if on_gpu else "shm-host,gloo"
    names = (args.transports or default).split(",")
    unknown = [name for name in names if name not in available]
    if unknown:
        raise SystemExit(f"--transports: {unknown} not available here (have {list(available)})")

    # All pairs stay open so that the latency runs of the transports can alternate: a
    # machine that slows down for a while then slows every transport alike.
    pairs = {name: available[name][0]() for name in names}
    for name in names:
        warmup = torch.randn(args.min_bytes // 4, device=available[name][1])
        latency(pairs[name], rank, warmup, WARMUP_PHASE_ROUND_TRIPS)
    results = []
    for size in sizes(args.min_bytes, args.max_bytes):
        tensors = {name: torch.randn(size // 4, device=available[name][1]) for name in names}
        runs: dict[str, list[float]] = {name: [] for name in names}
        for _ in range(args.repeats):
            for name in names:
                runs[name].append(latency(pairs[name], rank, tensors[name], args.pingpongs))
        streamed = max(8, min(2000, args.stream_bytes // size))
        for name in names:
            ack = torch.zeros(1, device=available[name][1])
            rate = bandwidth(pairs[name], rank, tensors[name], ack, streamed)
            results.append({"transport": name, "bytes": size,
                            "latency_us": statistics.median(runs[name]),
                            "latency_runs_us": runs[name], "bandwidth_GBps": rate,
                            "messages": streamed})
            if rank == 0:
                logger.info("%-10s %10d B  %9.1f us (runs %s)  %8.2f GB/s", name, size,
                            statistics.median(runs[name]),
                            ", ".join(f"{run:.1f}" for run in runs[name]), rate)
    for pair in pairs.values():
        pair.close()
    dist.barrier()
    if rank == 0:
        write_report(args.out, results, gpu or torch.device("cpu"))
    dist.destroy_process_group()


def write_report(out: Path, results: list[dict], device: torch.device) -> None:
    out.mkdir(parents=True, exist_ok=True)
    names = list(dict.fromkeys(item["transport"] for item in results))
    by_key = {(item["transport"], item["bytes"]): item for item in results}
    header = "| bytes | " + " | ".join(f"{n} GB/s | {n} us" for n in names) + " |"
    lines = [f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}",
             "", header, "|" + "---|" * (1 + 2 * len(names))]
    for size in sorted({item["bytes"] for item in results}):
        cells = []
        for name in names:
            item = by_key.get((name, size))
            cells += ([f"{item['bandwidth_GBps']:.2f}", f"{item['latency_us']:.1f}"]
                      if item else ["-", "-"])
        lines.append(f"| {size} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    (out / "bench_transport.md").write_text(table + "\n")
    (out / "bench_transport.json").write_text(json.dumps(results, indent=1))
    logger.info("\n%s", table)


if __name__ == "__main__":
    main()
