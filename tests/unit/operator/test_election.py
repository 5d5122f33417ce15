"""The election's guards in one process: a leader past its renew deadline sends no write (reads still go out), and a
standby answers the liveness probe until kopf takes its port."""

from __future__ import annotations

import http.server
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from kubernetes import client as k8s

from disttrain.operator import election
from disttrain.operator.leaderlease import ElectionOptions, ElectionTiming

pytestmark = pytest.mark.timeout(30)
TIMING = ElectionTiming(lease_s=90.0, renew_deadline_s=60.0, retry_s=0.5)
"""Long: the kubernetes client's first calls import its classes, seconds on a busy machine."""


class Recorder(http.server.ThreadingHTTPServer):
    """An API server stand-in that answers every request with ``{}`` and records its method and path."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []
        recorder = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self) -> None:
                recorder.seen.append((self.command, self.path))
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(length)
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            do_GET = do_POST = do_PATCH = do_DELETE = _answer

            def log_message(self, format: str, *args: object) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)


@pytest.fixture
def server() -> Iterator[Recorder]:
    recorder = Recorder()
    threading.Thread(target=recorder.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield recorder
    recorder.shutdown()
    recorder.server_close()


def _fenced(server: Recorder, lost: list[str]) -> tuple[k8s.CoreV1Api, election.Elector]:
    configuration = k8s.Configuration()
    configuration.host = f"http://127.0.0.1:{server.server_address[1]}"
    options = ElectionOptions(namespace="ops", name="leader", identity="op-a", timing=TIMING)
    elector = election.Elector(k8s.ApiClient(configuration), options, on_lost=lambda: lost.append("lost"))
    return k8s.CoreV1Api(election.FencedApiClient(configuration, elector)), elector


EVENT = {"metadata": {"name": "e"}, "involvedObject": {}, "reason": "R", "message": "m"}


def test_a_leader_within_its_renew_deadline_writes(server):
    lost: list[str] = []
    api, elector = _fenced(server, lost)
    elector.renewed_at = time.monotonic()
    api.create_namespaced_event("ns", EVENT, _preload_content=False)
    assert server.seen == [("POST", "/api/v1/namespaces/ns/events")] and not lost


def test_a_leader_past_its_renew_deadline_sends_no_write_and_stops(server):
    lost: list[str] = []
    api, elector = _fenced(server, lost)
    elector.renewed_at = time.monotonic() - TIMING.renew_deadline_s
    with pytest.raises(election.NotLeader):
        api.create_namespaced_event("ns", EVENT, _preload_content=False)
    with pytest.raises(election.NotLeader):
        api.delete_namespaced_pod("p", "ns", _preload_content=False)
    api.read_namespaced_pod("p", "ns", _preload_content=False)  # reads change nothing: they still go out
    assert server.seen == [("GET", "/api/v1/namespaces/ns/pods/p")]
    assert lost == ["lost"], "the process is stopped once, at the first refused write"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_a_standby_answers_the_liveness_probe_and_frees_its_port_for_kopf():
    port = _free_port()
    standby = election.StandbyHealth(f"http://127.0.0.1:{port}/healthz")
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as answer:
        assert answer.status == 200
    with pytest.raises(urllib.error.HTTPError) as other:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)
    assert other.value.code == 404
    other.value.close()
    standby.close()
    with socket.socket() as kopf:  # kopf's own liveness server binds the same address next
        kopf.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        kopf.bind(("127.0.0.1", port))
