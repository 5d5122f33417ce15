"""The kopf adapter: turns Kubernetes events into ``reconcile`` calls and ``Actions`` into API calls. Thin.

One kopf daemon per DistTrainJob is its reconcile loop: it waits until something about the job changed (the
job, one of its pods, a node) or the core's nearest timer expired, then reads the job and its pods fresh from
the API, calls :func:`reconcile.reconcile`, and applies the actions in a crash-safe order: status first (the
core's memory), then deletions, creations and events. Killing the operator at any point loses nothing: the
next loop reads the same status and pods, and deterministic names turn a repeated create into 409 Conflict.

No policy lives here; an ``if`` about training belongs in the core.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any, Optional

import kopf
from kubernetes import client as k8s

from disttrain.api import constants, timestamps
from disttrain.api.spec import DistTrainJob
from disttrain.operator import pods as builders
from disttrain.operator import views
from disttrain.operator.metrics import OperatorMetrics
from disttrain.operator.observed import Actions
from disttrain.operator.reconcile import reconcile

log = logging.getLogger("disttrain.operator")
MERGE_PATCH = "application/merge-patch+json"
IDLE_RESYNC_SECONDS = 30.0
"""Reconcile at least this often even when nothing is heard (a missed watch event must not stall a job)."""


class Kube:
    """The few API calls the adapter makes, with the sync ``kubernetes`` client run in threads."""

    def __init__(self, api_client: k8s.ApiClient) -> None:
        self.core = k8s.CoreV1Api(api_client)
        self.rbac = k8s.RbacAuthorizationV1Api(api_client)
        self.custom = k8s.CustomObjectsApi(api_client)
        self.nodes_allowed = True

    @staticmethod
    async def _call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return await asyncio.to_thread(fn, *args, **kwargs)

    async def get_job(self, namespace: str, name: str) -> Optional[dict[str, Any]]:
        try:
            return await self._call(
                self.custom.get_namespaced_custom_object,
                constants.GROUP,
                constants.VERSION,
                namespace,
                constants.PLURAL,
                name,
            )
        except k8s.ApiException as error:
            if error.status == 404:
                return None
            raise

    async def list_pods(self, namespace: str, job: str) -> list[dict[str, Any]]:
        selector = f"{constants.LABEL_JOB_NAME}={job}"
        result = await self._call(
            self.core.list_namespaced_pod, namespace, label_selector=selector, _preload_content=False
        )
        return json.loads(result.data)["items"]

    async def list_nodes(self) -> Optional[list[dict[str, Any]]]:
        """All nodes, or None when the operator may not list them (then pods are not judged by node)."""
        if not self.nodes_allowed:
            return None
        try:
            result = await self._call(self.core.list_node, _preload_content=False)
        except k8s.ApiException as error:
            if error.status in (401, 403):
                self.nodes_allowed = False
                return None
            raise
        return json.loads(result.data)["items"]

    async def patch_status(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        await self._call(
            self.custom.patch_namespaced_custom_object_status,
            constants.GROUP,
            constants.VERSION,
            namespace,
            constants.PLURAL,
            name,
            {"status": patch},
            _content_type=MERGE_PATCH,
            _preload_content=False,
        )

    async def create(self, obj: dict[str, Any]) -> None:
        """Create ``obj``; an existing one (409) is fine: names are deterministic."""
        namespace = obj["metadata"]["namespace"]
        kind = obj["kind"]
        creators: dict[str, Callable[..., Any]] = {
            "Pod": self.core.create_namespaced_pod,
            "Service": self.core.create_namespaced_service,
            "ServiceAccount": self.core.create_namespaced_service_account,
            "Role": self.rbac.create_namespaced_role,
            "RoleBinding": self.rbac.create_namespaced_role_binding,
            "Event": self.core.create_namespaced_event,
        }
        try:
            await self._call(creators[kind], namespace, obj, _preload_content=False)
        except k8s.ApiException as error:
            if error.status != 409:
                raise

    async def delete_pod(self, namespace: str, name: str, force: bool) -> None:
        try:
            await self._call(
                self.core.delete_namespaced_pod,
                name,
                namespace,
                grace_period_seconds=0 if force else None,
                _preload_content=False,
            )
        except k8s.ApiException as error:
            if error.status != 404:
                raise

    async def delete_job(self, namespace: str, name: str) -> None:
        try:
            await self._call(
                self.custom.delete_namespaced_custom_object,
                constants.GROUP,
                constants.VERSION,
                namespace,
                constants.PLURAL,
                name,
                propagation_policy="Background",
                _preload_content=False,
            )
        except k8s.ApiException as error:
            if error.status != 404:
                raise


def api_error_message(error: k8s.ApiException) -> str:
    """The API server's own sentence (which verb on which resource was refused), not just "403 Forbidden"."""
    try:
        return str(json.loads(error.body or "{}").get("message", "")) or str(error.body or "")
    except (TypeError, ValueError):
        return str(error.body or "")


