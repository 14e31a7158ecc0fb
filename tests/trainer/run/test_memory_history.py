"""--record-memory-history (Megatron-LM's flag) and profiling/memory_peak.py: the snapshot is
written per rank, whole, at the first step, every --log-interval and at the end (an error's
too); the reader finds the peak of allocated bytes and what was live then, by call site."""

from __future__ import annotations

import logging
import pickle

import pytest
import torch

from megatron.trainer.config.arguments import ArgumentError, parse_args
from megatron.trainer.run.memory_history import MemoryHistory, memory_history_refusal, snapshot_path
from profiling import memory_peak
from tests.pipeline_runs import TINY_GPT

MB = 1 << 20


def frames(*names):
    return [{"filename": name.split(":")[0], "line": int(name.split(":")[1]), "name": "f"}
            for name in names]


def alloc(addr, mb, *where):
    return {"action": "alloc", "addr": addr, "size": mb * MB, "frames": frames(*where)}


def free(addr, mb):
    return [{"action": "free_requested", "addr": addr, "size": mb * MB},
            {"action": "free_completed", "addr": addr, "size": mb * MB}]


TORCH = "/site-packages/torch/nn/functional.py:10"
SCHEDULE = "/repo/megatron/dpp/schedule.py:40"
GRAPHS = "/repo/megatron/trainer/model/cuda_graphs.py:77"


def snapshot(trace, live_blocks_mb):
    """A snapshot whose segments hold `live_blocks_mb` allocated when it was taken."""
    blocks = [{"size": mb * MB, "state": "active_allocated"} for mb in live_blocks_mb]
    blocks.append({"size": 64 * MB, "state": "inactive"})  # cached, not allocated
    return {"segments": [{"blocks": blocks}], "device_traces": [[], trace]}


def test_the_peak_and_what_was_live_then():
    # 5 MB allocated before the history began; then +8 (a torch op called from the
    # schedule), +4 (graphs), the 8 freed, +2: the peak is 5 + 8 + 4 = 17 MB
    trace = [alloc(1, 8, TORCH, SCHEDULE), alloc(2, 4, GRAPHS), *free(1, 8), alloc(3, 2, GRAPHS)]
    peak = memory_peak.find_peak(snapshot(trace, [5, 4, 2]))
    assert peak.bytes == 17 * MB and peak.before_history == 5 * MB
    assert peak.event == 1 and peak.events == 5
    assert peak.sites == {"megatron/dpp/schedule.py:40 f": 8 * MB,
                          "megatron/trainer/model/cuda_graphs.py:77 f": 4 * MB}


def test_a_pending_free_is_still_allocated():
    trace = [alloc(1, 3, GRAPHS), {"action": "free_requested", "addr": 1, "size": 3 * MB}]
    state = snapshot(trace, [])
    state["segments"][0]["blocks"].append({"size": 3 * MB, "state": "active_pending_free"})
    peak = memory_peak.find_peak(state)
    assert peak.bytes == 3 * MB and peak.before_history == 0


def test_two_runs_differ_by_site(tmp_path, capsys):
    ours = snapshot([alloc(1, 8, SCHEDULE), alloc(2, 6, GRAPHS)], [8, 6])
    theirs = snapshot([alloc(1, 8, SCHEDULE), alloc(2, 4, GRAPHS)], [8, 4])
    for name, state in (("ours.pickle", ours), ("theirs.pickle", theirs)):
        (tmp_path / name).write_bytes(pickle.dumps(state))
    memory_peak.main([str(tmp_path / "ours.pickle"), "--against", str(tmp_path / "theirs.pickle")])
    out = capsys.readouterr().out
    assert "ours.pickle - theirs.pickle at their peaks: +2.0 MB" in out
    assert "+2.00 MB  megatron/trainer/model/cuda_graphs.py:77 f" in out
    assert "megatron/dpp/schedule.py" not in out.split("at their peaks")[1]  # equal: not listed


def test_a_snapshot_without_history_is_named(tmp_path):
    path = tmp_path / "s.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [[]]}))
    with pytest.raises(SystemExit, match="has no history"):
        memory_peak.main([str(path)])
    path.write_bytes(pickle.dumps([1, 2]))
    with pytest.raises(SystemExit, match="not a CUDA memory snapshot"):
        memory_peak.main([str(path)])


class RecordingMemory:
    """Stands in for torch.cuda.memory: what was asked, and a snapshot numbered per call."""

    def __init__(self, fail_snapshot=False):
        self.recording = []
        self.snapshots = 0
        self.fail_snapshot = fail_snapshot

    def _record_memory_history(self, enabled="all", **options):
        self.recording.append(enabled)

    def _snapshot(self):
        if self.fail_snapshot:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        self.snapshots += 1
        return {"segments": [], "device_traces": [[]], "number": self.snapshots}


def written(path):
    return pickle.loads(path.read_bytes())["number"]


