"""A free TCP port on this machine, for what binds locally: local mode's stores and metrics exporters, and the
process group of a trainer started with plain ``python train.py`` (no torchrun).

The port is chosen below the kernel's ephemeral range. A port the kernel hands out (``bind`` to port 0, or the
local end of any outgoing connection) is reused by any process as soon as it is free: a store that must come back
on the same port after its process died (local mode's agent) would find it taken, and a client reconnecting to
it could even connect to itself. Ports outside that range are only ever taken by someone who names them."""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
CHOSEN_RANGE = (15000, 30000)
"""Where ports are chosen when the ephemeral range leaves room: above the common well-known services and below
Kubernetes' NodePort range (30000-32767)."""
MIN_CHOICES = 1000
"""Fewer free candidates than this below the ephemeral range: let the kernel pick instead."""
ATTEMPTS = 64

_random = random.SystemRandom()
"""Not the module's generator: forks of one process would share its state and pick the same ports."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing is bound to now, outside the ephemeral range where there is one (another process naming the
    same port may still take it before the caller binds)."""
    candidates = range(CHOSEN_RANGE[0], min(CHOSEN_RANGE[1], ephemeral_range()[0]))
    if len(candidates) >= MIN_CHOICES:
        for port in _random.sample(candidates, ATTEMPTS):
            if bindable(host, port):
                return port
    return kernel_pick(host)


def ephemeral_range(path: Path = EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    """The kernel's range for ports it hands out; (0, 0), so nothing lies below it, where it cannot be read."""
    try:
        low, high = (int(field) for field in path.read_text().split())
    except (OSError, ValueError):
        return (0, 0)
    return (low, high)


def bindable(host: str, port: int) -> bool:
    """No socket holds ``port`` now, not even one in TIME_WAIT (checked without SO_REUSEADDR)."""
    with socket.socket() as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
        return True


def kernel_pick(host: str) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        port: int = probe.getsockname()[1]
        return port
