"""The suite's own guard: a test that hangs is stopped by the configured time limit."""

import subprocess
import sys
import time
import tomllib

from tests import REPO


def test_the_suite_configures_a_time_limit():
    options = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]
    assert int(options["ini_options"]["timeout"]) > 0


def test_a_hanging_test_is_stopped(tmp_path):
    """The project's pytest configuration with its limit lowered to 2 s: a test that would
    sleep for a minute fails within seconds, naming the timeout."""
    (tmp_path / "test_hangs.py").write_text(
        "import time\n\n\ndef test_hangs():\n    time.sleep(60)\n")
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-c", str(REPO / "pyproject.toml"),
         "--rootdir", str(tmp_path), "-o", "timeout=2", str(tmp_path / "test_hangs.py")],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Timeout" in result.stdout
    assert "1 failed" in result.stdout
    assert time.monotonic() - started < 50
