"""profiling/megatron_lm_plugin_check.py's `make` stand-in: Megatron-LM's initialize runs make
in megatron/core/datasets, which megatron-core's wheels ship built but without a Makefile;
the stand-in succeeds only there and leaves every other call to the real make. A run past its
timeout, or whose check is stopped, is stopped with its ranks;
a taken port is one error before any run; tools/megatron_lm_plugin_check.sh hands its EXTRA
flags to the check as one value."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from profiling import megatron_lm_plugin_check


def _make(shim_folder, folder) -> int:
    return subprocess.run([shim_folder / "make", "-C", str(folder)], capture_output=True,
                          check=False).returncode


def test_make_stand_in_passes_only_where_the_dataset_helpers_are_built(tmp_path):
    shim = megatron_lm_plugin_check.make_shim(tmp_path / "bin")
    datasets = tmp_path / "datasets"
    datasets.mkdir()
    assert _make(shim, datasets) != 0  # nothing built, no Makefile: make's own failure
    (datasets / "helpers_cpp.cpython-312-x86_64-linux-gnu.so").write_bytes(b"")
    assert _make(shim, datasets) == 0


@pytest.mark.skipif(shutil.which("make") is None, reason="needs a real make to hand over to")
def test_make_stand_in_runs_the_real_make_where_a_makefile_is(tmp_path):
    shim = megatron_lm_plugin_check.make_shim(tmp_path / "bin")
    (tmp_path / "helpers_cpp.so").write_bytes(b"")
    (tmp_path / "Makefile").write_text("all:\n\ttouch built\n")
    assert _make(shim, tmp_path) == 0
    assert (tmp_path / "built").exists()
    (tmp_path / "Makefile").write_text("all:\n\tfalse\n")
    assert _make(shim, tmp_path) != 0


# a stand-in of torchrun: its rank in a session of its own, deaf to SIGTERM, its pid in argv[1]
STAND_IN = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', "
            "'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "time.sleep(60)'], start_new_session=True); "
            "open(sys.argv[1], 'w').write(str(p.pid)); time.sleep(60)")


def _wait_gone(pid: int) -> None:
    for _ in range(50):  # the orphan is reaped by init shortly after the kill
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    pytest.fail(f"the rank process {pid} outlived its run")


def test_timeout_ends_the_whole_run(tmp_path, monkeypatch):
    """torchrun's ranks (in sessions of their own) go with it, not left holding the GPUs."""
    child = tmp_path / "child.pid"
    command = [sys.executable, "-c", STAND_IN, str(child)]
    monkeypatch.setattr(megatron_lm_plugin_check, "STOP_GRACE_S", 1)
    started = time.monotonic()
    status = megatron_lm_plugin_check.launch(command, tmp_path, tmp_path / "run.log", timeout=3)
    assert status == "timeout"
    assert time.monotonic() - started < 15
    _wait_gone(int(child.read_text()))


def test_sigterm_to_the_check_ends_the_run_in_flight(tmp_path):
    """An outer time limit (`timeout 560 python ...`) stops the check mid-run: the run's ranks
    go too; left behind they held the port, and every run of the next invocation failed at once."""
    child = tmp_path / "child.pid"
    check = subprocess.Popen([sys.executable, "-c", (
        "import sys; from pathlib import Path; from profiling import megatron_lm_plugin_check "
        "as c; c.STOP_GRACE_S = 1\n"
        "with c.exit_on_sigterm():\n"
        f"    c.launch([sys.executable, '-c', {STAND_IN!r}, {str(child)!r}], "
        f"Path({str(tmp_path)!r}), Path({str(tmp_path / 'run.log')!r}), timeout=120)")],
        cwd=megatron_lm_plugin_check.ROOT)
    for _ in range(300):
        if child.exists() and child.read_text():
            break
        time.sleep(0.1)
    else:
        check.kill()
        pytest.fail("the stand-in run never started")
    check.send_signal(signal.SIGTERM)
    assert check.wait(timeout=30) == 128 + signal.SIGTERM
    _wait_gone(int(child.read_text()))


def test_a_taken_port_is_one_error_before_any_run():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("", 0))
        listener.listen()
        port = listener.getsockname()[1]
        with pytest.raises(SystemExit, match=f"--port {port} is taken"):
            megatron_lm_plugin_check.check_port_free(port)
    megatron_lm_plugin_check.check_port_free(port)  # free again once closed


