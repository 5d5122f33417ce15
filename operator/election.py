"""One acting operator among replicas: leader election on a Lease, and the fence that stops a leader in time.

A standby waits in :meth:`Elector.acquire` before kopf starts at all, so it watches, caches and writes nothing.
The leader renews the Lease every ``retry_s``; a watchdog thread ends the process (``os._exit``, exit code
:data:`EXIT_LOST`) as soon as ``renew_deadline_s`` passed since the last renewal that succeeded, and every write of
the adapter is refused once that deadline passed (:class:`FencedApiClient`), even before the watchdog runs (a
process that was paused, say). Kubernetes restarts the container, which comes back as a standby. The rules and
why they stop a leader before a standby may take its Lease: :mod:`disttrain.operator.leaderlease`.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import urllib.parse
from collections.abc import Callable
from typing import Any, Optional

from kubernetes import client as k8s
from prometheus_client import REGISTRY, CollectorRegistry, Gauge

from disttrain.common import httpserver
from disttrain.operator import leaderlease
from disttrain.operator.leaderlease import ElectionOptions

log = logging.getLogger("disttrain.operator.election")
EXIT_LOST = 3
"""The exit code of a leader that could not renew its Lease in time."""
READS = frozenset({"GET", "HEAD", "OPTIONS"})


def leader_gauge(registry: CollectorRegistry = REGISTRY) -> Gauge:
    return Gauge("disttrain_operator_leader", "1 while this operator replica holds the leader Lease", registry=registry)


class NotLeader(RuntimeError):
    """A write refused because this process no longer holds the Lease."""


class Elector:
    """The Lease's side of one operator process: wait for it, keep it, or stop the process."""

    def __init__(
        self,
        api_client: k8s.ApiClient,
        options: ElectionOptions,
        gauge: Optional[Gauge] = None,
        on_lost: Optional[Callable[[], None]] = None,
    ) -> None:
        self.options = options
        self.api: Any = k8s.CoordinationV1Api(api_client)  # raw responses (_preload_content=False): untyped
        self.gauge = gauge
        self.on_lost = on_lost or self._exit
        self.renewed_at: Optional[float] = None
        """Monotonic time at which the last successful renewal (or the takeover) was sent."""
        self._version = ""
        self._spec: dict[str, Any] = {}
        self._stop = threading.Event()
        self._lost = threading.Lock()
        self._renewer: Optional[threading.Thread] = None
        if gauge is not None:
            gauge.set(0)

    # -- reads and writes of the Lease --------------------------------------------------------------------------
    def _read(self) -> Optional[dict[str, Any]]:
        o = self.options
        try:
            response = self.api.read_namespaced_lease(
                o.name, o.namespace, _preload_content=False, _request_timeout=o.timing.renew_deadline_s
            )
        except k8s.ApiException as error:
            if error.status == 404:
                return None
            raise
        return dict(json.loads(response.data))

    def _write(self, lease: Optional[dict[str, Any]], spec: dict[str, Any]) -> None:
        """Create the Lease, or replace it at the version read (409 when anyone wrote it since)."""
        o = self.options
        body: dict[str, Any] = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": o.name, "namespace": o.namespace},
            "spec": spec,
        }
        timeout = o.timing.renew_deadline_s
        if lease is None:
            call = self.api.create_namespaced_lease(o.namespace, body, _preload_content=False, _request_timeout=timeout)
        else:
            body["metadata"] = {**body["metadata"], "resourceVersion": lease["metadata"]["resourceVersion"]}
            call = self.api.replace_namespaced_lease(
                o.name, o.namespace, body, _preload_content=False, _request_timeout=timeout
            )
        answer = json.loads(call.data)
        self._version = answer["metadata"]["resourceVersion"]
        self._spec = dict(answer.get("spec") or {})

    # -- standby ------------------------------------------------------------------------------------------------
    def acquire(self) -> None:
        """Block until this process holds the Lease (a standby looks every ``retry_s``)."""
        o = self.options
        sighting: Optional[leaderlease.Sighting] = None
        announced = ""
        while True:
            sent = time.monotonic()
            try:
                lease = self._read()
                spec = dict((lease or {}).get("spec") or {})
                # seen when the answer came, not when the GET was sent: a renewal applied meanwhile was sent later
                sighting = leaderlease.observe(sighting, spec, time.monotonic())
                if lease is None or leaderlease.may_take(sighting, o.identity, time.monotonic(), o.timing):
                    self._write(lease, leaderlease.claimed(spec, o.identity, time.time(), o.timing))
                    self.renewed_at = sent
                    break
                if sighting.holder != announced:
                    log.info("standby: the Lease %s/%s is held by %s", o.namespace, o.name, sighting.holder)
                    announced = sighting.holder
            except k8s.ApiException as error:
                if error.status != 409:  # 409: another standby wrote first; look again
                    log.warning("leader election: %s %s", error.status, error.reason)
            except Exception as error:  # noqa: BLE001 (urllib3's timeouts and refused connections: look again)
                log.warning("leader election: %r", error)
            time.sleep(o.timing.retry_s)
        if self.gauge is not None:
            self.gauge.set(1)
        log.info(
            "leader: %s holds the Lease %s/%s (transition %s)",
            o.identity,
            o.namespace,
            o.name,
            self._spec.get("leaseTransitions"),
        )

    # -- leader ---------------------------------------------------------------------------------------------------
    def holds(self) -> bool:
        return leaderlease.leading(self.renewed_at, time.monotonic(), self.options.timing)

    def check(self) -> None:
        """Raise :class:`NotLeader` (and stop the process) once the renew deadline passed."""
        if not self.holds():
            self._lose("the renew deadline passed before a write")
            raise NotLeader(f"{self.options.identity} no longer holds the Lease {self.options.name}")

    def keep(self) -> None:
        """Start renewing in the background, with a watchdog that stops the process at the renew deadline."""
        self._renewer = threading.Thread(target=self._renew_loop, name="lease-renew", daemon=True)
        self._renewer.start()
        threading.Thread(target=self._watchdog, name="lease-watchdog", daemon=True).start()

    def _renew(self) -> None:
        o = self.options
        sent = time.monotonic()
        lease = {"metadata": {"resourceVersion": self._version}}
        try:
            self._write(lease, leaderlease.claimed(self._spec, o.identity, time.time(), o.timing))
        except k8s.ApiException as error:
            if error.status != 409:
                raise
            current = self._read()  # written by someone else since our last renewal: still ours?
            spec = dict((current or {}).get("spec") or {})
            if current is None or leaderlease.holder(spec) != o.identity:
                self._lose(f"the Lease is now held by {leaderlease.holder(spec) or 'nobody'}")
                return
            self._write(current, leaderlease.claimed(spec, o.identity, time.time(), o.timing))
        self.renewed_at = sent

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.options.timing.retry_s):
            try:
                self._renew()
            except Exception as error:  # noqa: BLE001 (any failure: retry; the watchdog keeps the deadline)
                log.warning("leader: renewing the Lease failed: %r", error)

    def _watchdog(self) -> None:
        timing = self.options.timing
        while not self._stop.is_set():
            renewed_at = self.renewed_at or 0.0
            left = renewed_at + timing.renew_deadline_s - time.monotonic()
            if left <= 0 and self.renewed_at == renewed_at:
                self._lose(f"no renewal succeeded for {timing.renew_deadline_s:g} s")
                return
            self._stop.wait(max(left, 0.01))

    def _lose(self, why: str) -> None:
        if not self._lost.acquire(blocking=False):
            return
        self._stop.set()
        if self.gauge is not None:
            self.gauge.set(0)
        log.error("leader: %s: %s stops acting (exit %d)", why, self.options.identity, EXIT_LOST)
        self.on_lost()

    @staticmethod
    def _exit() -> None:
        logging.shutdown()
        os._exit(EXIT_LOST)

    def release(self) -> None:
        """On a graceful stop (kopf has stopped every handler): leave the Lease to a standby at once.

        The renewal in flight, if any, finishes first: its write would otherwise move the Lease's version under the
        release, which the API server then refuses (409). A 409 all the same is looked into: still ours, released at
        the version read."""
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join(timeout=self.options.timing.renew_deadline_s)
        if not self.holds():
            return
        lease: Optional[dict[str, Any]] = {"metadata": {"resourceVersion": self._version}}
        spec = self._spec
        try:
            for _attempt in range(3):
                try:
                    self._write(lease, leaderlease.released(spec))
                    log.info("leader: released the Lease %s/%s", self.options.namespace, self.options.name)
                    break
                except k8s.ApiException as error:
                    if error.status != 409:
                        raise
                    lease = self._read()
                    spec = dict((lease or {}).get("spec") or {})
                    if lease is None or leaderlease.holder(spec) != self.options.identity:
                        break  # taken meanwhile: nothing of ours to leave
        except Exception as error:  # noqa: BLE001 (a standby then takes it a lease later)
            log.warning("leader: releasing the Lease failed: %r", error)
        if self.gauge is not None:
            self.gauge.set(0)


