"""The election's guards in one process: a leader past its renew deadline sends no write (reads still go out), and a
standby answers the liveness probe until kopf takes its port."""

from __future__ import annotations

import http.server
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import TypeVar

import pytest
from kubernetes import client as k8s

from disttrain.operator import election
from disttrain.operator.leaderlease import ElectionOptions, ElectionTiming

pytestmark = pytest.mark.timeout(30)
ServerT = TypeVar("ServerT", bound=http.server.ThreadingHTTPServer)
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


def serving(server: ServerT) -> Iterator[ServerT]:
    """``server`` answering on a thread of its own until the test ends."""
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def server() -> Iterator[Recorder]:
    yield from serving(Recorder())


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


class LeaseServer(http.server.ThreadingHTTPServer):
    """One Lease as the API server keeps it: a replace at a stale ``resourceVersion`` is refused with 409."""

    def __init__(self) -> None:
        self.lease: dict | None = None
        self.version = 0
        self.lock = threading.Lock()
        store = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _send(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                with store.lock:
                    lease = store.lease
                self._send(200, lease) if lease else self._send(404, {"kind": "Status", "code": 404})

            def _write(self) -> None:
                creating = self.command == "POST"
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
                with store.lock:
                    current = store.lease
                    stale = (
                        (current is not None)
                        if creating
                        else (
                            current is None
                            or body["metadata"].get("resourceVersion") != current["metadata"]["resourceVersion"]
                        )
                    )
                    if stale:
                        return self._send(409, {"kind": "Status", "code": 409, "reason": "Conflict"})
                    store.lease = store.stamped(body)
                    self._send(201 if creating else 200, store.lease)

            do_POST = do_PUT = _write

            def log_message(self, format: str, *args: object) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)

    def stamped(self, body: dict) -> dict:
        self.version += 1
        return {**body, "metadata": {**body["metadata"], "resourceVersion": str(self.version)}}

    def holder(self) -> str:
        with self.lock:
            return str(((self.lease or {}).get("spec") or {}).get("holderIdentity") or "")

    def rewrite(self, **spec: object) -> None:
        """Another client's write: a new version, the spec changed as given."""
        with self.lock:
            assert self.lease is not None
            self.lease = self.stamped({**self.lease, "spec": {**self.lease["spec"], **spec}})


@pytest.fixture
def leases() -> Iterator[LeaseServer]:
    yield from serving(LeaseServer())


def _elector(leases: LeaseServer, identity: str = "op-a", retry_s: float = 0.5) -> election.Elector:
    configuration = k8s.Configuration()
    configuration.host = f"http://127.0.0.1:{leases.server_address[1]}"
    timing = ElectionTiming(lease_s=90.0, renew_deadline_s=60.0, retry_s=retry_s)
    options = ElectionOptions(namespace="ops", name="leader", identity=identity, timing=timing)
    return election.Elector(k8s.ApiClient(configuration), options, on_lost=lambda: None)


def test_a_graceful_stop_frees_the_lease_even_while_renewals_run(leases):
    """The renewal in flight when the stop comes must not turn the release into a refused write."""
    for _ in range(5):
        elector = _elector(leases, retry_s=0.01)  # renewals back to back: one is in flight at the release
        elector.acquire()
        assert leases.holder() == "op-a"
        elector.keep()
        time.sleep(0.05)
        elector.release()
        assert leases.holder() == "", "a stopped leader left the Lease held"


def test_a_release_after_someone_else_wrote_the_lease_still_frees_it_when_ours(leases):
    elector = _elector(leases)
    elector.acquire()
    leases.rewrite(renewTime="2026-01-01T00:00:00.000000Z")  # the version moved under us; still our Lease
    elector.release()
    assert leases.holder() == ""


def test_a_release_never_frees_a_lease_another_replica_took(leases):
    elector = _elector(leases)
    elector.acquire()
    leases.rewrite(holderIdentity="op-b")
    elector.release()
    assert leases.holder() == "op-b"
