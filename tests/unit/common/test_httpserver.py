"""The metrics exporter of the operator, of the local runtime and of every worker: slow or idle clients can neither
grow it nor keep a scraper out."""

from __future__ import annotations

import gzip
import os
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator

import prometheus_client
import pytest

from disttrain.common import httpserver

pytestmark = pytest.mark.timeout(60)

FAST = httpserver.Limits(max_connections=16, request_s=0.5, answer_s=0.5)


@pytest.fixture
def server(request: pytest.FixtureRequest) -> Iterator[httpserver.BoundedHttpServer]:
    limits = getattr(request, "param", FAST)
    registry = prometheus_client.CollectorRegistry()
    prometheus_client.Counter("bench_things", "things", registry=registry).inc()
    started = httpserver.serve_metrics(0, "127.0.0.1", registry, limits)
    yield started
    started.shutdown()
    started.server_close()


def _scrape(port: int, timeout: float = 5.0, encoding: str = "") -> bytes:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics")
    if encoding:
        request.add_header("Accept-Encoding", encoding)
    with urllib.request.urlopen(request, timeout=timeout) as answer:
        body = bytes(answer.read())
        return gzip.decompress(body) if answer.headers.get("Content-Encoding") == "gzip" else body


def _threads() -> int:
    """The process's OS threads (native ones included, which a Python thread count misses)."""
    return len(os.listdir("/proc/self/task"))


def test_a_scrape_is_answered_with_the_registrys_metrics(server):
    assert b"bench_things_total 1.0" in _scrape(server.server_port)
    assert b"bench_things_total 1.0" in _scrape(server.server_port, encoding="gzip")
    deadline = time.monotonic() + 5  # the client can have the whole answer before the server's loop counts it
    while server.served < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.served == 2


@pytest.mark.parametrize("server", [httpserver.Limits(max_connections=16, request_s=30.0)], indirect=True)
def test_idle_clients_cost_no_thread_hold_at_most_the_cap_and_never_keep_a_scraper_out(server):
    threads = _threads()
    idle = [socket.create_connection(("127.0.0.1", server.server_port)) for _ in range(300)]  # send nothing
    try:
        for _ in range(5):
            assert b"bench_things_total 1.0" in _scrape(server.server_port, timeout=2.0)
            assert server.open_connections <= 16
        assert _threads() <= threads, "a thread per connection"  # (a thread of an earlier test may have ended)
        assert server.evicted >= 300 - 16
    finally:
        for sock in idle:
            sock.close()


def test_a_request_sent_a_byte_at_a_time_is_cut_off_when_its_time_is_up(server):
    sock = socket.create_connection(("127.0.0.1", server.server_port))
    sock.settimeout(5)
    try:
        for byte in b"GET /metrics HTTP/1.1\r\nHost: x\r\n" * 10:  # each byte well within any per-read timeout
            sock.send(bytes([byte]))
            time.sleep(0.05)
        pytest.fail("the server took a request trickled for longer than its request_s")
    except OSError:
        pass
    assert server.dropped == 1 and server.served == 0
    sock.close()


def test_a_request_without_end_or_too_long_is_dropped(server):
    half = socket.create_connection(("127.0.0.1", server.server_port))
    half.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # the headers never end
    half.settimeout(5)
    assert half.recv(4096) == b"", "closed at its deadline"
    long = socket.create_connection(("127.0.0.1", server.server_port))
    long.sendall(b"GET /" + b"a" * 10_000)
    long.settimeout(5)
    try:
        assert long.recv(4096) == b""
    except ConnectionResetError:
        pass
    assert server.dropped == 2
    half.close()
    long.close()


def test_clients_that_never_read_their_answer_do_not_hold_the_server(server):
    threads = _threads()
    deaf = []
    for _ in range(100):
        sock = socket.create_connection(("127.0.0.1", server.server_port))
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        deaf.append(sock)
    try:
        assert b"bench_things_total 1.0" in _scrape(server.server_port, timeout=2.0)
        assert _threads() <= threads  # no thread per client (a thread of an earlier test may have ended meanwhile)
        assert server.open_connections <= 16
    finally:
        for sock in deaf:
            sock.close()


def test_a_bad_request_line_gets_400_and_shutdown_ends_the_thread():
    registry = prometheus_client.CollectorRegistry()
    started = httpserver.serve_metrics(0, "127.0.0.1", registry, FAST)
    with socket.create_connection(("127.0.0.1", started.server_port)) as sock:
        sock.sendall(b"junk\r\n\r\n")
        sock.settimeout(5)
        assert sock.recv(4096).startswith(b"HTTP/1.0 400")
    started.shutdown()
    started.server_close()
    assert not [t for t in threading.enumerate() if t.name == "metrics-server" and t.is_alive()]