def test_summary_takes_each_trainers_median_ratio_over_the_repeats():
    """Three repeats of the bf16 pairs, warm-up 1: Megatron-LM's DPP / 1F1B ratios 1.0, 1.5
    and 1.1 (median 1.1, its outlier left out), ours 1.1 each: 0 % apart; with the first
    repeat alone 9.09 % apart, above 2 %."""
    def result(ms):
        return {"status": 0, "losses": [], "ms": [9999.0, ms]}

    results = {}
    for repeat, mlm_ratio in enumerate((1.0, 1.5, 1.1)):
        results |= {
            megatron_lm_plugin_check.repeat_name("mlm-bf16-1f1b", repeat): result(1000 * mlm_ratio),
            megatron_lm_plugin_check.repeat_name("mlm-bf16-dpp", repeat): result(1000),
            megatron_lm_plugin_check.repeat_name("ours-bf16-1f1b", repeat): result(1100),
            megatron_lm_plugin_check.repeat_name("ours-bf16-dpp", repeat): result(1000),
        }
    lines = megatron_lm_plugin_check.summary_lines(results, warmup=1, repeats=3)
    assert any(line.startswith("megatron-lm:") and "ratio 1.1000 (median of 3: 1.0000, "
               "1.5000, 1.1000)" in line for line in lines), lines
    assert lines[-1] == ("DPP/1F1B ratio, Megatron-LM's trainer against ours: 0.00% apart "
                         "(within 2 %)")
    first = {name: r for name, r in results.items() if not name[-1].isdigit()}
    assert megatron_lm_plugin_check.summary_lines(first, warmup=1)[-1] == (
        "DPP/1F1B ratio, Megatron-LM's trainer against ours: 9.09% apart (ABOVE 2 %)")


def test_repeats_run_the_bf16_pairs_forward_then_reversed():
    """The fp32 runs once; each later pass over the bf16 runs reverses the previous one's
    order, so the run that went first (the slowest of a session on the GPUs) goes last."""
    names = ["mlm-fp32-1f1b", "mlm-bf16-1f1b", "mlm-bf16-dpp", "ours-bf16-1f1b", "ours-bf16-dpp"]
    order = megatron_lm_plugin_check.run_order
    assert order(names, 0) == names
    assert order(names, 1) == ["ours-bf16-dpp", "ours-bf16-1f1b", "mlm-bf16-dpp", "mlm-bf16-1f1b"]
    assert order(names, 2) == names[1:]


def _log(path, times_ms, total):
    """A Megatron-style run log with one line per iteration of the given times."""
    path.write_text("".join(
        f" iteration {i:8d}/{total:8d} | elapsed time per iteration (ms): {ms:.1f} | "
        f"lm loss: {10 - i / 10:.6E} |\n" for i, ms in enumerate(times_ms, start=1)))


def test_from_logs_summarizes_only_the_passes_both_trainers_completed(tmp_path, monkeypatch):
    """--from-logs over two passes whose last run (Megatron-LM's 1F1B, second pass) was cut
    short after 2 of 4 iterations: the ratios are the first pass's alone, for both trainers
    (Megatron-LM 1.25, ours 1.25: 0 % apart), not ours' median over both passes (1.125)."""
    speeds = {"mlm-bf16-1f1b": 1250, "mlm-bf16-dpp": 1000, "ours-bf16-1f1b": 1250,
              "ours-bf16-dpp": 1000, "ours-bf16-1f1b-2": 1000, "ours-bf16-dpp-2": 1000,
              "mlm-bf16-dpp-2": 1000}
    for name, ms in speeds.items():
        _log(tmp_path / f"{name}.log", [5000.0] + [float(ms)] * 3, total=4)
    _log(tmp_path / "mlm-bf16-1f1b-2.log", [5000.0, 900.0], total=4)
    monkeypatch.setattr(sys, "argv", [
        "megatron_lm_plugin_check.py", "--from-logs", "--out", str(tmp_path), "--bf16-iters",
        "4", "--warmup", "1", "--repeats", "2",
        "--runs", "mlm-bf16-1f1b,mlm-bf16-dpp,ours-bf16-1f1b,ours-bf16-dpp"])
    megatron_lm_plugin_check.main()
    summary = (tmp_path / "summary.txt").read_text().splitlines()
    assert "mlm-bf16-1f1b-2: exit cut short, losses [9.9, 9.8]" in summary
    assert any(line.startswith("ours:") and line.endswith("ratio 1.2500") for line in summary), summary
    assert summary[-1] == ("DPP/1F1B ratio, Megatron-LM's trainer against ours: 0.00% apart "
                           "(within 2 %)")
    assert not (tmp_path / "megatron_lm").exists()  # nothing was run or written for a run


