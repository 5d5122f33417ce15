"""The local job agent's memory as /proc shows it: its process tree's resident set and high-water mark, the mark
reset as an attack begins (what the security tier and ``bench/store_attacks.py`` measure)."""

from __future__ import annotations

import contextlib
import pathlib

from disttrain.operator.local import proctree
from disttrain.operator.local.runtime import LocalRuntime


def agent_pids(runtime: LocalRuntime) -> set[int]:
    """The agent's process tree (empty when it has none or it ended)."""
    agent = runtime.agent
    if agent is None or not agent.is_alive:
        return set()
    return proctree.find_tree(agent.marker, agent.proc.pid)


def rss_of(pids: set[int]) -> tuple[int, int]:
    """(sum of VmRSS, largest VmHWM) of ``pids`` in bytes, from /proc (pids that are gone count 0)."""
    rss = hwm = 0
    for pid in pids:
        try:
            text = pathlib.Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith("VmRSS:"):
                rss += int(line.split()[1]) * 1024
            elif line.startswith("VmHWM:"):
                hwm = max(hwm, int(line.split()[1]) * 1024)
    return rss, hwm


def reset_peaks(pids: set[int]) -> None:
    """Reset each process's VmHWM to its VmRSS, so that a peak read later is one reached since."""
    for pid in pids:
        with contextlib.suppress(OSError):
            pathlib.Path(f"/proc/{pid}/clear_refs").write_text("5")
