"""Which Events about a job are posted: repeats are dropped and each job has a budget, as client-go's recorder does.

Why: an Event is an API write and a line in ``kubectl describe``; the core emits one for every state change it
decides, and a few decisions repeat while a state lasts (a drain timeout is seen again on each reconcile until
its victims are gone). Two rules, after client-go's EventCorrelator (``tools/record/events_cache.go``):

* the same Event (job, type, reason, message) within :data:`REPEAT_WINDOW_S` of the last one posted is dropped;
* each job may post :data:`BURST` Events at once, then one per :data:`REFILL_S` (a token bucket), so no
  sequence of distinct messages floods the Events API either;
* reasons of :data:`SEPARATE_BUDGETS` have a bucket of their own per job and never draw on the job's: what a
  stranger causes (the agent's store rejections) cannot crowd out the job's own Warnings (NodeLost, failures).

Pure: the caller passes the time.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Final

REPEAT_WINDOW_S: Final = 600.0
BURST: Final = 25
REFILL_S: Final = 10.0
SEPARATE_BUDGETS: Final = {"StoreValueRejected": (1, 60.0), "CheckpointUploadBehind": (1, 300.0)}
"""reason -> (burst, refill seconds) of its own per job: the store rejections' summary, at most one a minute; a
bucket that is behind, at most one every five minutes."""
MAX_REMEMBERED: Final = 10_000
"""Repeats remembered across all jobs; the oldest are forgotten first."""

EventKey = tuple[str, str, str, str, str]
"""(namespace, job, type, reason, message)"""


@dataclasses.dataclass
class _Bucket:
    tokens: float
    updated: float


class EventFilter:
    """Decides, Event by Event, whether to post it."""

    def __init__(
        self, *, repeat_window_s: float = REPEAT_WINDOW_S, burst: int = BURST, refill_s: float = REFILL_S
    ) -> None:
        self.repeat_window_s = repeat_window_s
        self.burst = burst
        self.refill_s = refill_s
        self._posted: collections.OrderedDict[EventKey, float] = collections.OrderedDict()
        self._buckets: dict[tuple[str, ...], _Bucket] = {}
        self.dropped = 0
        """Events dropped so far (repeats and over budget)."""

    def admit(self, key: EventKey, now: float) -> bool:
        """Whether to post the Event ``key`` at ``now``; a True answer counts it as posted."""
        last = self._posted.get(key)
        if last is not None and now - last < self.repeat_window_s:
            self.dropped += 1
            return False
        burst, refill_s = SEPARATE_BUDGETS.get(key[3], (self.burst, self.refill_s))
        owner = (key[0], key[1], key[3]) if key[3] in SEPARATE_BUDGETS else (key[0], key[1])
        bucket = self._buckets.get(owner) or _Bucket(tokens=float(burst), updated=now)
        bucket.tokens = min(float(burst), bucket.tokens + max(0.0, now - bucket.updated) / refill_s)
        bucket.updated = now
        self._buckets[owner] = bucket
        if bucket.tokens < 1.0:
            self.dropped += 1
            return False
        bucket.tokens -= 1.0
        self._posted[key] = now
        self._posted.move_to_end(key)
        while len(self._posted) > MAX_REMEMBERED:
            self._posted.popitem(last=False)
        return True

    def forget_job(self, namespace: str, name: str) -> None:
        """A deleted job's budget goes (its remembered repeats age out on their own)."""
        for owner in [o for o in self._buckets if o[:2] == (namespace, name)]:
            del self._buckets[owner]
