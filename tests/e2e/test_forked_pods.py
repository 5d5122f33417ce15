"""Local pods forked from the fork server are the programs a cold start runs, and the runtime still finds, signals
and reaps every process of them (real server, real forks, real kills)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from disttrain.api import env as env_names
from disttrain.operator.local import forkserver, proctree
from disttrain.operator.local.forkserver import ForkedPod, ForkServers

pytestmark = pytest.mark.timeout(180)

ON = {env_names.LOCAL_FORK: "1"}

POD = """
import json, os, subprocess, sys, time
print(json.dumps({
    "argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "value": os.environ.get("DISTTRAIN_POD_VALUE"),
    "stdin": sys.stdin.read(), "own_session": os.getsid(0) == os.getpid(), "main": __name__,
}), flush=True)
if os.fork() == 0:  # a forked and an exec'd descendant in sessions of their own, as torchrun's workers are
    os.setsid()
    time.sleep(120)
    os._exit(0)
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
time.sleep(float(sys.argv[1]))
sys.exit(7)
"""


def _marker(n: int) -> str:
    return f"job-{os.getpid()}/pod-{n}"


def _wait_tree(marker: str, count: int) -> set[int]:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        tree = proctree.find_tree(marker)
        if len(tree) >= count:
            return tree
        time.sleep(0.05)
    return proctree.find_tree(marker)


@pytest.fixture
def pod_script(tmp_path: Path) -> Path:
    """The pods' program, written once before any pod starts: rewriting it (truncate, then write) while a pod
    started earlier reads it would run that pod as an empty script, which exits 0."""
    script = tmp_path / "pod.py"
    script.write_text(POD)
    return script


def _start(servers: ForkServers, script: Path, n: int, hold_s: float, value: str, **extra: str):
    folder = script.parent
    out = (folder / f"pod-{n}.log").open("ab")
    environ = {**os.environ, "DISTTRAIN_POD_VALUE": value, "DISTTRAIN_NODE_INDEX": str(n), **extra}
    environ = proctree.marked(environ, _marker(n))
    argv = [sys.executable, str(script), str(hold_s)]
    forked = servers.start(argv, environ, str(folder), out)
    return forked or proctree.spawn(argv, environ, str(folder), out, _marker(n)), out


def test_a_forked_pod_runs_as_a_cold_one_and_every_process_of_it_carries_its_marker(tmp_path: Path, pod_script: Path):
    servers = ForkServers(tmp_path, ON)
    outs = []
    try:
        cold, cold_out = _start(ForkServers(tmp_path, {env_names.LOCAL_FORK: "0"}), pod_script, 0, 0.0, "v0")
        forked, forked_out = _start(servers, pod_script, 1, 0.0, "v1")
        again, again_out = _start(servers, pod_script, 2, 0.0, "v2")
        outs = [cold_out, forked_out, again_out]
        assert not isinstance(cold, ForkedPod)
        assert isinstance(forked, ForkedPod) and isinstance(again, ForkedPod), "the fork server refused (see its log)"
        assert len(list(tmp_path.glob("fork-server-*.log"))) == 1, "pods that differ in DISTTRAIN_* share a server"
        for proc in (cold, forked, again):
            assert proc.wait(timeout=60) == 7
        records = [json.loads((tmp_path / f"pod-{n}.log").read_text().splitlines()[0]) for n in range(3)]
        assert [r.pop("value") for r in records] == ["v0", "v1", "v2"]
        assert records[1] == records[0] == records[2]
        assert records[0]["main"] == "__main__" and records[0]["stdin"] == "" and records[0]["own_session"]
        for n in (1, 2):  # the pod exited; its descendants are orphans, found by the marker alone
            tree = _wait_tree(_marker(n), 2)
            assert len(tree) == 2
            proctree.kill_tree(_marker(n))
            assert not proctree.find_tree(_marker(n))
        proctree.kill_tree(_marker(0))
    finally:
        for out in outs:  # closed on a failure too: a leaked file fails the next test's setup (ResourceWarning)
            out.close()
        servers.close()


def test_a_killed_forked_pod_reports_its_signal_and_a_closed_server_takes_its_pods_with_it(
    tmp_path: Path, pod_script: Path
):
    servers = ForkServers(tmp_path, ON)
    try:
        killed, out1 = _start(servers, pod_script, 1, 120.0, "a")
        left, out2 = _start(servers, pod_script, 2, 120.0, "b")
        assert isinstance(killed, ForkedPod) and isinstance(left, ForkedPod)
        assert killed.poll() is None
        killed.send_signal(signal.SIGKILL)
        assert killed.wait(timeout=30) == -signal.SIGKILL
        proctree.kill_tree(_marker(1))
        servers.close()  # what the runtime does last: a pod still running dies with its server
        assert left.wait(timeout=10) == -signal.SIGKILL
        deadline = time.monotonic() + 10
        while left.pid in proctree.find_tree(_marker(2)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert left.pid not in proctree.find_tree(_marker(2))
        proctree.kill_tree(_marker(2))
        out1.close()
        out2.close()
    finally:
        servers.close()


def test_servers_beyond_the_cap_replace_idle_ones_and_never_end_a_running_pod(
    tmp_path: Path, pod_script: Path, monkeypatch
):
    monkeypatch.setattr(forkserver, "MAX_SERVERS", 1)
    servers = ForkServers(tmp_path, ON)
    try:
        running, out1 = _start(servers, pod_script, 1, 120.0, "a")
        assert isinstance(running, ForkedPod)
        other, out2 = _start(servers, pod_script, 2, 0.0, "b", OTHER_KIND="1")  # another server's pod: no room
        assert not isinstance(other, ForkedPod) and other.wait(timeout=60) == 7
        assert running.poll() is None, "the busy server was ended"
        running.kill()
        assert running.wait(timeout=30) == -signal.SIGKILL
        third, out3 = _start(servers, pod_script, 3, 0.0, "c", OTHER_KIND="1")  # the idle server makes room
        assert isinstance(third, ForkedPod) and third.wait(timeout=60) == 7
        for n in (1, 2, 3):
            proctree.kill_tree(_marker(n))
        for out in (out1, out2, out3):
            out.close()
    finally:
        servers.close()
