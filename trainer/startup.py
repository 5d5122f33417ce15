"""The worker's side of the reform phases: when this process started, and when the previous group exited.

Why: the operator can only see that a reform took N seconds; what it cost (imports, model build, process group,
checkpoint load) is known here. The old workers note their exit in the agent's store
(:func:`note_exit`); the new group's rank 0 takes those notes (:func:`take_exit_times`), adds its own stamps
(:class:`StartupClock`) and sends them with its progress reports as a
:class:`~disttrain.api.reformphases.WorkerStartup`. Everything here is best effort: timing must never stop
training, and a dead agent must never delay an exit.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Optional

from torch.distributed import Store

from disttrain.api import control as keys
from disttrain.api.reformphases import WorkerStartup
from disttrain.trainer.launch.warmstart import HANDOVER_ENV as HANDOVER_ENV  # lifecycle sets it too

log = logging.getLogger("disttrain.trainer")

EXIT_NOTE_TIMEOUT_S = 0.5
"""Longest an exiting worker waits for its exit note (the agent may be the thing that died)."""


def process_start_time() -> Optional[float]:
    """Unix time this process became a worker: its hand-over time when it was a warm interpreter
    (:mod:`disttrain.trainer.launch.warmstart`), else its creation (Linux ``/proc``); None where unknown."""
    handover = os.environ.get(HANDOVER_ENV)
    if handover:
        try:
            return float(handover)
        except ValueError:
            pass
    try:
        with open("/proc/self/stat", encoding="ascii") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        ticks = int(fields[19])  # field 22 (starttime), counted after "pid (comm)"
        since_boot = ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - time.clock_gettime(time.CLOCK_BOOTTIME) + since_boot
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def note_exit(store: Optional[Store], now: Optional[float] = None) -> None:
    """Record that this worker exits now (the first exit of a group is kept, the last overwrites); gives up after
    :data:`EXIT_NOTE_TIMEOUT_S`."""
    if store is None:
        return
    stamp = repr(time.time() if now is None else now)

    def write() -> None:
        try:
            store.compare_set(keys.EXIT_FIRST_KEY, "", stamp)  # sets only when absent
            store.set(keys.EXIT_LAST_KEY, stamp)
        except Exception as exc:  # noqa: BLE001 - timing is best effort
            log.debug("could not note the exit: %s", exc)

    writer = threading.Thread(target=write, name="disttrain-exit-note", daemon=True)
    writer.start()
    writer.join(EXIT_NOTE_TIMEOUT_S)


def take_exit_times(store: Optional[Store]) -> tuple[Optional[float], Optional[float]]:
    """The previous group's first and last exit notes, removed so that the next reform starts afresh."""
    if store is None:
        return None, None
    found: list[Optional[float]] = []
    for key in (keys.EXIT_FIRST_KEY, keys.EXIT_LAST_KEY):
        value: Optional[float] = None
        try:
            if store.check([key]):
                value = float(store.get(key))
                store.delete_key(key)
        except Exception as exc:  # noqa: BLE001 - timing is best effort
            log.debug("could not read the exit note %s: %s", key, exc)
        found.append(value if value is not None and 0.0 <= value <= keys.MAX_TIME else None)
    return found[0], found[1]


class StartupClock:
    """This process's startup stamps, filled in as :class:`~disttrain.trainer.loop.ElasticTrainer` starts."""

    def __init__(self, imported: float) -> None:
        self.stamps: dict[str, Optional[float]] = {"spawned": process_start_time(), "imported": imported}

    def mark(self, name: str, now: Optional[float] = None) -> None:
        """Stamp ``name`` (a :class:`WorkerStartup` field) once; later marks keep the first."""
        self.stamps.setdefault(name, time.time() if now is None else now)

    def report(self) -> WorkerStartup:
        return WorkerStartup.model_validate(self.stamps)
