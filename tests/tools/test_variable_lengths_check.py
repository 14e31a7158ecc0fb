"""tools/variable_lengths_check.sh: each part hands the bench its configurations and flags,
and what the bench wrote comes back to OUT as a few flat files (the device tool brings back
eight)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile

from tests import REPO as ROOT

SCRIPT = ROOT / "tools" / "variable_lengths_check.sh"

# stands in for the interpreter: records the bench's arguments, writes what the bench writes
BENCH_STAND_IN = """#!{python}
import json, pathlib, sys
if sys.argv[1].endswith("sim_compare.py"):
    print("compared", pathlib.Path(sys.argv[2]).name)
    sys.exit(0)
out = pathlib.Path(sys.argv[sys.argv.index("--out") + 1])
if "--trace" in sys.argv:
    (out / "trace-cv-dpp-tokens-graphs").mkdir()
    (out / "trace-cv-dpp-tokens-graphs" / "trace-rank0.jsonl").write_text("{{}}\\n")
(out / "table.txt").write_text("config table\\n")
(out / "results.json").write_text(json.dumps(sys.argv[1:]))
if "--memory-snapshots" in sys.argv:
    (out / "memory.txt").write_text("peaks\\n")
(out / "cv-dpp-tokens-graphs.log").write_text("[t rank0] INFO x: DPP transport shm for edges\\n")
"""


def run_part(tmp_path, part, **env):
    python = tmp_path / "python"
    python.write_text(BENCH_STAND_IN.format(python=sys.executable))
    python.chmod(0o755)
    out = tmp_path / "out"
    result = subprocess.run(["bash", str(SCRIPT), str(out), part], capture_output=True,
                            text=True, timeout=60, env={**os.environ, "PYTHON": str(python), **env})
    return result, out


def test_the_cv_part_runs_the_four_rows_at_pp4(tmp_path):
    result, out = run_part(tmp_path, "cv")
    assert result.returncode == 0, result.stderr
    argv = json.loads((out / "cv-results.json").read_text())
    assert argv[argv.index("--configs") + 1] == ("cv-dpp-tokens-graphs,cv-1f1b-cost-tokens-graphs,"
                                                 "cv-1f1b-tokens-graphs,fixed-1024-graphs")
    assert argv[argv.index("--pp") + 1] == "4" and "--memory-snapshots" not in argv
    assert "--extra=--num-layers 22 --decoder-last-pipeline-num-layers 4" in argv
    assert sorted(p.name for p in out.iterdir()) == [
        "cv-bench.log", "cv-logs.tar.gz", "cv-results.json", "cv-table.txt"]
    with tarfile.open(out / "cv-logs.tar.gz") as logs:
        assert logs.getnames() == ["./cv-dpp-tokens-graphs.log"]
    assert "config table" in result.stdout and "DPP transport shm" in result.stdout


def test_the_memory_part_records_two_short_runs(tmp_path):
    result, out = run_part(tmp_path, "memory", GPUS="2")
    assert result.returncode == 0, result.stderr
    argv = json.loads((out / "memory-results.json").read_text())
    assert "--memory-snapshots" in argv and argv[argv.index("--iters") + 1] == "2"
    assert argv[argv.index("--gpus") + 1] == "2"
    assert (out / "memory-memory.txt").read_text() == "peaks\n"


def test_the_trace_part_compares_each_traced_run_with_its_replay_and_bound(tmp_path):
    result, out = run_part(tmp_path, "trace", GPUS="2")
    assert result.returncode == 0, result.stderr
    argv = json.loads((out / "trace-results.json").read_text())
    assert argv[argv.index("--configs") + 1] == ("cv-dpp-tokens-graphs,cv-1f1b-cost-tokens-graphs,"
                                                 "cv-dpp-tokens-deferred-graphs")
    assert "--trace" in argv and argv[argv.index("--pp") + 1] == "2"
    # two stages: 12 / 10 layers (the output layer and loss weigh about two)
    assert "--extra=--num-layers 22 --decoder-last-pipeline-num-layers 10" in argv
    assert (out / "trace-bound.txt").read_text() == (
        "== cv-dpp-tokens-graphs\ncompared trace-cv-dpp-tokens-graphs\n")
    with tarfile.open(out / "trace-traces.tar.gz") as traces:
        assert "trace-cv-dpp-tokens-graphs/trace-rank0.jsonl" in traces.getnames()
    assert "compared trace-cv-dpp-tokens-graphs" in result.stdout


def test_an_unknown_part_or_gpu_count_is_named(tmp_path):
    result, out = run_part(tmp_path, "cv", GPUS="5")
    assert result.returncode == 2 and "GPUS must divide 24 layers" in result.stderr
    assert not out.exists()
    result, _ = run_part(tmp_path, "fast")
    assert result.returncode == 2
    assert "PART must be cv, corpus, memory or trace, not fast" in result.stderr
