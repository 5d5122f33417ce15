"""Short garbage-collector pauses for the long-running operator: long-lived objects are frozen out of the scans.

Why: CPython's full collection scans every tracked object with the event loop stopped. At 500 running jobs the
operator holds about 500,000 (kopf's memory of every job, pod and node, the cached job bodies, the metric
series), and each full collection stopped it for 0.36-0.57 s, every 10-20 s (``bench/api_load.py --jobs 500``):
a scale request arriving then waited, and those pauses were the directive latency's tail. Nearly all of these
objects live as long as their job and hold no reference cycles; plain reference counting frees them.

So every :data:`FREEZE_INTERVAL_S` the objects alive are moved to the permanent generation (``gc.freeze()``,
where collections no longer look), and a collection scans only what was allocated since. Frozen objects are still
freed by reference counting. What a frozen object cannot be is collected as part of a reference *cycle* that
became garbage after the freeze; so every :data:`FULL_COLLECTION_INTERVAL_S` everything is unfrozen and collected
once (one long pause an hour instead of several a minute), and memory stays bounded.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import threading
import time
from typing import Optional

log = logging.getLogger("disttrain.operator")
FREEZE_INTERVAL_S = 10.0
FULL_COLLECTION_INTERVAL_S = 3600.0


@dataclasses.dataclass
class FreezeSchedule:
    """When to freeze and when to collect everything. Pure: the caller passes the monotonic time."""

    freeze_every_s: float = FREEZE_INTERVAL_S
    collect_every_s: float = FULL_COLLECTION_INTERVAL_S
    last_freeze: Optional[float] = None
    last_collection: Optional[float] = None

    def due(self, now: float) -> Optional[str]:
        """``"collect"`` (unfreeze, collect all, freeze again), ``"freeze"``, or None."""
        if self.last_collection is None:
            self.last_collection = now
        if now - self.last_collection >= self.collect_every_s:
            self.last_collection = self.last_freeze = now
            return "collect"
        if self.last_freeze is None or now - self.last_freeze >= self.freeze_every_s:
            self.last_freeze = now
            return "freeze"
        return None


def act(action: str) -> float:
    """Carry out one action of :meth:`FreezeSchedule.due`; returns the seconds it took (the pause it caused)."""
    started = time.perf_counter()
    if action == "collect":
        gc.unfreeze()
        gc.collect()
    gc.freeze()
    return time.perf_counter() - started


def start(schedule: Optional[FreezeSchedule] = None, tick_s: float = 5.0) -> threading.Thread:
    """Follow ``schedule`` in a daemon thread for the life of the process (the operator's ``main``)."""
    schedule = schedule or FreezeSchedule()

    def follow() -> None:
        while True:
            action = schedule.due(time.monotonic())
            if action is not None:
                pause = act(action)
                if action == "collect":
                    log.info("full garbage collection: %.0f ms, %d objects frozen", pause * 1000, gc.get_freeze_count())
            time.sleep(tick_s)

    thread = threading.Thread(target=follow, name="gc-freeze", daemon=True)
    thread.start()
    return thread
