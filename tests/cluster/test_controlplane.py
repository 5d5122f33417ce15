"""The fixture itself: it stops every process it started and leaves nothing behind."""

from __future__ import annotations

import os

import pytest

from tests.cluster.controlplane import start_or_skip


def test_stop_leaves_no_process_and_no_files():
    plane = start_or_skip()
    plane.start_controllers()
    pids = [process.pid for process in plane.processes.values()]
    assert len(pids) == 4 and plane.request("GET", "/readyz", raw=True) == b"ok"
    plane.stop()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not plane.dir.exists()
