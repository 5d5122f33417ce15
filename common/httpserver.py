"""An HTTP server for a WSGI app that a stranger can neither grow nor lock: one thread for all its connections, at
most :attr:`Limits.max_connections` of them, each request and each answer bounded in time as a whole. It serves the
Prometheus exporters (:func:`serve_metrics`) and the operator standby's liveness answer.

Why: ``prometheus_client.start_http_server`` serves every connection on a thread of its own without a timeout, so
slow clients on a metrics port (the operator's, every worker's) pile up threads without bound. A cap alone is not
enough: a client that sends its request a byte at a time keeps any per-read timeout happy, and a few of them would
hold every slot and lock out the scraper. Here one thread multiplexes every connection (``selectors``), so a
connection costs a socket and at most :attr:`Limits.max_request_bytes` of buffer, never a thread; the request must
be complete within :attr:`Limits.request_s` of the connection and the answer taken within :attr:`Limits.answer_s`;
and a connection beyond the cap evicts the one open longest. A scraper sends its request as it connects and is
answered in the same pass of the loop, so it gets through however many slow clients come and go. The answer is
prometheus-client's own WSGI app (content negotiation, compression), called on the server's thread: a scrape takes
milliseconds. prometheus-client is imported when a server starts (the package imports it nowhere else).
"""

from __future__ import annotations

import dataclasses
import io
import logging
import selectors
import socket
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable
from typing import Any, Optional

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Limits:
    max_connections: int = 64
    """Connections open at once; a new one past it closes the one open longest."""
    request_s: float = 5.0
    """From the connection to the end of its request's headers (a scraper sends them at once)."""
    answer_s: float = 5.0
    """From the end of the request until the client took the whole answer."""
    max_request_bytes: int = 8192
    """A request line and headers longer than this are refused (a scrape's are a few hundred bytes)."""
    accepts_per_pass: int = 16
    """Connections accepted per pass of the loop before the open ones are read again."""


LIMITS = Limits()
POLL_S = 0.1
"""How often the loop looks at deadlines and at :meth:`BoundedHttpServer.shutdown` when nothing happens."""

WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


@dataclasses.dataclass
class _Connection:
    sock: socket.socket
    deadline: float
    request: bytearray = dataclasses.field(default_factory=bytearray)
    answer: Optional[memoryview] = None
    """The bytes still to send, once the request is complete."""


