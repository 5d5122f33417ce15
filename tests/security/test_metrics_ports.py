"""Slow HTTP clients on a running local job's metrics ports (every worker's, and the local runtime's, which stands
for the operator's) neither grow the processes that serve them nor keep a scraper out.

``tests/security/slowloris.py`` holds 300 connections to each port while the job trains: half send a request a byte
at a time (within any per-read timeout), half send a whole request and never read the answer; every connection the
server closes is opened again. Meanwhile a scraper asks each port every half second with a 5 s timeout. Asserted:
every scrape was answered; a worker's threads and sockets stay within the exporter's bounds and its memory grows by
at most 64 MiB; the job Succeeds with every step once, no restart charged and no reform.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Any, Optional

import pytest

from disttrain.common import httpserver
from disttrain.operator.local import proctree
from disttrain.operator.local.runtime import LocalRuntime, Snapshot
from tests.conftest import REPO_ROOT
from tests.e2e.conftest import e2e_job, run_job
from tests.security import agentmemory, procnet

pytestmark = [pytest.mark.security, pytest.mark.slow]

SLOWLORIS = REPO_ROOT / "tests" / "security" / "slowloris.py"
MIB = 2**20
STEPS = 48
START_AT_STEP = 3
ATTACK_S = 8.0
CONNECTIONS = 300
SCRAPE_EVERY_S = 0.5
SCRAPE_TIMEOUT_S = 5.0
THREAD_SLACK = 4
"""Threads a worker may start during the attack for its own work (the exporter adds none)."""
SOCKET_SLACK = 8
"""Sockets a worker may open during the attack for its own work, beside the exporter's connections."""


@dataclasses.dataclass
class Target:
    name: str
    port: int
    pid: int
    """The process that serves the port."""
    worker: bool
    threads_before: int = 0
    sockets_before: int = 0
    rss_before: int = 0
    threads_most: int = 0
    sockets_most: int = 0
    rss_most: int = 0
    scrapes: list[tuple[float, Optional[str]]] = dataclasses.field(default_factory=list)
    """(latency, error or None) of each scrape during the attack."""


def _sockets(pid: int) -> int:
    return len(procnet._socket_inodes(pid))


def _scrape(port: int) -> bytes:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=SCRAPE_TIMEOUT_S) as answer:
        return bytes(answer.read())


class Watch(threading.Thread):
    """Scrapes every target and samples the workers' threads, sockets and memory until stopped."""

    def __init__(self, targets: list[Target]) -> None:
        super().__init__(name="metrics-watch", daemon=True)
        self.targets = targets
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.is_set():
            for target in self.targets:
                start = time.monotonic()
                try:
                    body = _scrape(target.port)
                    error = None if b"disttrain_" in body else f"no disttrain metric in {body[:200]!r}"
                except OSError as exc:
                    error = repr(exc)
                target.scrapes.append((time.monotonic() - start, error))
                if target.worker:
                    target.threads_most = max(target.threads_most, procnet.thread_count(target.pid))
                    target.sockets_most = max(target.sockets_most, _sockets(target.pid))
                    rss, hwm = agentmemory.rss_of({target.pid})
                    target.rss_most = max(target.rss_most, rss, hwm)
            self.stop_event.wait(SCRAPE_EVERY_S)


def _targets(runtime: LocalRuntime) -> list[Target]:
    targets = []
    for pod in runtime.workers.values():
        pid = procnet.listener_of(pod.metrics_port, proctree.find_tree(pod.marker, pod.proc.pid))
        assert pid is not None, f"no process of {pod.name} listens on its metrics port {pod.metrics_port}"
        targets.append(Target(pod.name, pod.metrics_port, pid, worker=True))
    port = int(runtime.metrics_url.split(":")[2].split("/")[0])
    targets.append(Target("local runtime", port, 0, worker=False))
    for target in targets:
        if target.worker:
            agentmemory.reset_peaks({target.pid})
            target.threads_before = procnet.thread_count(target.pid)
            target.sockets_before = _sockets(target.pid)
            target.rss_before = agentmemory.rss_of({target.pid})[0]
    return targets