def event_object(job: DistTrainJob, type_: str, reason: str, message: str, now: float) -> dict[str, Any]:
    """A core/v1 Event about the job (unique name: Events need no idempotency, a repeat is just a repeat)."""
    stamp = timestamps.format_time_seconds(now)
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": f"{job.metadata.name}.{uuid.uuid4().hex[:16]}", "namespace": job.metadata.namespace},
        "involvedObject": {
            "apiVersion": constants.API_VERSION,
            "kind": constants.KIND,
            "name": job.metadata.name,
            "namespace": job.metadata.namespace,
            "uid": job.metadata.uid or "",
        },
        "type": type_,
        "reason": reason,
        "message": message[:1024],
        "source": {"component": "disttrain-operator"},
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
        "reportingComponent": "disttrain.dev/operator",
        "reportingInstance": "disttrain-operator",
    }


async def apply(kube: Kube, job: DistTrainJob, actions: Actions, now: float) -> None:
    """Apply in crash-safe order: status (memory) first, then deletions, creations, events, TTL deletion."""
    ns, name = job.metadata.namespace, job.metadata.name
    if actions.status_patch:
        await kube.patch_status(ns, name, dict(actions.status_patch))
    for deletion in actions.delete_pods:
        await kube.delete_pod(ns, deletion.name, deletion.force)
    if actions.create_agent:
        for obj in builders.build_support_objects(job):
            await kube.create(obj)
        await kube.create(builders.build_agent_pod(job))
    for index in actions.create_workers:
        await kube.create(builders.build_worker_pod(job, index))
    for event in actions.events:
        try:
            await kube.create(event_object(job, event.type, event.reason, event.message, now))
        except k8s.ApiException as error:  # events are best effort
            log.warning("could not post event %s: %s", event.reason, error.reason)
    if actions.delete_job:
        await kube.delete_job(ns, name)


async def reconcile_once(kube: Kube, metrics: OperatorMetrics, namespace: str, name: str) -> Optional[Actions]:
    """Read fresh, decide, write. Returns the actions (None when the job is gone)."""
    started = time.perf_counter()
    raw = await kube.get_job(namespace, name)
    if raw is None:
        metrics.forget_job(namespace, name)
        return None
    raw.setdefault("metadata", {}).setdefault("namespace", namespace)
    job = DistTrainJob.model_validate(
        {k: v for k, v in raw.items() if k in ("apiVersion", "kind", "metadata", "spec", "status")}
    )
    observed = views.observe(name, await kube.list_pods(namespace, name), await kube.list_nodes())
    now = time.time()
    actions = reconcile(job, observed, now)
    await apply(kube, job, actions, now)
    metrics.reconcile_duration.observe(time.perf_counter() - started)
    metrics.observe_job(namespace, name, actions.status, now, max_restarts=job.spec.restart_policy.max_restarts)
    return actions