class BoundedHttpServer:
    """Serves a WSGI app on ``address`` from one thread (:meth:`serve_forever`) within :class:`Limits`."""

    def __init__(self, address: tuple[str, int], app: WsgiApp, limits: Limits = LIMITS) -> None:
        family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.socket = socket.socket(family, socket.SOCK_STREAM)
        try:
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.socket.bind(address)
            self.socket.listen(128)
            self.socket.setblocking(False)
        except OSError:
            self.socket.close()
            raise
        self.server_address: tuple[str, int] = self.socket.getsockname()[:2]
        self.server_port = self.server_address[1]
        self.app = app
        self.limits = limits
        self.served = 0
        """Answers sent whole."""
        self.evicted = 0
        """Connections closed to make room for a newer one (the cap was reached)."""
        self.dropped = 0
        """Connections closed at a deadline, for a request too long, or reset by the client."""
        self._connections: dict[int, _Connection] = {}
        """fd -> connection, oldest first."""
        self._selector = selectors.DefaultSelector()
        self._stop = threading.Event()
        self._stopped = threading.Event()

    @property
    def open_connections(self) -> int:
        return len(self._connections)

    # ---- the loop -------------------------------------------------------------------------------------------------
    def serve_forever(self) -> None:
        self._selector.register(self.socket, selectors.EVENT_READ)
        try:
            while not self._stop.is_set():
                for key, _mask in self._selector.select(POLL_S):
                    if key.fileobj is self.socket:
                        self._accept()
                    else:
                        connection = self._connections.get(key.fd)
                        if connection is not None:
                            self._serve(connection)
                self._expire(time.monotonic())
        finally:
            for connection in list(self._connections.values()):
                self._close(connection)
            self._selector.close()
            self._stopped.set()

    def shutdown(self) -> None:
        """Stop :meth:`serve_forever` and wait until it closed every connection."""
        self._stop.set()
        self._stopped.wait()

    def server_close(self) -> None:
        self.socket.close()

    def _accept(self) -> None:
        for _ in range(self.limits.accepts_per_pass):
            try:
                sock, _peer = self.socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors, a reset before accept: the next pass tries again
                log.debug("metrics server: accept failed: %r", exc)
                return
            while len(self._connections) >= self.limits.max_connections:
                self.evicted += 1
                self._close(next(iter(self._connections.values())))
            sock.setblocking(False)
            connection = _Connection(sock, time.monotonic() + self.limits.request_s)
            self._connections[sock.fileno()] = connection
            self._selector.register(sock, selectors.EVENT_READ)
            self._serve(connection)  # a scraper's request is usually there already

    def _serve(self, connection: _Connection) -> None:
        try:
            if connection.answer is None:
                self._read(connection)
            if connection.answer is not None:
                self._write(connection)
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self.dropped += 1
            self._close(connection)

    def _read(self, connection: _Connection) -> None:
        while connection.answer is None:
            data = connection.sock.recv(4096)
            if not data:
                self.dropped += 1
                self._close(connection)
                return
            connection.request += data
            end = connection.request.find(b"\r\n\r\n")
            if end < 0 and len(connection.request) > self.limits.max_request_bytes:
                self.dropped += 1
                self._close(connection)
                return
            if end >= 0:
                connection.answer = memoryview(self._answer(bytes(connection.request[:end])))
                connection.deadline = time.monotonic() + self.limits.answer_s
                self._selector.modify(connection.sock, selectors.EVENT_WRITE)

    def _write(self, connection: _Connection) -> None:
        assert connection.answer is not None
        while connection.answer:
            sent = connection.sock.send(connection.answer)
            connection.answer = connection.answer[sent:]
        self.served += 1
        self._close(connection)

    def _expire(self, now: float) -> None:
        for connection in [c for c in self._connections.values() if c.deadline <= now]:
            self.dropped += 1
            self._close(connection)

    def _close(self, connection: _Connection) -> None:
        fd = connection.sock.fileno()
        if self._connections.pop(fd, None) is not None:
            self._selector.unregister(connection.sock)
        connection.sock.close()

    # ---- one answer -----------------------------------------------------------------------------------------------
    def _answer(self, head: bytes) -> bytes:
        """The whole HTTP/1.0 answer to a request whose line and headers are ``head``."""
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return _response("400 Bad Request", [("Content-Type", "text/plain")], b"bad request line\n")
        method, target, version = parts
        path, _, query = target.partition("?")
        environ: dict[str, Any] = {
            "REQUEST_METHOD": method,
            "PATH_INFO": urllib.parse.unquote(path),
            "QUERY_STRING": query,
            "SERVER_NAME": str(self.server_address[0]),
            "SERVER_PORT": str(self.server_port),
            "SERVER_PROTOCOL": version,
            "wsgi.version": (1, 0),
            "wsgi.url_scheme": "http",
            "wsgi.input": io.BytesIO(),
            "wsgi.errors": sys.stderr,
            "wsgi.multithread": False,
            "wsgi.multiprocess": False,
            "wsgi.run_once": False,
        }
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                environ["HTTP_" + name.strip().upper().replace("-", "_")] = value.strip()
        started: list[Any] = []

        def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> None:
            started[:] = [status, headers]

        try:
            result = self.app(environ, start_response)
            try:
                body = b"".join(result)
            finally:
                close = getattr(result, "close", None)
                if close is not None:
                    close()
        except Exception:  # a collector's failure is an answer, not the end of the exporter
            log.exception("metrics server: the app failed")
            return _response("500 Internal Server Error", [("Content-Type", "text/plain")], b"error\n")
        status, headers = started
        return _response(status, headers, b"" if method == "HEAD" else body)


def _response(status: str, headers: list[tuple[str, str]], body: bytes) -> bytes:
    named = {name.lower() for name, _ in headers}
    extra = [("Content-Length", str(len(body)))] if "content-length" not in named else []
    lines = [f"HTTP/1.0 {status}", *(f"{name}: {value}" for name, value in [*headers, *extra]), "Connection: close"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def serve_metrics(
    port: int, addr: str = "0.0.0.0", registry: Optional[Any] = None, limits: Limits = LIMITS
) -> BoundedHttpServer:
    """Serve ``registry`` (prometheus-client's default registry when None) on ``addr:port`` on a daemon thread;
    raises ``OSError`` when the port cannot be bound."""
    import prometheus_client

    app = prometheus_client.make_wsgi_app(registry or prometheus_client.REGISTRY)
    server = BoundedHttpServer((addr, port), app, limits)
    threading.Thread(target=server.serve_forever, name="metrics-server", daemon=True).start()
    return server