@pytest.mark.timeout(240)
def test_slow_clients_on_the_metrics_ports_neither_grow_a_worker_nor_keep_a_scraper_out(tmp_path):
    state: dict[str, Any] = {"targets": [], "watch": None, "attacker": None, "start": 0.0}
    report_path = tmp_path / "slowloris.json"

    def on_tick(runtime: LocalRuntime, snapshot: Snapshot) -> None:
        if state["start"] or int(snapshot.status.get("step") or 0) < START_AT_STEP or len(runtime.workers) < 2:
            return
        state["start"] = time.time()
        state["targets"] = targets = _targets(runtime)
        argv = [sys.executable, str(SLOWLORIS), ",".join(f"127.0.0.1:{t.port}" for t in targets)]
        argv += ["--connections", str(CONNECTIONS), "--seconds", str(ATTACK_S), "--report", str(report_path)]
        state["attacker"] = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
        state["watch"] = Watch(targets)
        state["watch"].start()
        threading.Thread(target=_stop_watch_with_attacker, args=(state,), daemon=True).start()

    builder = e2e_job(
        "slowmetrics", tmp_path / "records", replicas=2, max_steps=STEPS, dataset=12 * STEPS, step_sleep=0.25
    )
    try:
        run = run_job(tmp_path, builder, on_tick=on_tick, timeout_s=200)
    finally:
        attacker: Optional[subprocess.Popen[bytes]] = state["attacker"]
        if attacker is not None:
            try:
                attacker.wait(timeout=ATTACK_S + 30)
            except subprocess.TimeoutExpired:
                attacker.kill()
                attacker.wait()
        if state["watch"] is not None:
            state["watch"].stop_event.set()
            state["watch"].join(timeout=30)
    assert state["start"], f"the job never reached step {START_AT_STEP}: {run.reasons()}"
    report = json.loads(report_path.read_text())
    attack_end = state["start"] + report["seconds"]

    targets: list[Target] = state["targets"]
    for target in targets:
        sent = report["targets"][f"127.0.0.1:{target.port}"]
        assert sent["opened"] >= CONNECTIONS and sent.get("closed by the server", 0) > 0, (target.name, sent)
        failed = [error for _latency, error in target.scrapes if error]
        assert not failed, f"{target.name}: {len(failed)} of {len(target.scrapes)} scrapes failed: {failed[:3]}"
        assert len(target.scrapes) >= 5, f"{target.name}: only {len(target.scrapes)} scrapes during the attack"
        if target.worker:
            threads, sockets = target.threads_most - target.threads_before, target.sockets_most - target.sockets_before
            assert threads <= THREAD_SLACK, f"{target.name}: {threads} threads more under the attack"
            bound = httpserver.LIMITS.max_connections + SOCKET_SLACK
            assert sockets <= bound, f"{target.name}: {sockets} sockets more under the attack (bound {bound})"
            growth = target.rss_most - target.rss_before
            assert growth <= 64 * MIB, f"{target.name} grew by {growth / MIB:.0f} MiB under the attack"

    summary, status = run.summary, run.runtime.obj["status"]
    assert summary.succeeded, f"phase {summary.phase}: {summary.message}; events {run.reasons()}"
    assert (status.get("restarts") or {}).get("total", 0) == 0, status.get("restarts")
    reasons = run.reasons()
    assert reasons.count("RendezvousComplete") == 1 and "Reforming" not in reasons, f"a reform: {reasons}"
    trajectory = run.final_trajectory()
    assert sorted(trajectory) == list(range(1, STEPS + 1)), f"steps skipped or extra: {sorted(trajectory)}"
    assert max(r["time"] for records in trajectory.values() for r in records) > attack_end, "train longer"
    state["lines"] = [
        f"{t.name}: {len(t.scrapes)} scrapes, slowest {max(lat for lat, _ in t.scrapes):.2f} s"
        + (
            f", threads +{t.threads_most - t.threads_before}, sockets +{t.sockets_most - t.sockets_before}"
            if t.worker
            else ""
        )
        for t in targets
    ]
    print("\n".join(state["lines"]))


def _stop_watch_with_attacker(state: dict[str, Any]) -> None:
    """The scraper watches as long as the attack lasts."""
    state["attacker"].wait()
    state["watch"].stop_event.set()