class Pokes:
    """One asyncio.Event per job: watch events on pods and nodes wake the job's loop."""

    def __init__(self) -> None:
        self.events: dict[tuple[str, str], asyncio.Event] = {}

    def get(self, namespace: str, name: str) -> asyncio.Event:
        return self.events.setdefault((namespace, name), asyncio.Event())

    def poke(self, namespace: str, name: str) -> None:
        event = self.events.get((namespace, name))
        if event is not None:
            event.set()

    def poke_all(self) -> None:
        for event in self.events.values():
            event.set()


def _namespaced(namespace: Optional[str]) -> str:
    """kopf types ``namespace`` as optional for cluster-scoped kinds; DistTrainJobs and Pods always have one."""
    if namespace is None:
        raise kopf.PermanentError("a DistTrainJob or Pod without a namespace")
    return namespace


def register(
    registry: kopf.OperatorRegistry, api_client_factory: Callable[[], k8s.ApiClient], metrics: OperatorMetrics
) -> None:
    """Register every handler on ``registry`` (a fresh one in tests, kopf's default one in ``disttrain operator``)."""
    pokes = Pokes()
    kube_box: dict[str, Kube] = {}

    def kube() -> Kube:
        if "kube" not in kube_box:
            kube_box["kube"] = Kube(api_client_factory())
        return kube_box["kube"]

    @kopf.daemon(constants.GROUP, constants.VERSION, constants.PLURAL, registry=registry, cancellation_timeout=5.0)
    async def job_loop(*, name: str, namespace: Optional[str], stopped: kopf.DaemonStopped, **_: Any) -> None:
        """The job's reconcile loop (kopf starts it on create and on operator start, stops it on deletion)."""
        namespace = _namespaced(namespace)
        wake = pokes.get(namespace, name)
        try:
            while not stopped:
                wake.clear()
                delay = IDLE_RESYNC_SECONDS
                try:
                    actions = await reconcile_once(kube(), metrics, namespace, name)
                    if actions is None:
                        return
                    if actions.requeue_after is not None:
                        delay = min(delay, max(0.05, actions.requeue_after))
                    if actions.status_patch or actions.delete_pods or actions.create_workers or actions.create_agent:
                        delay = min(delay, 0.2)  # look again soon: our own writes change what we observe
                except k8s.ApiException as error:
                    metrics.errors.labels("api").inc()
                    log.warning(
                        "reconcile of %s/%s failed: %s %s: %s; retrying",
                        namespace,
                        name,
                        error.status,
                        error.reason,
                        api_error_message(error),
                    )
                    delay = 1.0
                except Exception:
                    metrics.errors.labels("internal").inc()
                    log.exception("reconcile of %s/%s failed; retrying", namespace, name)
                    delay = 5.0
                try:
                    await asyncio.wait_for(wake.wait(), timeout=delay)
                except asyncio.TimeoutError:
                    pass
        finally:
            pokes.events.pop((namespace, name), None)

    @kopf.on.event(constants.GROUP, constants.VERSION, constants.PLURAL, registry=registry)
    async def job_changed(*, name: str, namespace: Optional[str], **_: Any) -> None:
        pokes.poke(_namespaced(namespace), name)

    @kopf.on.event("v1", "pods", labels={constants.LABEL_JOB_NAME: kopf.PRESENT}, registry=registry)
    async def pod_changed(*, labels: Mapping[str, str], namespace: Optional[str], **_: Any) -> None:
        pokes.poke(_namespaced(namespace), labels[constants.LABEL_JOB_NAME])

    @kopf.on.event("v1", "nodes", registry=registry)
    async def node_changed(**_: Any) -> None:
        pokes.poke_all()

    @kopf.on.probe(id="jobs", registry=registry)
    def jobs_probe(**_: Any) -> int:
        return len(pokes.events)


def configure(settings: kopf.OperatorSettings) -> None:
    """Operator settings shared by production and tests."""
    settings.posting.level = logging.WARNING  # our own Events carry the story; kopf posts only its problems
    settings.persistence.finalizer = f"{constants.GROUP}/operator"
    settings.watching.server_timeout = 300
