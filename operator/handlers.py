"""The kopf adapter: turns Kubernetes events into ``reconcile`` calls and ``Actions`` into API calls. Thin.

Reads come from watch caches, never from a request per reconcile: kopf watches our jobs, our pods (server-side
label selector) and the nodes, and the handlers below feed every event into :class:`caches.ClusterCache`,
waking only the jobs it concerns (a pod's job; for a node, the jobs with pods on it, and only when what policy
reads of the node changed). :mod:`disttrain.operator.listing` makes the caches complete before a namespace's
first reconcile and sweeps them after kopf re-listed a watch.

One asyncio task per DistTrainJob is its reconcile loop (not a kopf daemon, which would put a finalizer on the
job): it sleeps until its job is woken or the nearest timer the core computed (debounce, waits, backoff,
deadlines, TTL) expires, or after a failed API call for a backoff with jitter; it reconciles on the cached state, and
applies the actions in a crash-safe order: status first (the core's memory), then deletions, creations and
events. The answers to its writes go into the cache at once, so the next reconcile sees them whatever the
watch's delay. Killing the operator at any point loses nothing: the next one lists, reads the same status and
pods, and deterministic names turn a repeated create into 409 Conflict, which counts as created only when the
existing object's owner reference carries the job's uid (an older job of the same name holds it otherwise).

No policy lives here; an ``if`` about training belongs in the core.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import itertools
import json
import logging
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Optional

import kopf
from kubernetes import client as k8s

from disttrain.api import constants, storeauth, timestamps
from disttrain.api.spec import DistTrainJob
from disttrain.operator import (
    access,
    agentbeat,
    agentfields,
    diffbase,
    eventrate,
    listing,
    names,
    patches,
    pulses,
    retry,
    scheduling,
)
from disttrain.operator import pods as builders
from disttrain.operator.caches import ClusterCache, JobKey, is_owned_by, owner_uids
from disttrain.operator.metrics import OperatorMetrics
from disttrain.operator.observed import Actions, CreateFailure, PodView
from disttrain.operator.reconcile import reconcile

log = logging.getLogger("disttrain.operator")
MERGE_PATCH = "application/merge-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"  # a JSON body is YAML too
FIELD_MANAGER = "disttrain-operator"
"""The operator's name in ``metadata.managedFields`` of what it writes (without one the API server takes the client's
User-Agent, ``OpenAPI-Generator/...``, the same for the operator and every job agent)."""
API_CONCURRENCY = 32
"""API calls the adapter runs at once (its own threads; ``disttrain operator`` pools as many connections).

Why not asyncio's default executor: it has ``cpu_count + 4`` threads, 6 on a 2-core machine. At 500 jobs on a
loaded API server (status writes answered in 0.3 s to several seconds) all six were found waiting on a PATCH in
every sample, and every other write of every job, a scale request's directive included, queued behind them in
this process. With more threads a call waits in the API server, where the chart's FlowSchema gives the operator
a priority level of its own."""
REQUEST_TIMEOUT_S = 30.0
"""Client-side timeout of every API call the adapter makes."""
INTERNAL_ERROR_RETRY_S = 5.0
"""After a bug (not an API error, whose wait :mod:`disttrain.operator.retry` computes)."""
LOOP_STOP_TIMEOUT_S = 5.0
"""On operator shutdown, how long the job loops may take to finish their current reconcile before cancellation."""
PRUNE_LINKS_EVERY = 10
"""Every this many checks of the agents' silence (1 s), the pulse links of pods no longer an agent are closed."""
FINALIZER = f"{constants.GROUP}/operator"
"""The finalizer older operator releases put on every job; this one adds none and removes it where it finds it."""


class NameHeld(Exception):
    """A create answered 409 and the existing object of that name is not the job's (another owner uid, or none):
    an older job of the same name whose dependents the garbage collector is still deleting. Never adopted: the
    job waits and retries (its Created condition and an Event name the object)."""

    def __init__(self, kind: str, name: str, owners: frozenset[str]) -> None:
        self.kind = kind
        self.name = name
        self.owners = owners
        held = f"owned by uid {', '.join(sorted(owners))}" if owners else "not owned by this job"
        super().__init__(
            f"{kind} {name} already exists, {held} (an older job of the same name, still being deleted?); "
            "waiting for it to go"
        )


