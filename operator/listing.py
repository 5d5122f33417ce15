"""The only LISTs the operator makes: once per namespace before its first reconcile, and after kopf re-listed a watch.

Why once before the first reconcile: the watches fill the caches concurrently, and a reconcile on a half-filled
cache would judge wrongly (a pod whose node is not cached yet is on a deleted node: a loss). One LIST of the
namespace's pods and jobs and one of the nodes make the caches complete before any job of the namespace is
reconciled.

Why after a re-list: kopf restarts a watch that broke or expired (410 Gone) with a fresh listing, which delivers
every object that exists (events without a type) but never reports the ones deleted while the watch was
down. A sweep, shortly after such a listing, takes one LIST of its own and drops what the cache still holds
but the API server no longer has (:meth:`ClusterCache.sweep_pods` and siblings).

Never on a timer and never per reconcile: level-triggered correctness comes from the watches, these listings
and kopf's re-delivery of every object after a re-list (each one wakes its job).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Optional

from disttrain.operator.caches import ClusterCache, JobKey

log = logging.getLogger("disttrain.operator")
RELIST_SETTLE_SECONDS = 5.0
"""A sweep waits this long after the first event of kopf's re-listing, so that the listing is over."""
NODES = "nodes"
PODS = "pods"
JOBS = "jobs"

Scope = tuple[str, str]
"""(kind, namespace); nodes have the namespace ''."""
Lister = Callable[[Scope], Awaitable[list[dict[str, Any]]]]


class Listings:
    """Lists scopes into the cache: :meth:`ensure_synced` before a namespace's first reconcile, :meth:`relisted`
    when kopf's watch of a scope listed again."""

    def __init__(
        self,
        cache: ClusterCache,
        list_scope: Lister,
        wake: Callable[[Iterable[JobKey]], None],
        *,
        clock: Callable[[], float] = time.monotonic,
        settle_s: float = RELIST_SETTLE_SECONDS,
    ) -> None:
        self.cache = cache
        self.list_scope = list_scope
        self.wake = wake
        self.clock = clock
        self.settle_s = settle_s
        self.listed_at: dict[Scope, float] = {}
        """When the last LIST of each scope began (monotonic)."""
        self._locks: dict[Scope, asyncio.Lock] = {}
        self._pending: dict[Scope, asyncio.Task[None]] = {}

    async def ensure_synced(self, namespace: str) -> None:
        """The caches hold the nodes and the namespace's pods and jobs as a LIST showed them (once)."""
        scopes = ((NODES, ""), (PODS, namespace), (JOBS, namespace))
        if all(scope in self.listed_at for scope in scopes):
            return
        for scope in scopes:
            await self._refresh(scope, newer_than=None)

    def relisted(self, kind: str, namespace: Optional[str]) -> None:
        """kopf delivered a listed object of ``kind``: after a watch restart, sweep the scope a little later."""
        scope = (kind, "" if kind == NODES else namespace or "")
        if scope not in self.listed_at or scope in self._pending:
            return  # not synced yet (its first LIST is still to come), or a sweep is already scheduled
        seen = self.clock()
        self._pending[scope] = asyncio.create_task(self._sweep_later(scope, seen), name=f"sweep {scope}")

    async def close(self) -> None:
        for task in list(self._pending.values()):
            task.cancel()

    async def _sweep_later(self, scope: Scope, seen: float) -> None:
        try:
            await asyncio.sleep(self.settle_s)
            await self._refresh(scope, newer_than=seen)
        except Exception as error:  # noqa: BLE001 (an API error: the next re-list schedules another sweep)
            log.warning("sweep of %s %s failed: %r", scope[0], scope[1] or "(cluster)", error)
        finally:
            self._pending.pop(scope, None)

    async def _refresh(self, scope: Scope, *, newer_than: Optional[float]) -> None:
        """LIST ``scope`` into the cache unless a LIST of it began after ``newer_than`` (None: ever)."""
        lock = self._locks.setdefault(scope, asyncio.Lock())
        async with lock:
            last = self.listed_at.get(scope)
            if last is not None and (newer_than is None or last >= newer_than):
                return
            started = self.clock()
            items = await self.list_scope(scope)
            kind, namespace = scope
            now = self.clock()
            if kind == NODES:
                touched = self.cache.sweep_nodes(items, started, now)
            elif kind == PODS:
                touched = self.cache.sweep_pods(namespace, items, started, now)
            else:
                touched = self.cache.sweep_jobs(namespace, items, started, now)
            self.listed_at[scope] = started
        if touched:
            log.info("listed %s %s: %d job(s) changed", kind, namespace or "(cluster)", len(touched))
            self.wake(touched)