class FencedApiClient(k8s.ApiClient):
    """The adapter's API client: every write first checks that this process still holds the Lease."""

    def __init__(self, configuration: k8s.Configuration, elector: Elector) -> None:
        super().__init__(configuration)
        self.elector = elector

    def call_api(self, method: str, url: str, *args: Any, **kwargs: Any) -> Any:
        if method.upper() not in READS:
            self.elector.check()
        return super().call_api(method, url, *args, **kwargs)


class StandbyHealth:
    """Answers the liveness probe's URL with 200 while this process waits as a standby (kopf serves it once it
    leads), so that the kubelet does not restart a healthy standby."""

    def __init__(self, url: str) -> None:
        parsed = urllib.parse.urlsplit(url)
        path = parsed.path or "/"

        def answer(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
            ok = environ.get("PATH_INFO", "") == path
            start_response("200 OK" if ok else "404 Not Found", [("Content-Type", "application/json")])
            return [b'{"standby": true}' if ok else b"{}"]

        # bounded like the metrics port: a stranger's slow connections cost no thread and cannot lock the kubelet out
        self.server = httpserver.BoundedHttpServer((parsed.hostname or "0.0.0.0", parsed.port or 80), answer)
        threading.Thread(target=self.server.serve_forever, name="standby-health", daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
