"""Process trees of local nodes: start one in its own session, find every descendant, kill them all.

torchrun starts each worker in a new session, so killing the agent's process group leaves its workers
running (an orphan keeps training at the old world size). A node therefore carries a unique environment
marker that every descendant inherits; a kill SIGKILLs every process that has the marker or descends from the
node's root, repeating until none is left, which is what a dying machine does to a pod.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Optional

from disttrain.api import env as env_names

MARKER_ENV = env_names.LOCAL_MARKER
"""Environment variable whose value identifies the node a process belongs to (inherited by all descendants)."""

_PROC = Path("/proc")


def marked(env: Mapping[str, str], marker: str) -> dict[str, str]:
    """``env`` with the node's ``marker``, which every process of the node inherits."""
    return {**env, MARKER_ENV: marker}


def spawn(
    argv: Sequence[str], env: Mapping[str, str], cwd: str, log: IO[bytes], marker: str
) -> subprocess.Popen[bytes]:
    """Start ``argv`` in a new session with ``marker`` in its environment; stdout and stderr go to ``log``."""
    return subprocess.Popen(
        list(argv),
        env=marked(env, marker),
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _read(path: Path) -> Optional[bytes]:
    try:
        return path.read_bytes()
    except OSError:
        return None


def _parent_of(pid: int) -> Optional[int]:
    raw = _read(_PROC / str(pid) / "stat")
    if raw is None:
        return None
    # The command name (field 2) is in parentheses and may contain spaces: split after the last ')'.
    fields = raw[raw.rfind(b")") + 2 :].split()
    return int(fields[1]) if len(fields) > 1 else None


def _is_zombie(pid: int) -> bool:
    raw = _read(_PROC / str(pid) / "stat")
    return raw is None or raw[raw.rfind(b")") + 2 : raw.rfind(b")") + 3] == b"Z"


def find_tree(marker: str, root: Optional[int] = None) -> set[int]:
    """Live (non-zombie) pids that carry ``marker`` or descend from ``root`` (root included)."""
    needle = f"{MARKER_ENV}={marker}".encode() + b"\0"
    parents: dict[int, int] = {}
    found: set[int] = set()
    for entry in _PROC.iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        parent = _parent_of(pid)
        if parent is not None:
            parents[pid] = parent
        environ = _read(entry / "environ")
        if environ is not None and needle in environ + b"\0":
            found.add(pid)
    if root is not None and root in parents:
        found.add(root)
    grown = True
    while grown:
        grown = False
        for pid, parent in parents.items():
            if parent in found and pid not in found:
                found.add(pid)
                grown = True
    found.discard(os.getpid())
    return {pid for pid in found if not _is_zombie(pid)}


def signal_tree(marker: str, root: Optional[int], sig: int) -> set[int]:
    """Send ``sig`` to every process of the tree once; returns the pids signalled."""
    pids = find_tree(marker, root)
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
    return pids


def kill_tree(marker: str, root: Optional[int] = None, timeout_s: float = 5.0) -> None:
    """SIGKILL the whole tree, repeating until no process of it is left (or ``timeout_s`` passes)."""
    deadline = time.monotonic() + timeout_s
    while signal_tree(marker, root, signal.SIGKILL) and time.monotonic() < deadline:
        time.sleep(0.02)


def _socket_inodes(pids: set[int]) -> set[str]:
    inodes = set()
    for pid in pids:
        fd_dir = _PROC / str(pid) / "fd"
        try:
            entries = list(fd_dir.iterdir())
        except OSError:
            continue
        for entry in entries:
            try:
                target = os.readlink(entry)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    return inodes


def is_connected_to(marker: str, root: Optional[int], port: int) -> bool:
    """Some process of the tree holds an established TCP connection to ``port`` (e.g. the rendezvous store).

    Local mode reports a new node as Running only from then on, as a pod is Pending while its container is
    being created: a process that is still importing torch has not reached the rendezvous yet.
    """
    inodes = _socket_inodes(find_tree(marker, root))
    if not inodes:
        return False
    wanted = f"{port:04X}"
    for table in ("tcp", "tcp6"):
        raw = _read(_PROC / "net" / table)
        for line in (raw or b"").decode().splitlines()[1:]:
            fields = line.split()
            if len(fields) > 9 and fields[3] == "01" and fields[2].rsplit(":", 1)[1] == wanted and fields[9] in inodes:
                return True
    return False
