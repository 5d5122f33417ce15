"""Which process of a local job listens where, from /proc: the agent's loopback store server (a process of the agent's
pod reaches it without the front), a worker's metrics exporter, and how many threads a process runs."""

from __future__ import annotations

import os
import pathlib
from typing import Optional

LISTEN = "0A"
"""A socket's state in /proc/net/tcp while it listens."""


def _socket_inodes(pid: int) -> set[str]:
    inodes: set[str] = set()
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for name in names:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    return inodes


def listening(pid: int) -> set[tuple[str, int]]:
    """(hex address as /proc/net/tcp writes it, port) of every IPv4/IPv6 socket ``pid`` listens on."""
    inodes = _socket_inodes(pid)
    found = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = pathlib.Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == LISTEN and fields[9] in inodes:
                address, port = fields[1].split(":")
                found.add((address, int(port, 16)))
    return found


LOOPBACK = "0100007F"
"""127.0.0.1 as /proc/net/tcp writes it."""


def loopback_ports(pids: set[int], but: set[int]) -> set[int]:
    """The ports ``pids`` listen on at 127.0.0.1 only, less ``but``."""
    return {port for pid in pids for address, port in listening(pid) if address == LOOPBACK and port not in but}


def listener_of(port: int, pids: set[int]) -> Optional[int]:
    """The process among ``pids`` that listens on ``port`` (any address), or None."""
    for pid in sorted(pids):
        if any(p == port for _address, p in listening(pid)):
            return pid
    return None


def thread_count(pid: int) -> int:
    """The threads of ``pid`` (0 when it is gone)."""
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return 0
