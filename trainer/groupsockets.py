"""The TCP connections of this process's gloo groups, shut down when the process leaves them.

Why: a gloo receive is not interrupted by ``abort``, ``shutdown`` or ``destroy_process_group`` of its group (torch
2.13), and the group's connections stay open while anything still references it (FSDP2's mesh information does).
When a node dies, its neighbours' receives fail at once (its connections closed), but a survivor waiting on one of
*them* waits until ``collectiveTimeoutSeconds``: they left the collective without closing anything. Shutting the
sockets down (``shutdown(2)`` acts on the socket under every descriptor, gloo's included) ends this process's own
blocked receive and gives every peer an end of file, so the whole ring leaves within milliseconds of the first.

The sockets are told apart by when they were made: the connections a group's creation opened (:func:`capture`),
less those to the rendezvous store (``MASTER_PORT``); listeners (a metrics server's) are never touched. Linux only
(``/proc``); elsewhere nothing is captured and leaving waits as before.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pathlib
import socket
import threading
from collections.abc import Iterator

log = logging.getLogger("disttrain.trainer")

_PROC_FD = pathlib.Path("/proc/self/fd")
_TCP_TABLES = (pathlib.Path("/proc/self/net/tcp"), pathlib.Path("/proc/self/net/tcp6"))

_lock = threading.Lock()
_captured: dict[int, int] = {}
"""Descriptor -> socket inode of the current groups' connections."""


def _socket_descriptors() -> dict[int, int]:
    """This process's socket descriptors and their inodes."""
    found: dict[int, int] = {}
    try:
        entries = list(_PROC_FD.iterdir())
    except OSError:
        return found
    for entry in entries:
        try:
            target = os.readlink(entry)
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:[") and target.endswith("]"):
            found[int(entry.name)] = int(target[len("socket:[") : -1])
    return found


def tcp_ports() -> dict[int, tuple[int, int]]:
    """Inode -> (local port, remote port) of the TCP sockets of this network namespace."""
    ports: dict[int, tuple[int, int]] = {}
    for table in _TCP_TABLES:
        try:
            lines = table.read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10:
                continue
            local, remote, inode = fields[1], fields[2], int(fields[9])
            ports[inode] = (int(local.rsplit(":", 1)[1], 16), int(remote.rsplit(":", 1)[1], 16))
    return ports


def _kept_ports() -> set[int]:
    """Ports whose connections outlive a group: the rendezvous store's (either end: a process may host it)."""
    port = os.environ.get("MASTER_PORT", "")
    return {int(port)} if port.isdigit() else set()


@contextlib.contextmanager
def capture() -> Iterator[None]:
    """Record the TCP sockets the ``with`` body opens (a group's creation) as the current groups' connections."""
    before = set(_socket_descriptors().items())
    try:
        yield
    finally:
        opened = dict(set(_socket_descriptors().items()) - before)
        ports = tcp_ports()
        kept = _kept_ports()
        with _lock:
            for fd, inode in opened.items():
                local, remote = ports.get(inode, (0, 0))
                if remote and not kept & {local, remote}:  # a connection (not a listener), not the store's
                    _captured[fd] = inode


def captured() -> int:
    """How many connections are recorded now."""
    with _lock:
        return len(_captured)


def shut_down() -> int:
    """Shut down every recorded connection that is still the socket it was (a descriptor may have been reused) and
    forget them; returns how many were shut down."""
    with _lock:
        recorded = dict(_captured)
        _captured.clear()
    done = 0
    for fd, inode in recorded.items():
        try:
            duplicate = os.dup(fd)
        except OSError:
            continue
        try:
            if os.fstat(duplicate).st_ino != inode:
                continue
            sock = socket.socket(fileno=duplicate)
            duplicate = -1  # owned by ``sock`` now
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
                done += 1
            sock.close()
        finally:
            if duplicate >= 0:
                os.close(duplicate)
    if done:
        log.info("shut down %d connection(s) of the groups being left", done)
    return done


def forget() -> None:
    """The groups ended cleanly (the end of training): nothing to shut down."""
    with _lock:
        _captured.clear()
