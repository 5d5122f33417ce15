"""A Prometheus exporter that a stranger cannot grow: at most :data:`MAX_CONNECTIONS` connections, each read and
write bounded by :data:`TIMEOUT_S`.

Why: ``prometheus_client.start_http_server`` serves every connection on a thread of its own without a timeout, so
slow clients on a metrics port (the operator's, every worker's) pile up threads without bound. This server refuses a
connection beyond the cap at once (a scraper needs one at a time) and drops one that sends or reads nothing for
:data:`TIMEOUT_S`. A stranger can still hold the slots and so delay scrapes; it cannot hold more. prometheus-client
is imported when a server starts (the package imports it nowhere else).
"""

from __future__ import annotations

import socket
import threading
from socketserver import ThreadingMixIn
from typing import Any, Optional
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

MAX_CONNECTIONS = 8
"""Connections served at once; more are closed on accept."""
TIMEOUT_S = 5.0
"""Each read and each write of a connection (a scrape takes milliseconds)."""


class _QuietHandler(WSGIRequestHandler):
    timeout = TIMEOUT_S
    """socketserver sets it on the connection: every recv and send of the request and the answer."""

    def log_message(self, format: str, *args: Any) -> None:
        """No access log (a scrape every few seconds)."""


class BoundedMetricsServer(ThreadingMixIn, WSGIServer):
    """A threading WSGI server that serves at most ``max_connections`` connections at once."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], max_connections: int = MAX_CONNECTIONS) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self._slots = threading.BoundedSemaphore(max_connections)
        self.refused = 0
        """Connections closed on accept because every slot was taken."""
        self.dropped = 0
        """Connections that ended in an error: timed out (the handler's socket timeout) or reset."""
        super().__init__(address, _QuietHandler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that timed out or went away is no error of ours (socketserver would print a traceback)."""
        self.dropped += 1

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def serve(port: int, addr: str = "0.0.0.0", registry: Optional[Any] = None) -> BoundedMetricsServer:
    """Serve ``registry`` (prometheus-client's default registry when None) on ``addr:port`` on a daemon thread;
    raises ``OSError`` when the port cannot be bound."""
    import prometheus_client

    server = BoundedMetricsServer((addr, port))
    server.set_app(prometheus_client.make_wsgi_app(registry or prometheus_client.REGISTRY))
    threading.Thread(target=server.serve_forever, name="metrics-server", daemon=True).start()
    return server
