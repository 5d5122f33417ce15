"""The metrics exporter of the operator and of every worker: slow or idle clients cannot grow it."""

from __future__ import annotations

import socket
import threading
import time
import urllib.request

import prometheus_client
import pytest

from disttrain.api import metricsserver

pytestmark = pytest.mark.timeout(60)


def _serve(monkeypatch: pytest.MonkeyPatch, timeout_s: float) -> metricsserver.BoundedMetricsServer:
    monkeypatch.setattr(metricsserver._QuietHandler, "timeout", timeout_s)
    registry = prometheus_client.CollectorRegistry()
    prometheus_client.Counter("bench_things", "things", registry=registry).inc()
    return metricsserver.serve(0, "127.0.0.1", registry)


def _scrape(port: int) -> bytes:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
        return bytes(answer.read())


def test_idle_clients_hold_at_most_the_cap_and_the_rest_are_refused(monkeypatch):
    server = _serve(monkeypatch, timeout_s=30.0)
    port = server.server_address[1]
    try:
        threads_before = threading.active_count()
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(50)]  # connect, send nothing
        deadline = time.monotonic() + 10
        while server.refused < 50 - metricsserver.MAX_CONNECTIONS and time.monotonic() < deadline:
            assert threading.active_count() - threads_before <= metricsserver.MAX_CONNECTIONS
            time.sleep(0.05)
        assert server.refused == 50 - metricsserver.MAX_CONNECTIONS
        assert threading.active_count() - threads_before <= metricsserver.MAX_CONNECTIONS
        for sock in idle:
            sock.close()
        deadline = time.monotonic() + 10
        while True:  # the slots come back as the idle clients go
            try:
                assert b"bench_things_total 1.0" in _scrape(port)
                break
            except OSError:
                assert time.monotonic() < deadline, "no scrape got through after the idle clients left"
                time.sleep(0.1)
    finally:
        server.shutdown()
        server.server_close()


def test_a_client_that_sends_half_a_request_is_dropped(monkeypatch):
    server = _serve(monkeypatch, timeout_s=0.5)
    try:
        sock = socket.create_connection(server.server_address[:2])
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # the headers never end
        sock.settimeout(5)
        assert sock.recv(4096) == b"", "the server closed it"
        sock.close()
    finally:
        server.shutdown()
        server.server_close()
