"""The operator's watch caches: our jobs, our pods and the nodes, as the watches and our own writes last showed them.

Why: a reconcile must never LIST. One LIST of the job's pods and one of every node per reconcile, with a GET
of the job, was most of what a running job cost the API server. kopf's watches deliver every change; the
adapter's handlers feed them in here, the adapter adds the answers to its own writes (so the reconcile after a
write sees it, however late the watch event comes), and a reconcile reads from here only. Pure: no I/O, no
kopf; the caller passes the monotonic time.

Three rules keep a cache true:

* Versions only move forward: an object older than the one held is dropped (the answer to a write and the
  watch event of an earlier write race each other).
* A deletion removes only the object it names (by uid): a pod created again under its old name survives the
  late DELETED event of its predecessor (kopf handles each object's events in its own task).
* Deletions missed while a watch was down: on a watch restart kopf lists again and delivers every object it
  finds, but never reports the ones that vanished meanwhile. :meth:`ClusterCache.sweep_pods` and its siblings
  take a fresh LIST and drop what is neither in it nor refreshed since the LIST began.

Pods are kept as :class:`~disttrain.operator.observed.PodView` and nodes as
:class:`~disttrain.operator.observed.NodeView`, the few fields policy reads, so a change to anything else
(a node's heartbeat time, a pod's IP) wakes no job. Each reconcile sees only the nodes that host its pods.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any, Generic, Optional, TypeVar

from disttrain.api import constants
from disttrain.common import versions
from disttrain.operator import views
from disttrain.operator.observed import NodeView, Observed, PodView

JobKey = tuple[str, str]
"""(namespace, job name)"""
PodKey = tuple[str, str]
"""(namespace, pod name)"""
K = TypeVar("K")
V = TypeVar("V")
TOMBSTONE_SECONDS = 300.0


@dataclasses.dataclass
class Entry(Generic[V]):
    uid: str
    version: Optional[str]
    value: V
    refreshed: float
    """Monotonic time it was last put: a sweep keeps what was refreshed after its LIST began."""


class VersionedStore(Generic[K, V]):
    """Objects of one kind by key, each with its uid and resourceVersion; versions only move forward, and a
    removed object (its uid) never comes back, even when the answer to our own write arrives after its DELETED
    event."""

    def __init__(self) -> None:
        self._entries: dict[K, Entry[V]] = {}
        self._gone: collections.OrderedDict[str, float] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: K) -> Optional[V]:
        entry = self._entries.get(key)
        return None if entry is None else entry.value

    def keys(self) -> list[K]:
        return list(self._entries)

    def put(self, key: K, uid: str, version: Optional[str], value: V, now: float) -> bool:
        """Keep ``value`` unless it is an older version of the object held; returns whether it was kept."""
        held = self._entries.get(key)
        if uid in self._gone or (held is not None and held.uid == uid and versions.is_older(version, held.version)):
            return False
        self._entries[key] = Entry(uid, version, value, now)
        return True

    def remove(self, key: K, uid: Optional[str] = None, now: float = 0.0) -> Optional[V]:
        """Forget the object (only if it is the one with ``uid``, when given); returns its value."""
        if uid is not None:
            self._bury(uid, now)
        held = self._entries.get(key)
        if held is None or (uid is not None and held.uid != uid):
            return None
        del self._entries[key]
        self._bury(held.uid, now)
        return held.value

    def _bury(self, uid: str, now: float) -> None:
        """Remember a deleted uid for :data:`TOMBSTONE_SECONDS` (longer than any write's answer takes)."""
        self._gone[uid] = now
        self._gone.move_to_end(uid)
        while self._gone:
            oldest, since = next(iter(self._gone.items()))
            if now - since < TOMBSTONE_SECONDS:
                break
            del self._gone[oldest]

    def stale(self, listed: Iterable[K], started: float, where: Any = None) -> list[K]:
        """Keys that a LIST begun at ``started`` did not return and no event refreshed since (``where``: a
        predicate on keys limiting the sweep to what the LIST covered)."""
        present = set(listed)
        return [
            key
            for key, entry in self._entries.items()
            if key not in present and entry.refreshed < started and (where is None or where(key))
        ]


@dataclasses.dataclass(frozen=True)
class PodRecord:
    """What the cache keeps of a pod: which job and role it belongs to, and its view."""

    job: str
    role: str
    view: PodView
    owners: frozenset[str] = frozenset()
    """The uids in its ownerReferences: the pod is the job's only when the job's uid is among them."""


def owner_uids(body: Mapping[str, Any]) -> frozenset[str]:
    """The uids an object's ``metadata.ownerReferences`` name."""
    references = _meta(body).get("ownerReferences") or []
    return frozenset(str(r.get("uid")) for r in references if isinstance(r, Mapping) and r.get("uid"))


def is_owned_by(body: Mapping[str, Any], uid: Optional[str]) -> bool:
    """Whether ``body`` belongs to the job with ``uid``: one of its owner references carries that uid.

    The one rule of ownership for everything the operator creates (pods, Services, Secrets, Roles, RoleBindings,
    ServiceAccounts, NetworkPolicies). Why not the job-name label or the name: a job deleted and applied again
    under the same name has a new uid, and the old job's pods (Terminating, with their exit codes) and objects
    match the label and the deterministic names until the garbage collector has removed them. Counting them
    failed the new job on its first reconcile; a 409 on one of them taken as success would adopt the old job's
    Secret, which the garbage collector then deletes."""
    return bool(uid) and uid in owner_uids(body)


def _meta(body: Mapping[str, Any]) -> Mapping[str, Any]:
    return body.get("metadata") or {}


def _identity(body: Mapping[str, Any]) -> tuple[str, Optional[str]]:
    meta = _meta(body)
    return str(meta.get("uid") or meta.get("name") or ""), meta.get("resourceVersion")


def pod_record(body: Mapping[str, Any]) -> Optional[PodRecord]:
    """The record of one of our pods; None for a pod without our job label."""
    labels = _meta(body).get("labels") or {}
    job = labels.get(constants.LABEL_JOB_NAME)
    if not job:
        return None
    return PodRecord(
        job=job, role=labels.get(constants.LABEL_ROLE, ""), view=views.pod_view(body), owners=owner_uids(body)
    )


class ClusterCache:
    """Jobs (the full object), our pods and the nodes, with the indexes a reconcile and a wake-up need."""

    def __init__(self) -> None:
        self.jobs: VersionedStore[JobKey, dict[str, Any]] = VersionedStore()
        self.pods: VersionedStore[PodKey, PodRecord] = VersionedStore()
        self.nodes: VersionedStore[str, NodeView] = VersionedStore()
        self._pods_of_job: dict[JobKey, set[str]] = {}
        self._pods_on_node: dict[str, set[PodKey]] = {}

    # -- jobs ---------------------------------------------------------------------------------------------------

    def job(self, namespace: str, name: str) -> Optional[dict[str, Any]]:
        return self.jobs.get((namespace, name))

    def put_job(self, body: Mapping[str, Any], now: float) -> Optional[JobKey]:
        """Keep the job; returns its key when it is new or changed (the job's loop should look), else None."""
        meta = _meta(body)
        key = (str(meta.get("namespace") or ""), str(meta.get("name") or ""))
        uid, version = _identity(body)
        held = self.jobs.get(key)
        kept = self.jobs.put(key, uid, version, dict(body), now)
        return key if kept and held != body else None

    def remove_job(self, body: Mapping[str, Any], now: float) -> Optional[JobKey]:
        meta = _meta(body)
        key = (str(meta.get("namespace") or ""), str(meta.get("name") or ""))
        return key if self.jobs.remove(key, _identity(body)[0], now) is not None else None

    # -- pods ---------------------------------------------------------------------------------------------------

    def put_pod(self, body: Mapping[str, Any], now: float) -> Optional[JobKey]:
        """Keep one of our pods; returns its job when what policy reads of it changed, else None."""
        record = pod_record(body)
        if record is None:
            return None
        meta = _meta(body)
        key = (str(meta.get("namespace") or ""), str(meta.get("name") or ""))
        uid, version = _identity(body)
        before = self.pods.get(key)
        if not self.pods.put(key, uid, version, record, now):
            return None  # an older version
        self._unindex(key, before)
        self._index(key, record)
        return (key[0], record.job) if record != before else None

    def remove_pod(self, body: Mapping[str, Any], now: float) -> Optional[JobKey]:
        meta = _meta(body)
        key = (str(meta.get("namespace") or ""), str(meta.get("name") or ""))
        record = self.pods.remove(key, _identity(body)[0], now)
        if record is None:
            return None
        self._unindex(key, record)
        return key[0], record.job

    def _index(self, key: PodKey, record: Optional[PodRecord]) -> None:
        if record is None:
            return
        self._pods_of_job.setdefault((key[0], record.job), set()).add(key[1])
        if record.view.node_name:
            self._pods_on_node.setdefault(record.view.node_name, set()).add(key)

    def _unindex(self, key: PodKey, record: Optional[PodRecord]) -> None:
        if record is None:
            return
        job_key = (key[0], record.job)
        names = self._pods_of_job.get(job_key)
        if names is not None:
            names.discard(key[1])
            if not names:
                del self._pods_of_job[job_key]
        node = record.view.node_name
        if node and node in self._pods_on_node:
            self._pods_on_node[node].discard(key)
            if not self._pods_on_node[node]:
                del self._pods_on_node[node]

    # -- nodes --------------------------------------------------------------------------------------------------

    def put_node(self, body: Mapping[str, Any], now: float) -> set[JobKey]:
        """Keep a node's view; returns the jobs with pods on it when the view changed (a heartbeat changes none)."""
        view = views.node_view(body)
        uid, version = _identity(body)
        before = self.nodes.get(view.name)
        kept = self.nodes.put(view.name, uid, version, view, now)
        return self.jobs_on_node(view.name) if kept and view != before else set()

    def remove_node(self, body: Mapping[str, Any], now: float) -> set[JobKey]:
        name = str(_meta(body).get("name") or "")
        return self.jobs_on_node(name) if self.nodes.remove(name, _identity(body)[0], now) is not None else set()

    def jobs_on_node(self, node: str) -> set[JobKey]:
        jobs = set()
        for key in self._pods_on_node.get(node, ()):
            record = self.pods.get(key)
            if record is not None:
                jobs.add((key[0], record.job))
        return jobs

    # -- what a reconcile reads ---------------------------------------------------------------------------------

    def observe(self, namespace: str, name: str, uid: Optional[str]) -> Observed:
        """The pods of the job with ``uid``, and the nodes that host them (a node absent here was deleted: the
        caches are synced before any reconcile, see :mod:`disttrain.operator.listing`).

        Only pods an owner reference ties to ``uid`` count (:func:`is_owned_by`): those of an older job of the
        same name match the label but are not this job's. ``uid`` None (a job the API server has not stored) has
        no pods."""
        workers: list[PodView] = []
        agent: Optional[PodView] = None
        for pod_name in sorted(self._pods_of_job.get((namespace, name), ())):
            record = self.pods.get((namespace, pod_name))
            if record is None or not uid or uid not in record.owners:
                continue
            if record.role == constants.ROLE_WORKER:
                workers.append(record.view)
            elif record.role == constants.ROLE_AGENT:
                agent = record.view
        hosts = {p.node_name for p in [*workers, *([agent] if agent else [])] if p.node_name}
        nodes = {host: view for host in hosts if (view := self.nodes.get(host)) is not None}
        return Observed(workers=tuple(workers), agent=agent, nodes=nodes)

    # -- sweeps after a LIST ------------------------------------------------------------------------------------

    def sweep_pods(
        self, namespace: str, listed: Iterable[Mapping[str, Any]], started: float, now: float
    ) -> set[JobKey]:
        """Take a LIST of our pods in ``namespace`` begun at ``started``; returns the jobs whose pods changed."""
        touched: set[JobKey] = set()
        keys = []
        for body in listed:
            meta = _meta(body)
            keys.append((namespace, str(meta.get("name") or "")))
            job = self.put_pod(body, now)
            if job is not None:
                touched.add(job)
        for key in self.pods.stale(keys, started, where=lambda k: k[0] == namespace):
            record = self.pods.remove(key, now=now)
            self._unindex(key, record)
            if record is not None:
                touched.add((namespace, record.job))
        return touched

    def sweep_nodes(self, listed: Iterable[Mapping[str, Any]], started: float, now: float) -> set[JobKey]:
        """Take a LIST of every node begun at ``started``; returns the jobs with pods on a changed node."""
        touched: set[JobKey] = set()
        names = []
        for body in listed:
            names.append(str(_meta(body).get("name") or ""))
            touched |= self.put_node(body, now)
        for name in self.nodes.stale(names, started):
            touched |= self.jobs_on_node(name)
            self.nodes.remove(name, now=now)
        return touched

    def sweep_jobs(
        self, namespace: str, listed: Iterable[Mapping[str, Any]], started: float, now: float
    ) -> set[JobKey]:
        """Take a LIST of the jobs in ``namespace`` begun at ``started``; returns the jobs that changed or left."""
        touched: set[JobKey] = set()
        keys = []
        for body in listed:
            key = self.put_job(body, now)
            keys.append((namespace, str(_meta(body).get("name") or "")))
            if key is not None:
                touched.add(key)
        for key in self.jobs.stale(keys, started, where=lambda k: k[0] == namespace):
            self.jobs.remove(key, now=now)
            touched.add(key)
        return touched