def test_snapshots_per_rank_at_first_step_interval_and_end(tmp_path):
    memory = RecordingMemory()
    path = snapshot_path(str(tmp_path / "snap" / "snapshot.pickle"), 3)
    assert path == tmp_path / "snap" / "snapshot-rank3.pickle"
    with MemoryHistory(True, str(tmp_path / "snap" / "snapshot.pickle"), 3, log_interval=4,
                       memory=memory) as history:
        assert memory.recording == ["all"]
        history.after_step(11)  # a resumed run: its first step writes
        assert written(path) == 1
        history.after_step(12)
        assert written(path) == 2
        for iteration in range(13, 16):
            history.after_step(iteration)
        assert memory.snapshots == 2  # nothing at 13-15
        history.after_step(16)
        assert written(path) == 3
    assert written(path) == 4 and memory.recording == ["all", None]
    assert [p.name for p in path.parent.iterdir()] == ["snapshot-rank3.pickle"]  # no partials


def test_off_or_another_rank_records_nothing(tmp_path):
    memory = RecordingMemory()
    with MemoryHistory(False, str(tmp_path / "s.pickle"), 0, 1, memory=memory) as history:
        history.after_step(1)
    assert memory.recording == [] and not any(tmp_path.iterdir())


def test_an_error_that_ends_the_run_is_not_hidden_by_the_snapshot(tmp_path, caplog):
    memory = RecordingMemory(fail_snapshot=True)
    with caplog.at_level(logging.WARNING), pytest.raises(torch.OutOfMemoryError):
        with MemoryHistory(True, str(tmp_path / "s.pickle"), 0, 10, memory=memory):
            raise torch.OutOfMemoryError("CUDA out of memory")
    assert "no memory snapshot at the end of the run: CUDA error" in caplog.text
    assert memory.recording == ["all", None] and not any(tmp_path.iterdir())


def test_flags_and_the_refusal_without_cuda():
    base = [*TINY_GPT, "--global-batch-size", "4"]
    args = parse_args([*base, "--record-memory-history", "--memory-snapshot-path", "m/s.pkl",
                       "--profile-ranks", "0", "1"], world_size=2)
    assert args.record_memory_history and args.memory_snapshot_path == "m/s.pkl"
    with pytest.raises(ArgumentError, match="--memory-snapshot-path needs --record-memory-history"):
        parse_args([*base, "--memory-snapshot-path", "m/s.pkl"], world_size=1)
    assert memory_history_refusal(True, cuda_available=True) is None
    assert memory_history_refusal(False, cuda_available=False) is None
    assert "no CUDA device" in memory_history_refusal(True, cuda_available=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_the_trainer_refuses_before_the_job_starts():
    from megatron.trainer.run.training import setup
    from megatron.trainer.tasks.gpt import GPT_TASK

    args = parse_args([*TINY_GPT, "--global-batch-size", "4", "--record-memory-history"],
                      world_size=1)
    with pytest.raises(ArgumentError, match="--record-memory-history records the CUDA"):
        setup(GPT_TASK, args, None)


def test_the_bench_reports_each_rank_and_the_pairs_it_compares(tmp_path):
    """bench_gpt.py --memory-snapshots: every rank's snapshot per configuration, and for a
    pair of its RATIOS the difference per call site, rank by rank."""
    from types import SimpleNamespace

    from profiling import bench_gpt

    a, b = "cv-dpp-tokens-graphs", "cv-1f1b-cost-tokens-graphs"
    assert (a, b) in bench_gpt.RATIOS
    options = SimpleNamespace(warmup=0, iters=2, trace=False, profile=False, memory_snapshots=True,
                              gpus=2)
    flags = bench_gpt.observer_flags(a, options, tmp_path)
    assert flags[flags.index("--memory-snapshot-path") + 1] == str(
        tmp_path / "snapshots" / a / "snapshot.pickle")
    assert flags[flags.index("--profile-ranks") + 1:] == ["0", "1"]
    held = {a: ([8, 6], [4, 3]), b: ([8, 4], [4, 3])}  # rank 0 holds 2 MB more under a
    for name, ranks in held.items():
        folder = bench_gpt.snapshot_folder(tmp_path, name)
        folder.mkdir(parents=True)
        for rank, (first, second) in enumerate(ranks):
            state = snapshot([alloc(1, first, SCHEDULE), alloc(2, second, GRAPHS)], [first, second])
            (folder / f"snapshot-rank{rank}.pickle").write_bytes(pickle.dumps(state))
    lines = bench_gpt.memory_lines([a, b, "fixed-1024-graphs"], tmp_path, ranks=2)
    assert f"{a} rank 0 - {b} at their peaks: +2.0 MB (+0.0 MB from before the histories)" in lines
    assert f"{a} rank 1 - {b} at their peaks: +0.0 MB (+0.0 MB from before the histories)" in lines
    assert "+2.00 MB  megatron/trainer/model/cuda_graphs.py:77 f" in [line.strip() for line in lines]
    assert any(line.startswith(f"{b} rank 1: peak 7.0 MB") for line in lines)
    assert not any("fixed-1024" in line for line in lines)  # no snapshots: not reported


def test_an_unwritable_snapshot_path_is_one_named_error(tmp_path):
    from megatron.trainer.run.failures import known_failure
    from megatron.trainer.run.memory_history import MemorySnapshotError

    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    history = MemoryHistory(True, str(blocker / "s.pickle"), 0, 1, memory=RecordingMemory())
    with pytest.raises(MemorySnapshotError, match="--memory-snapshot-path: cannot write .*file/"
                                                  "s-rank0.pickle") as error:
        history.write()
    message, status = known_failure(error.value)
    assert "cannot write" in message and status == 1
