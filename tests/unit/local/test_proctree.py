"""Node loss kills the whole tree, including a grandchild that started its own session (as torchrun's workers do)."""

import os
import sys
import time

from disttrain.operator.local import proctree

# A parent that starts a child in a new session, prints the child's pid, then sleeps.
PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
print(child.pid, flush=True)
time.sleep(60)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_kill_tree_kills_descendants_in_other_sessions(tmp_path):
    with open(tmp_path / "log", "wb") as log:
        proc = proctree.spawn([sys.executable, "-c", PARENT], dict(os.environ), str(tmp_path), log, "test/node-1")
        deadline = time.monotonic() + 20
        while not (tmp_path / "log").read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.05)
        child = int((tmp_path / "log").read_text().split()[0])
        assert os.getsid(child) != os.getsid(proc.pid)  # the grandchild escaped the node's session
        assert {proc.pid, child} <= proctree.find_tree("test/node-1", proc.pid)
        proctree.kill_tree("test/node-1", proc.pid)
        proc.wait(timeout=5)
        deadline = time.monotonic() + 5
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not _alive(child)
        assert proctree.find_tree("test/node-1") == set()


def test_markers_of_other_nodes_are_left_alone(tmp_path):
    with open(tmp_path / "a", "wb") as a, open(tmp_path / "b", "wb") as b:
        sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
        first = proctree.spawn(sleeper, dict(os.environ), str(tmp_path), a, "test/node-1")
        second = proctree.spawn(sleeper, dict(os.environ), str(tmp_path), b, "test/node-10")
        try:
            proctree.kill_tree("test/node-1", first.pid)
            first.wait(timeout=5)
            assert second.poll() is None
        finally:
            proctree.kill_tree("test/node-10", second.pid)
            second.wait(timeout=5)
