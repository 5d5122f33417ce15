"""A free TCP port on this machine, for what binds locally: local mode's stores and metrics exporters, and the
process group of a trainer started with plain ``python train.py`` (no torchrun)."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the OS picks it; another process may take it before the caller binds)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        port: int = probe.getsockname()[1]
        return port
