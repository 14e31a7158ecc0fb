"""What was live at a rank's peak of allocated CUDA memory, by the code that allocated it.

Reads a snapshot of `--record-memory-history` (megatron/trainer/run/memory_history.py; any
`torch.cuda.memory._snapshot()` pickle with its history), replays its allocations and frees
to the moment the allocated bytes were highest (what `torch.cuda.max_memory_allocated`
reports, when the history reaches back to the run's start), and sums what was live then by
call site: the innermost frame outside torch. With `--against`, the same for a second run and
the difference per site, e.g. DPP's first step against 1F1B's:

    python profiling/memory_peak.py dpp/snapshot-rank0.pickle --against 1f1b/snapshot-rank0.pickle

Snapshots are read with pickle: read only files your own runs wrote.
"""

from __future__ import annotations

import argparse
import pickle
import sys
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path

MB = 1 << 20
LIVE_STATES = ("active_allocated", "active_pending_free")  # allocated until the free completes


@dataclass
class Peak:
    bytes: int  # allocated at the peak, with what was live before the history began
    before_history: int  # allocated before the first recorded event (no site known)
    event: int  # index of the allocation that reached the peak (-1: no event)
    events: int
    sites: Counter  # bytes live at the peak by call site


def call_site(frames: list[dict]) -> str:
    """The innermost frame outside torch: the code that asked for the memory."""
    for frame in frames:
        name = frame.get("filename", "")
        if "/torch/" not in name and not name.startswith("??"):
            at = name.find("/megatron/")
            short = name[at + 1:] if at >= 0 else Path(name).name
            return f"{short}:{frame.get('line', '?')} {frame.get('name', '')}"
    return "torch (no frame outside it)" if frames else "(no stack recorded)"


def device_trace(snapshot: dict) -> list[dict]:
    """The trace of the device with the most events (the rank's own)."""
    traces = snapshot.get("device_traces") or [[]]
    return max(traces, key=len)


def allocated_now(snapshot: dict) -> int:
    return sum(block["size"] for segment in snapshot.get("segments", [])
               for block in segment.get("blocks", []) if block.get("state") in LIVE_STATES)


def replay(trace: list[dict], until: int | None = None):
    """(event index, bytes allocated, live {address: event}) after each event up to `until`:
    a block counts from its allocation until its free completes."""
    live: dict[int, dict] = {}
    running = 0
    for index, event in enumerate(trace if until is None else trace[:until + 1]):
        if event.get("action") == "alloc":
            running += event["size"]
            live[event["addr"]] = event
        elif event.get("action") == "free_completed":
            running -= event["size"]
            live.pop(event["addr"], None)
        yield index, running, live


def find_peak(snapshot: dict) -> Peak:
    trace = device_trace(snapshot)
    high, high_event, running = 0, -1, 0
    for index, running, _ in replay(trace):
        if running > high:
            high, high_event = running, index
    before = allocated_now(snapshot) - running
    # the live set at the peak: replayed again up to it (cheaper than copying it at each high)
    last = deque(replay(trace, until=high_event), maxlen=1)
    sites = Counter()
    for event in (last[0][2] if last else {}).values():
        sites[call_site(event.get("frames", []))] += event["size"]
    return Peak(before + high, before, high_event, len(trace), sites)


def load(path: Path) -> dict:
    with open(path, "rb") as file:
        snapshot = pickle.load(file)
    if not isinstance(snapshot, dict) or "segments" not in snapshot:
        raise SystemExit(f"{path}: not a CUDA memory snapshot (torch.cuda.memory._snapshot())")
    if not any(snapshot.get("device_traces") or []):
        raise SystemExit(f"{path}: the snapshot has no history (recorded without "
                         "--record-memory-history?)")
    return snapshot


def report(name: str, peak: Peak, top: int) -> list[str]:
    lines = [f"{name}: peak {peak.bytes / MB:,.1f} MB allocated at event {peak.event + 1} of "
             f"{peak.events}; {peak.before_history / MB:,.1f} MB of it from before the history"]
    lines += [f"  {size / MB:10,.1f} MB  {site}" for site, size in peak.sites.most_common(top)]
    return lines


def compare(name: str, peak: Peak, other_name: str, other: Peak, top: int) -> list[str]:
    lines = [f"{name} - {other_name} at their peaks: {(peak.bytes - other.bytes) / MB:+,.1f} MB "
             f"({(peak.before_history - other.before_history) / MB:+,.1f} MB from before the "
             "histories)"]
    differences = Counter(peak.sites)
    differences.subtract(other.sites)
    ranked = sorted((item for item in differences.items() if item[1]),
                    key=lambda item: -abs(item[1]))
    lines += [f"  {size / MB:+10,.2f} MB  {site}" for site, size in ranked[:top]]
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("snapshot", type=Path)
    parser.add_argument("--against", type=Path, default=None, help="a second run's snapshot")
    parser.add_argument("--top", type=int, default=20, help="call sites listed")
    args = parser.parse_args(argv)
    peak = find_peak(load(args.snapshot))
    lines = report(str(args.snapshot), peak, args.top)
    if args.against is not None:
        other = find_peak(load(args.against))
        lines += report(str(args.against), other, args.top)
        lines += compare(args.snapshot.name, peak, args.against.name, other, args.top)
    sys.stdout.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
