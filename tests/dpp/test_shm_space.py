"""A /dev/shm too small for the shm channels is one error naming the sizes, not SIGBUS at
the first write: checked up front against what statvfs reports free, and again when each
segment reserves its pages (posix_fallocate), here on a real 64 KiB tmpfs mounted over
/dev/shm in a private mount namespace (root only; the machine's /dev/shm is untouched)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from megatron.dpp.transport import native, shm
from megatron.dpp.transport.channel import Edge, MessageKind, TransportError
from tests.job import REPO

pytestmark = pytest.mark.skipif(
    not native.available(), reason="native transport extension megatron.dpp._native not built")

SLOTS, SLOT_BYTES = 8, 64 << 10


def test_too_little_free_space_is_found_before_any_segment(monkeypatch):
    monkeypatch.setattr(shm, "shm_free_bytes", lambda: 100_000)
    token = "space" + os.urandom(4).hex()
    backend = shm.ShmBackend(slots=SLOTS, slot_bytes=SLOT_BYTES, token=token)
    edges = [Edge(0, 1, MessageKind.ACTIVATION), Edge(1, 0, MessageKind.GRADIENT)]
    with pytest.raises(TransportError) as caught:
        backend.open(edges, 1, native.make_inbox())
    assert str(caught.value) == (
        f"shm channels of rank 1: 1 receiving segments need at least {SLOTS * SLOT_BYTES} "
        "bytes of /dev/shm, which has 100000 bytes free (give it more space, e.g. docker run "
        "--shm-size, or --dpp-transport torch)")
    assert not any(os.path.exists("/dev/shm" + shm.segment_name(token, edge)) for edge in edges)


# in a mount namespace of its own, with a 64 KiB /dev/shm: a segment of 512 KiB
ON_A_SMALL_SHM = f"""
from megatron.dpp.transport import native
try:
    native.module().ShmReceiver("/dpp-space-test", {SLOTS}, {SLOT_BYTES}, 0, 1, 5.0)
except RuntimeError as error:
    print(error)
"""


def test_a_segment_larger_than_a_real_small_shm_fails_by_name():
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs in a private mount namespace needs root")
    script = ("mount -t tmpfs -o size=64k tmpfs /dev/shm && "
              f"{sys.executable} -c '{ON_A_SMALL_SHM}'")
    result = subprocess.run(["unshare", "-m", "sh", "-c", script], cwd=REPO, timeout=120,
                            env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True,
                            text=True)
    if "mount" in result.stderr and result.returncode != 0 and not result.stdout:
        pytest.skip(f"cannot mount a tmpfs in a private namespace: {result.stderr.strip()}")
    assert result.returncode == 0, result.stderr[-3000:]
    message = result.stdout.strip()
    assert message.startswith("shared-memory segment /dpp-space-test needs "), message
    assert "bytes, but /dev/shm had 65536 bytes free: No space left on device" in message