class Kube:
    """The few API calls the adapter makes, with the sync ``kubernetes`` client run in threads; each has a
    timeout, and each write returns the object the API server answered with (for the cache)."""

    def __init__(self, api_client: k8s.ApiClient) -> None:
        self.core = k8s.CoreV1Api(api_client)
        self.rbac = k8s.RbacAuthorizationV1Api(api_client)
        self.networking = k8s.NetworkingV1Api(api_client)
        self.coordination = k8s.CoordinationV1Api(api_client)
        self.custom = k8s.CustomObjectsApi(api_client)
        self._threads = concurrent.futures.ThreadPoolExecutor(API_CONCURRENCY, thread_name_prefix="kube-api")

    async def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> bytes:
        """The response body of one call, read in the API thread that made it.

        Why read there: with ``_preload_content=False`` the client returns the response unread and its connection
        stays checked out of the pool until the body is read. Read later on the event loop (or, for a delete, never),
        the thread's next call found no free connection and opened a new TLS connection, which the full pool then
        discarded ("Connection pool is full" about 45 times a run at 500 jobs), and the read blocked the loop."""
        call = functools.partial(fn, *args, _request_timeout=REQUEST_TIMEOUT_S, _preload_content=False, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._threads, self._read, call)

    @staticmethod
    def _read(call: Callable[[], Any]) -> bytes:
        response = call()
        try:
            return bytes(response.data or b"")
        finally:
            response.release_conn()

    @staticmethod
    def _body(data: bytes) -> dict[str, Any]:
        document = json.loads(data or b"{}")
        return document if isinstance(document, dict) else {}

    async def list_scope(self, scope: listing.Scope) -> list[dict[str, Any]]:
        """Every node, or our pods or the jobs of one namespace (the listings of :mod:`listing`)."""
        kind, namespace = scope
        if kind == listing.NODES:
            response = await self._call(self.core.list_node)
        elif kind == listing.PODS:
            response = await self._call(
                self.core.list_namespaced_pod, namespace, label_selector=constants.LABEL_JOB_NAME
            )
        else:
            response = await self._call(
                self.custom.list_namespaced_custom_object,
                constants.GROUP,
                constants.VERSION,
                namespace,
                constants.PLURAL,
            )
        return list(self._body(response).get("items") or [])

    async def patch_status(self, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        return self._body(
            await self._call(
                self.custom.patch_namespaced_custom_object_status,
                constants.GROUP,
                constants.VERSION,
                namespace,
                constants.PLURAL,
                name,
                {"status": patch},
                field_manager=FIELD_MANAGER,
                _content_type=MERGE_PATCH,
            )
        )

    async def apply_pod_group(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Create or update a PodGroup with one server-side apply (the operator owns every field it sets)."""
        group, version = obj["apiVersion"].split("/")
        meta = obj["metadata"]
        return self._body(
            await self._call(
                self.custom.patch_namespaced_custom_object,
                group,
                version,
                meta["namespace"],
                scheduling.POD_GROUP_PLURAL,
                meta["name"],
                obj,
                field_manager=FIELD_MANAGER,
                force=True,
                _content_type=APPLY_PATCH,
            )
        )

    async def create(self, obj: dict[str, Any]) -> Optional[dict[str, Any]]:
        """Create ``obj``; returns what was created. An existing one (409) is fine when it is ours (names are
        deterministic: a restarted operator creates again), that is when it shares an owner uid with ``obj``
        (:func:`~disttrain.operator.caches.is_owned_by`); returns None then. Raises :class:`NameHeld` when the
        existing one belongs to another owner (an Event, whose name is unique, and the store Secret, whose name
        holds the job's UID, are never checked)."""
        namespace = obj["metadata"]["namespace"]
        kind = obj["kind"]
        creators: dict[str, Callable[..., Any]] = {
            "Pod": self.core.create_namespaced_pod,
            "Service": self.core.create_namespaced_service,
            "ServiceAccount": self.core.create_namespaced_service_account,
            "Role": self.rbac.create_namespaced_role,
            "RoleBinding": self.rbac.create_namespaced_role_binding,
            "Secret": self.core.create_namespaced_secret,
            "NetworkPolicy": self.networking.create_namespaced_network_policy,
            "Lease": self.coordination.create_namespaced_lease,
            "Event": self.core.create_namespaced_event,
        }
        try:
            return self._body(await self._call(creators[kind], namespace, obj, field_manager=FIELD_MANAGER))
        except k8s.ApiException as error:
            if error.status != 409:
                raise
        wanted = owner_uids(obj)
        if kind in ("Event", "Secret") or not wanted:
            # An Event's name is unique. The store Secret's name carries the job's UID (names.store_secret_name),
            # so an existing one is ours; the operator may not read Secrets.
            return None
        existing = await self.read(kind, namespace, obj["metadata"]["name"])
        if existing is None or not any(is_owned_by(existing, uid) for uid in wanted):
            raise NameHeld(kind, obj["metadata"]["name"], owner_uids(existing or {}))
        return None

    async def read(self, kind: str, namespace: str, name: str) -> Optional[dict[str, Any]]:
        """GET one of the kinds :meth:`create` makes (to see whose it is after a 409); None when it is gone."""
        readers: dict[str, Callable[..., Any]] = {
            "Pod": self.core.read_namespaced_pod,
            "Service": self.core.read_namespaced_service,
            "ServiceAccount": self.core.read_namespaced_service_account,
            "Role": self.rbac.read_namespaced_role,
            "RoleBinding": self.rbac.read_namespaced_role_binding,
            "NetworkPolicy": self.networking.read_namespaced_network_policy,
            "Lease": self.coordination.read_namespaced_lease,
        }
        try:
            return self._body(await self._call(readers[kind], name, namespace))
        except k8s.ApiException as error:
            if error.status != 404:
                raise
        return None

    async def delete_pod(self, namespace: str, name: str, force: bool) -> Optional[dict[str, Any]]:
        """Delete a pod; returns it as the API server left it (Terminating), None when it was already gone."""
        try:
            answer = self._body(
                await self._call(
                    self.core.delete_namespaced_pod, name, namespace, grace_period_seconds=0 if force else None
                )
            )
        except k8s.ApiException as error:
            if error.status != 404:
                raise
            return None
        return answer if answer.get("kind") == "Pod" else None

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
            )
        except k8s.ApiException as error:
            if error.status != 404:
                raise


DEFAULT_INSTANCE = "disttrain-operator"
"""``reportingInstance`` of the Events of an operator not told its identity (``--leader-election-identity``)."""


def api_error_message(error: k8s.ApiException) -> str:
    """The API server's own sentence (which verb on which resource was refused), not just "403 Forbidden"."""
    try:
        return str(json.loads(error.body or "{}").get("message", "")) or str(error.body or "")
    except (TypeError, ValueError):
        return str(error.body or "")


def event_object(
    job: DistTrainJob, type_: str, reason: str, message: str, now: float, instance: str = DEFAULT_INSTANCE
) -> dict[str, Any]:
    """A core/v1 Event about the job (unique name: Events need no idempotency, a repeat is just a repeat), reported
    by ``instance``: the replica that acts, so that an Event says which operator posted it."""
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
        "reportingInstance": instance,
    }


Refusals = dict[JobKey, str]
"""The API server's answer to the last refused pod creation of each job (see :class:`Observed.refused`)."""


TRANSIENT_ADMISSION = ("error looking up service account",)
"""403 answers that go away by themselves within seconds: ServiceAccount admission refuses pods until the
controller has created the namespace's account (a new namespace, a fresh cluster)."""


def is_refusal(error: k8s.ApiException) -> bool:
    """An answer that retrying the same request will not change by itself: admission (Pod Security, quota,
    webhooks: 403, 422, 400); not a conflict (409), throttling (429), a server error, or a wait for the namespace's
    ServiceAccount (retried at once, like any failed API call)."""
    if error.status not in (400, 403, 422):
        return False
    return not any(sign in api_error_message(error) for sign in TRANSIENT_ADMISSION)


NAMESPACE_ENDING = "because it is being terminated"
"""The API server's 403 for anything created in a namespace being deleted."""


def is_namespace_ending(error: k8s.ApiException) -> bool:
    """The write was refused because its namespace is being deleted: the end of the job, not an RBAC fault."""
    return error.status == 403 and NAMESPACE_ENDING in api_error_message(error)


Failures = dict[JobKey, CreateFailure]
"""The failed creation of each job's last apply (see :class:`Observed.create_failure`)."""


def failure_message(error: k8s.ApiException) -> str:
    """``<status> <reason>: <the API server's sentence>``, for a condition and an Event."""
    return f"{error.status} {error.reason}: {api_error_message(error)}"


@dataclasses.dataclass
class Writer:
    """What every job's reconcile shares, built once per operator (:meth:`OperatorHandlers.writer`): the API, the
    watch caches, the metrics, the settings of the objects it creates, and what the last applies left for the next
    reconcile (refused pods, failed creations, the Event rate limits)."""

    kube: Kube
    cache: ClusterCache
    metrics: OperatorMetrics
    agent: builders.AgentSettings = builders.DEFAULT_AGENT
    """Every job agent's image, Lease and pulse (``--agent-*``)."""
    network: access.NetworkPolicySettings = access.DEFAULT_NETWORK
    refusals: Refusals = dataclasses.field(default_factory=dict)
    failures: Failures = dataclasses.field(default_factory=dict)
    events: Optional[eventrate.EventFilter] = None
    """Which Events go out (rate limits); None: every one."""
    beats: agentbeat.AgentBeats = dataclasses.field(default_factory=agentbeat.AgentBeats)
    """The job agents' Lease renewals and pulses, as the Lease watch and the pulse links delivered them."""
    instance: str = DEFAULT_INSTANCE
    """This replica's identity, the ``reportingInstance`` of its Events."""


async def _create(writer: Writer, job: DistTrainJob, obj: dict[str, Any]) -> Optional[dict[str, Any]]:
    """Create one of the job's objects; a failure is remembered for the next reconcile (which names it in the
    Created condition and an Event) and raised (the job's loop retries after a backoff)."""
    key = (job.metadata.namespace, job.metadata.name)
    failures = writer.failures
    try:
        return await writer.kube.create(obj)
    except NameHeld as held:
        failures[key] = CreateFailure(held.kind, held.name, str(held), held_by=",".join(sorted(held.owners)))
        raise
    except k8s.ApiException as error:
        failures[key] = CreateFailure(obj["kind"], obj["metadata"]["name"], failure_message(error))
        raise


REFUSED: dict[str, Any] = {}
"""What :func:`_create_pod` returns for a refused pod (compared by identity)."""


async def _create_pod(writer: Writer, job: DistTrainJob, pod: dict[str, Any]) -> Optional[dict[str, Any]]:
    """Create a pod. A refusal is not raised: it is remembered for the next reconcile, which names it in the
    status and an Event and retries the creation on its own timer; the rest of this apply (events) goes on.
    Any other failure is one of :func:`_create`'s."""
    key = (job.metadata.namespace, job.metadata.name)
    refusals, failures = writer.refusals, writer.failures
    try:
        created = await writer.kube.create(pod)
    except NameHeld as held:
        failures[key] = CreateFailure(held.kind, held.name, str(held), held_by=",".join(sorted(held.owners)))
        raise
    except k8s.ApiException as error:
        if not is_refusal(error):
            failures[key] = CreateFailure("Pod", pod["metadata"]["name"], failure_message(error))
            raise
        answer = api_error_message(error)
        if refusals.get(key) != answer:
            log.warning("the API server refused pod %s of %s/%s: %s", pod["metadata"]["name"], *key, answer)
        refusals[key] = answer
        return REFUSED
    refusals.pop(key, None)
    return created


async def apply(writer: Writer, job: DistTrainJob, actions: Actions, now: float) -> Optional[dict[str, Any]]:
    """Apply in crash-safe order: the PodGroup (idempotent, so before the status that records it), status
    (memory), then deletions, creations, events (those ``events`` admits), TTL deletion. What the API server
    answers goes into the cache. Returns the API server's answer to the status write (None: none).

    A failed creation (of any object) is remembered in ``writer.failures`` and raised: the rest waits for the
    retry. It holds the outcome of the last apply that reached its creations: cleared when they all went."""
    ns, name = job.metadata.namespace, job.metadata.name
    kube, cache = writer.kube, writer.cache
    seen = time.monotonic()
    answer: Optional[dict[str, Any]] = None
    pod_group_failed: Optional[k8s.ApiException] = None
    status_patch = dict(actions.status_patch)
    if actions.apply_pod_group:
        pod_group = builders.build_pod_group(job)
        if pod_group is not None:
            try:
                await kube.apply_pod_group(pod_group)
            except k8s.ApiException as error:
                writer.failures[(ns, name)] = CreateFailure(
                    "PodGroup", pod_group["metadata"]["name"], failure_message(error)
                )
                pod_group_failed = error
                status_patch.pop("podGroupMinMember", None)  # the status must not record a PodGroup that failed
    try:  # the events go out whatever failed: the one naming the previous failure is among them
        if status_patch:
            answer = await kube.patch_status(ns, name, status_patch)
            cache.put_job(answer, seen)
        if pod_group_failed is not None:
            raise pod_group_failed  # no pod of a gang before its PodGroup
        for deletion in actions.delete_pods:
            deleted = await kube.delete_pod(ns, deletion.name, deletion.force)
            if deleted is not None:
                cache.put_pod(deleted, time.monotonic())
        await _create_all(writer, job, actions)
    finally:
        await _post_events(writer, job, actions, now)
    if actions.delete_job:
        await kube.delete_job(ns, name)
    return answer


async def _create_all(writer: Writer, job: DistTrainJob, actions: Actions) -> None:
    """The agent with its Secret, Services, RBAC and NetworkPolicies, then the workers; the first failure raises."""
    ns, name = job.metadata.namespace, job.metadata.name
    if actions.create_agent:
        secret = access.build_store_secret(job, storeauth.new_secret(), writer.agent.job_pulse_key(job))
        await _create(writer, job, secret)  # 409: ours stays
        for obj in builders.build_support_objects(job, writer.network, writer.agent.heartbeat_s):
            await _create(writer, job, obj)
        created = await _create_pod(
            writer,
            job,
            builders.build_agent_pod(job, writer.agent, actions.agent_avoid_nodes),
        )
        _remember_pod(writer.cache, None if created is REFUSED else created)
    for worker in actions.create_workers:
        pod = builders.build_worker_pod(job, worker.node_index, name=worker.name, avoid_nodes=worker.avoid_nodes)
        created = await _create_pod(writer, job, pod)
        if created is REFUSED:
            break  # the next pods would be refused too: one answer per reconcile, retried on the core's timer
        _remember_pod(writer.cache, created)
    writer.failures.pop((ns, name), None)


async def _post_events(writer: Writer, job: DistTrainJob, actions: Actions, now: float) -> None:
    """Post the events ``writer.events`` admits (rate limits); best effort: a refused Event is logged, not raised."""
    ns, name = job.metadata.namespace, job.metadata.name
    events = writer.events
    for event in actions.events:
        if events is not None and not events.admit((ns, name, event.type, event.reason, event.message), now):
            continue
        try:
            await writer.kube.create(event_object(job, event.type, event.reason, event.message, now, writer.instance))
        except k8s.ApiException as error:  # events are best effort
            if is_namespace_ending(error):
                log.debug("job %s/%s: no events: its namespace is being deleted", ns, name)
                return
            log.warning("could not post event %s: %s", event.reason, error.reason)


def _remember_pod(cache: ClusterCache, created: Optional[dict[str, Any]]) -> None:
    if created is not None:
        cache.put_pod(created, time.monotonic())


async def reconcile_once(writer: Writer, namespace: str, name: str) -> Optional[Reconciled]:
    """Decide on the cached state and write. Returns the actions (None when the job is gone)."""
    started = time.perf_counter()
    cache, metrics = writer.cache, writer.metrics
    raw = cache.job(namespace, name)
    if raw is None:
        return None
    raw = agentfields.sanitized_job(raw, namespace, name)
    meta = dict(raw.get("metadata") or {})
    meta.setdefault("namespace", namespace)
    job = DistTrainJob.model_validate(
        {**{k: v for k, v in raw.items() if k in ("apiVersion", "kind", "spec", "status")}, "metadata": meta}
    )
    seen = cache.observe(namespace, name, job.metadata.uid)
    observed = dataclasses.replace(
        seen,
        refused=writer.refusals.get((namespace, name)),
        create_failure=writer.failures.get((namespace, name)),
        agent_silence=writer.beats.silence((namespace, name), seen.agent, time.monotonic()),
    )
    now = time.time()
    actions = reconcile(job, observed, now)
    answer = await apply(writer, job, actions, now)
    metrics.reconcile_duration.observe(time.perf_counter() - started)
    policy = job.spec.restart_policy
    metrics.observe_job(
        namespace,
        name,
        actions.status,
        now,
        max_restarts=policy.max_restarts,
        max_infrastructure_losses_per_hour=policy.max_infrastructure_losses_per_hour,
        uid=job.metadata.uid,
    )
    return Reconciled(actions, others_wrote=answer is not None and changed_by_others(raw, actions.status_patch, answer))


@dataclasses.dataclass(frozen=True)
class Reconciled:
    actions: Actions
    others_wrote: bool
    """The answer to our status write carried a change made by someone else (a spec edit, an agent report)."""


def changed_by_others(
    reconciled_on: Mapping[str, Any], status_patch: Mapping[str, Any], answer: Mapping[str, Any]
) -> bool:
    """Whether the API server's answer to our status patch differs from what we reconciled on plus our patch.

    Why: that answer goes into the cache, and it may already hold a change another writer made just before our
    patch (a user's ``suspend: false``, a ``/scale``, an agent report). The watch event of that change then comes
    with an older resourceVersion than the cache holds and is dropped, so nothing else would wake the job: the
    loop would sleep on a state it never decided on. A false alarm (a field the server normalises) costs one
    reconcile that writes nothing.
    """
    expected = patches.apply_merge_patch(_comparable(reconciled_on), {"status": dict(status_patch)})
    return bool(_comparable(answer) != expected)


def _comparable(obj: Mapping[str, Any]) -> dict[str, Any]:
    """The object without what changes on every write (resourceVersion, managedFields)."""
    meta = {k: v for k, v in (obj.get("metadata") or {}).items() if k not in ("resourceVersion", "managedFields")}
    return {**{k: v for k, v in obj.items() if k != "metadata"}, "metadata": meta}


class Pokes:
    """One asyncio.Event per job: a change the job's loop should look at."""

    def __init__(self) -> None:
        self.events: dict[JobKey, asyncio.Event] = {}

    def get(self, namespace: str, name: str) -> asyncio.Event:
        return self.events.setdefault((namespace, name), asyncio.Event())

    def poke(self, namespace: str, name: str) -> None:
        event = self.events.get((namespace, name))
        if event is not None:
            event.set()

    def poke_jobs(self, jobs: Iterable[JobKey]) -> None:
        for namespace, name in jobs:
            self.poke(namespace, name)


def _namespaced(namespace: Optional[str]) -> str:
    """kopf types ``namespace`` as optional for cluster-scoped kinds; DistTrainJobs and Pods always have one."""
    if namespace is None:
        raise kopf.PermanentError("a DistTrainJob or Pod without a namespace")
    return namespace


async def _sleep(wake: asyncio.Event, stopped: asyncio.Event, timeout: Optional[float]) -> None:
    """Until the job is woken, its loop is stopped, or ``timeout`` seconds (None: no timer) passed."""
    waiters = {asyncio.ensure_future(wake.wait()), asyncio.ensure_future(stopped.wait())}
    try:
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()


class OperatorHandlers:
    """The operator's state and its kopf handlers: the watch caches they feed, each job's reconcile loop, and the
    check that wakes the jobs whose agent fell silent. :func:`register` binds the handlers to a kopf registry.

    ``agent``: the job agents' image, Lease and pulse (``--agent-image``, ``--agent-heartbeat-seconds``,
    ``--agent-pulse-seconds``); ``network``: the per-job NetworkPolicies' settings (``--network-policy`` and the
    scraper's and the operator's selectors)."""

    def __init__(
        self,
        api_client_factory: Callable[[], k8s.ApiClient],
        metrics: OperatorMetrics,
        agent: builders.AgentSettings = builders.DEFAULT_AGENT,
        network: access.NetworkPolicySettings = access.DEFAULT_NETWORK,
        instance: str = DEFAULT_INSTANCE,
    ) -> None:
        self.api_client_factory = api_client_factory
        self.metrics = metrics
        self.agent = agent
        self.network = network
        self.instance = instance
        self.pokes = Pokes()
        self.cache = ClusterCache()
        self.refusals: Refusals = {}
        self.failures: Failures = {}
        self.events = eventrate.EventFilter()
        self.beats = agentbeat.AgentBeats(agent.heartbeat_s or constants.AGENT_LEASE_RENEW_SECONDS)
        self.links = pulses.PulseLinks(self.beats, agent.pulse_key)
        self.listings = listing.Listings(self.cache, self.list_scope, self.pokes.poke_jobs)
        self.loops: dict[JobKey, tuple[asyncio.Task[None], asyncio.Event]] = {}
        """Each job's reconcile loop and the event that stops it. Our own tasks, not kopf daemons: kopf puts a
        finalizer on every object that has a daemon, and a finalizer makes deleting a job wait for the operator
        (hung while it was down). Nothing needs one: the children go by their owner references, metrics series by
        the DELETED watch event, a loop by :meth:`stop_loop`."""
        self.checker: Optional[asyncio.Task[None]] = None
        """The task of :meth:`wake_silent_agents`, started with the first agent pod or Lease seen."""
        self._writer: Optional[Writer] = None

    def writer(self) -> Writer:
        """Built at the first reconcile, with the API client: not at registration."""
        if self._writer is None:
            self._writer = Writer(
                Kube(self.api_client_factory()),
                self.cache,
                self.metrics,
                agent=self.agent,
                network=self.network,
                refusals=self.refusals,
                failures=self.failures,
                events=self.events,
                beats=self.beats,
                instance=self.instance,
            )
        return self._writer

    async def list_scope(self, scope: listing.Scope) -> list[dict[str, Any]]:
        return await self.writer().kube.list_scope(scope)

    # -- each job's reconcile loop ---------------------------------------------------------------------------------

    def start_loop(self, namespace: str, name: str) -> None:
        """Start the job's loop unless one runs (a job seen first, or again after the operator's start)."""
        key = (namespace, name)
        if key in self.loops and not self.loops[key][0].done():
            return
        stop = asyncio.Event()
        self.pokes.events[key] = asyncio.Event()  # its own: a loop of an older job of this name may still be ending
        task = asyncio.create_task(self.job_loop(namespace, name, stop), name=f"reconcile {namespace}/{name}")
        self.loops[key] = (task, stop)

    def stop_loop(self, namespace: str, name: str) -> None:
        """Stop the job's loop (the job is gone or being deleted); it ends after its current reconcile."""
        entry = self.loops.pop((namespace, name), None)
        if entry is not None:
            entry[1].set()

    async def job_loop(self, namespace: str, name: str, stopped: asyncio.Event) -> None:
        """The job's reconcile loop (started on the job's first watch event, also after an operator start)."""
        key = (namespace, name)
        wake = self.pokes.get(namespace, name)
        try:
            await self._reconcile_until_stopped(key, wake, stopped)
        finally:
            if self.pokes.events.get(key) is wake:  # not yet replaced by the loop of a new job of the same name
                del self.pokes.events[key]
                self.refusals.pop(key, None)
                self.failures.pop(key, None)
            if self.cache.job(namespace, name) is None:
                self.metrics.forget_job(namespace, name)

    async def _reconcile_until_stopped(self, key: JobKey, wake: asyncio.Event, stopped: asyncio.Event) -> None:
        namespace, name = key
        backoff = retry.Backoff()
        while not stopped.is_set():
            wake.clear()
            delay: Optional[float]
            try:
                await self.listings.ensure_synced(namespace)
                refused, failed = self.refusals.get(key), self.failures.get(key)
                result = await reconcile_once(self.writer(), namespace, name)
                if result is None:
                    return
                backoff.succeeded()
                requeue = result.actions.requeue_after
                delay = None if requeue is None else max(0.05, requeue)
                acted = result.actions.create_agent or result.actions.create_workers or result.actions.delete_pods
                if result.others_wrote or acted:
                    # The cache holds a change no watch event will announce: the answers to our own writes
                    # (the pods' watch events come with the same versions and change nothing). The next
                    # reconcile counts them in the status (it writes nothing when nothing changed).
                    wake.set()
                if self.refusals.get(key) != refused or self.failures.get(key) != failed:
                    delay = 0.05  # a new refusal or failure (or its end): the status says so at once
            except NameHeld as held:
                delay = backoff.failed(None, None, time.time())
                log.info("job %s/%s waits: %s; retrying in %.1f s", namespace, name, held, delay)
            except k8s.ApiException as error:
                self.metrics.errors.labels("api").inc()
                delay = backoff.failed(error.status, error.headers, time.time())
                log.log(
                    logging.DEBUG if is_namespace_ending(error) else logging.WARNING,
                    "reconcile of %s/%s failed: %s %s: %s; retrying in %.1f s",
                    namespace,
                    name,
                    error.status,
                    error.reason,
                    api_error_message(error),
                    delay,
                )
            except Exception:
                self.metrics.errors.labels("internal").inc()
                log.exception("reconcile of %s/%s failed; retrying", namespace, name)
                delay = INTERNAL_ERROR_RETRY_S
            await _sleep(wake, stopped, delay)

    # -- the watch sinks (WATCH_SINKS): every event into the caches, waking only the jobs it concerns --------------

    async def job_changed(
        self, *, type: Optional[str], body: kopf.Body, name: str, namespace: Optional[str], **_: Any
    ) -> None:
        namespace = _namespaced(namespace)
        now = time.monotonic()
        if type is None:
            self.listings.relisted(listing.JOBS, namespace)
        deleting = type == "DELETED" or bool(body.get("metadata", {}).get("deletionTimestamp"))
        if deleting:
            self.metrics.forget_job(namespace, name, body.get("metadata", {}).get("uid"))  # deleting: no series
        if type == "DELETED":
            self.cache.remove_job(body, now)
            self.events.forget_job(namespace, name)
            self.beats.forget_job((namespace, name))
            self.pokes.poke(namespace, name)
        elif self.cache.put_job(patches.copy_json(dict(body)), now) is not None:
            self.pokes.poke(namespace, name)
        if deleting:
            self.stop_loop(namespace, name)
        else:
            self.start_loop(namespace, name)

    async def pod_changed(self, *, type: Optional[str], body: kopf.Body, namespace: Optional[str], **_: Any) -> None:
        namespace = _namespaced(namespace)
        now = time.monotonic()
        if type is None:
            self.listings.relisted(listing.PODS, namespace)
        key = self.cache.remove_pod(body, now) if type == "DELETED" else self.cache.put_pod(body, now)
        if key is not None:
            self.pokes.poke(*key)
        labels = body.get("metadata", {}).get("labels") or {}
        if labels.get(constants.LABEL_ROLE) == constants.ROLE_AGENT:
            job_key = (namespace, str(labels.get(constants.LABEL_JOB_NAME)))
            if type == "DELETED":
                self.links.forget(str(body.get("metadata", {}).get("uid") or ""))
            else:
                self.links.follow(job_key, body)
            self.start_checker()

    async def lease_changed(self, *, type: Optional[str], body: kopf.Body, namespace: Optional[str], **_: Any) -> None:
        job = (body.get("metadata", {}).get("labels") or {}).get(constants.LABEL_JOB_NAME)
        if not job:
            return
        key = (_namespaced(namespace), str(job))
        if type == "DELETED":
            self.beats.forget(key)
        else:
            self.beats.renewed(key, body, time.monotonic())
        self.start_checker()

    async def node_changed(self, *, type: Optional[str], body: kopf.Body, **_: Any) -> None:
        now = time.monotonic()
        if type is None:
            self.listings.relisted(listing.NODES, None)
        self.pokes.poke_jobs(self.cache.remove_node(body, now) if type == "DELETED" else self.cache.put_node(body, now))

    # -- the agents' silence ---------------------------------------------------------------------------------------

    def agent_of(self, key: JobKey) -> Optional[PodView]:
        record = self.cache.pods.get((key[0], names.agent_name(key[1])))
        return None if record is None else record.view

    def agent_uid(self, key: JobKey) -> Optional[str]:
        agent = self.agent_of(key)
        return None if agent is None else agent.uid

    async def wake_silent_agents(self) -> None:
        """A silent agent brings no watch event: look on a timer and wake its job (it replaces the agent)."""
        for tick in itertools.count():
            await asyncio.sleep(agentbeat.CHECK_S)
            now = time.monotonic()
            self.beats.checked(now)
            if tick % PRUNE_LINKS_EVERY == 0:
                self.links.prune(self.agent_uid)
            for key, uid in self.beats.to_probe(now):
                self.links.probe(key, uid, now)
            for (namespace, name), why in self.beats.newly_silent(self.agent_of, now):
                self.agent_silent(namespace, name, why)

    def agent_silent(self, namespace: str, name: str, why: str) -> None:
        """Wake the job whose agent fell silent (it replaces the agent). Said as a warning unless the job is being
        deleted (its namespace, say): then its agent's end is expected."""
        job = self.cache.job(namespace, name)
        ending = job is None or bool(job.get("metadata", {}).get("deletionTimestamp"))
        level = logging.DEBUG if ending else logging.WARNING
        log.log(level, "job %s/%s: its agent is taken for lost: %s", namespace, name, why)
        self.pokes.poke(namespace, name)

    def start_checker(self) -> None:
        if self.checker is None or self.checker.done():
            self.checker = asyncio.create_task(self.wake_silent_agents(), name="agent beats")

    # -- the operator's end and its probe --------------------------------------------------------------------------

    async def stop_sweeps(self, **_: Any) -> None:
        await self.listings.close()
        await self.links.close()
        if self.checker is not None:
            self.checker.cancel()
        running = [task for task, _stop in self.loops.values()]
        for namespace, name in list(self.loops):
            self.stop_loop(namespace, name)
        if running:
            _done, pending = await asyncio.wait(running, timeout=LOOP_STOP_TIMEOUT_S)
            for task in pending:
                task.cancel()

    def jobs_probe(self, **_: Any) -> int:
        return len(self.pokes.events)


def register(registry: kopf.OperatorRegistry, handlers: OperatorHandlers) -> None:
    """Bind ``handlers`` on ``registry`` (a fresh one in tests, kopf's default one in ``disttrain operator``). Only
    event, cleanup and probe handlers: none makes kopf put a finalizer on a job."""
    ours = {constants.LABEL_JOB_NAME: kopf.PRESENT}
    kopf.on.event(constants.GROUP, constants.VERSION, constants.PLURAL, registry=registry)(handlers.job_changed)
    kopf.on.event("v1", "pods", labels=ours, registry=registry)(handlers.pod_changed)
    kopf.on.event("coordination.k8s.io", "v1", "leases", labels=ours, registry=registry)(handlers.lease_changed)
    kopf.on.event("v1", "nodes", registry=registry)(handlers.node_changed)
    kopf.on.cleanup(registry=registry)(handlers.stop_sweeps)
    kopf.on.probe(id="jobs", registry=registry)(handlers.jobs_probe)


WATCH_SINKS = ("job_changed", "pod_changed", "node_changed", "lease_changed")
"""The event handlers that only feed the caches: one call per watch event of every job, pod and node."""


class QuietWatchSinks(logging.Filter):
    """Drops kopf's ``Handler '...job_changed' succeeded.`` line, which kopf logs at INFO for every watch event.

    Why: at 500 running jobs that is about 55 lines a second (the agents' progress writes alone), nearly all of
    the operator's log, and each costs formatting and a write on the event loop. Their failures still show.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.endswith(" succeeded.") and any(f".{sink}'" in message for sink in WATCH_SINKS))


def configure(settings: kopf.OperatorSettings) -> None:
    """Operator settings shared by production and tests."""
    settings.posting.level = logging.WARNING  # our own Events carry the story; kopf posts only its problems
    objects_log = logging.getLogger("kopf.objects")
    if not any(isinstance(f, QuietWatchSinks) for f in objects_log.filters):
        objects_log.addFilter(QuietWatchSinks())
    # No handler requires a finalizer (the job loops are our own tasks, see ``OperatorHandlers.loops``); kopf still
    # needs the name to recognise and remove the one older versions added, so deleting such a job waits for nothing.
    settings.persistence.finalizer = FINALIZER
    settings.persistence.diffbase_storage = diffbase.LeanDiffBaseStorage()
    settings.watching.server_timeout = 300
    # Watch only our pods (server-side): the rest of the cluster's pods never reach the operator.
    settings.watching.label_selectors["v1", "pods"] = constants.LABEL_JOB_NAME
    settings.watching.label_selectors["coordination.k8s.io", "leases"] = constants.LABEL_JOB_NAME
