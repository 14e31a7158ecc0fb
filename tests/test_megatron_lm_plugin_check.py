"""profiling/megatron_lm_plugin_check.py's `make` stand-in: Megatron-LM's initialize runs make
in megatron/core/datasets, which megatron-core's wheels ship built but without a Makefile;
the stand-in succeeds only there and leaves every other call to the real make."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from profiling import megatron_lm_plugin_check


def _make(shim_folder, folder) -> int:
    return subprocess.run([shim_folder / "make", "-C", str(folder)], capture_output=True,
                          check=False).returncode


def test_make_stand_in_passes_only_where_the_helpers_are_built(tmp_path):
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