def test_resume_runs_only_what_has_no_complete_log(tmp_path, monkeypatch):
    """--resume over two passes where the first pass's four logs are complete but for
    Megatron-LM's DPP, cut after 2 of 4 iterations: that run and the second pass's four run;
    the three complete ones are read from their logs."""
    first = ["mlm-bf16-1f1b", "mlm-bf16-dpp", "ours-bf16-1f1b", "ours-bf16-dpp"]
    for name in first:
        _log(tmp_path / f"{name}.log", [5000.0, 1000.0, 1000.0, 1000.0][
            :2 if name == "mlm-bf16-dpp" else 4], total=4)
    ran = []

    def fake_run(name, program, cwd, flags, args, out, env=None):
        ran.append(name)
        _log(out / f"{name}.log", [5000.0, 1000.0, 1000.0, 1000.0], total=4)
        return megatron_lm_plugin_check.read_run(out / f"{name}.log", 0)

    monkeypatch.setattr(megatron_lm_plugin_check, "run", fake_run)
    monkeypatch.setattr(megatron_lm_plugin_check, "trainer_programs", lambda folder, out: {
        "megatron-lm": ([], out, None), "ours": ([], out, None)})
    monkeypatch.setattr(sys, "argv", [
        "megatron_lm_plugin_check.py", "--resume", "--megatron-lm", str(tmp_path), "--out",
        str(tmp_path), "--bf16-iters", "4", "--warmup", "1", "--repeats", "2",
        "--runs", ",".join(first)])
    megatron_lm_plugin_check.main()
    assert ran == ["mlm-bf16-dpp", "ours-bf16-dpp-2", "ours-bf16-1f1b-2", "mlm-bf16-dpp-2",
                   "mlm-bf16-1f1b-2"]
    summary = (tmp_path / "summary.txt").read_text().splitlines()
    assert summary[-1] == ("DPP/1F1B ratio, Megatron-LM's trainer against ours: 0.00% apart "
                           "(within 2 %)")


def test_the_gaps_interval_follows_the_iterations_spread():
    """Runs of constant iterations leave the gap nothing to vary: its interval is the point
    (Megatron-LM 1.25 over ours 1.0: +25 %). With Megatron-LM's 1F1B iterations spread by
    +-10 % the interval widens around the same median and the summary prints it."""
    def result(times):
        return {"status": 0, "losses": [], "ms": [9999.0, *times]}

    steady = {"mlm-bf16-1f1b": result([1250.0] * 9), "mlm-bf16-dpp": result([1000.0] * 9),
              "ours-bf16-1f1b": result([1000.0] * 9), "ours-bf16-dpp": result([1000.0] * 9)}
    low, high = megatron_lm_plugin_check.gap_interval(steady, [0], warmup=1)
    assert (low, high) == pytest.approx((0.25, 0.25))
    noisy = dict(steady, **{"mlm-bf16-1f1b": result(
        [1125.0, 1375.0, 1250.0, 1150.0, 1350.0, 1250.0, 1200.0, 1300.0, 1250.0])})
    low, high = megatron_lm_plugin_check.gap_interval(noisy, [0], warmup=1)
    assert low < 0.24 and high > 0.26 and low < 0.25 < high
    lines = megatron_lm_plugin_check.summary_lines(noisy, warmup=1)
    assert lines[-2].startswith(f"Megatron-LM's ratio over ours - 1: {low:+.2%} to {high:+.2%}")


def test_the_shell_script_hands_extra_flags_over_as_one_value(tmp_path):
    """EXTRA="--manual-gc" (one flag) once reached the check as `--extra --manual-gc`, which
    argparse took for a missing value: the call ended before any run."""
    recorder = tmp_path / "python"
    argv_file = tmp_path / "argv.json"
    recorder.write_text(f"#!{sys.executable}\nimport json, sys\n"
                        f"open({str(argv_file)!r}, 'w').write(json.dumps(sys.argv[1:]))\n")
    recorder.chmod(0o755)
    script = Path(megatron_lm_plugin_check.ROOT) / "tools" / "megatron_lm_plugin_check.sh"
    env = {**os.environ, "PYTHON": str(recorder), "INSTALL": "0", "EXTRA": "--manual-gc"}
    subprocess.run(["bash", str(script), str(tmp_path / "out")], env=env, check=True,
                   capture_output=True, timeout=60)
    argv = json.loads(argv_file.read_text())
    args = megatron_lm_plugin_check.build_parser().parse_args(argv[1:])
    assert args.extra == "--manual-gc"
    assert args.pp == 2 and args.out == tmp_path / "out"
