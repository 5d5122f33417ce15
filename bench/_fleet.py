"""The benchmark's cluster: N Nodes with kubelet heartbeats, and a kubelet-and-scheduler that runs every pod.

Lighter than ``tests/cluster/kubelet.py`` (which lists every pod three times a second, fine for a test and
ruinous for a count of API requests): one pod watch for the whole run binds each new disttrain pod to a node
(round robin, as a scheduler would spread them) and reports it Running and Ready; a pod being deleted is
confirmed gone, as a kubelet does. Heartbeats are what kubelets send: a Lease renewal every 10 s and a node
status report every 5 minutes (kubelet's ``nodeStatusReportFrequency`` when nothing changed), spread out.

Each pod gets a loopback address of its own as its IP, and each job agent pod's pulse (the port and period its pod
declares) is served there, as the agent would serve it (the agents themselves run in the benchmark's process, with
no address of their own), so the operator holds a pulse link to every agent as in a cluster.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import json
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

from kubernetes import client as k8s
from tests.cluster.kubelet import PodAddresses  # bench/api_load.py puts the repository on sys.path

from disttrain.api import constants, pulse
from disttrain.api import env as env_names
from disttrain.operator.access import LABEL_JOB_UID
from disttrain.trainer.agent.pulse import PulseServer

log = logging.getLogger("bench.fleet")
LEASE_RENEW_SECONDS = 10.0
NODE_STATUS_SECONDS = 300.0
KUBELET_LANES = 8
"""Pods acted on at once (bound, reported Running, confirmed gone): one lane per pod, so each pod's events stay in
order. Why more than one: one request at a time bound about 10 pods a second on the 2-core machine, and 20,000 pods
then took half an hour to start, where a cluster's scheduler and kubelets work in parallel."""
MERGE = "application/merge-patch+json"
TIMEOUT = 30


def _micro_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def stream_events(response: Any) -> Iterator[dict[str, Any]]:
    """Watch events (one JSON document per line) from an unread ``_preload_content=False`` response."""
    buffer = b""
    for chunk in response.stream(amt=None, decode_content=False):
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            if line.strip():
                yield json.loads(line)


class Fleet:
    """Nodes, their heartbeats, and the pods running on them; two background threads."""

    def __init__(self, api_client: k8s.ApiClient, operator_pulse_key: bytes = b"") -> None:
        """``operator_pulse_key``: the operator's ``--agent-pulse-key-file`` key, from which each job's pulse key
        (the one the operator puts in the job's Secret, which an agent reads) is derived."""
        self.core = k8s.CoreV1Api(api_client)
        self.operator_pulse_key = operator_pulse_key
        self.leases = k8s.CoordinationV1Api(api_client)
        self.nodes: list[str] = []
        self.running: set[tuple[str, str]] = set()
        self.errors: list[str] = []
        self._next_node = 0
        self._pod_ips = PodAddresses()
        self._pulses: dict[str, PulseServer] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._lanes = [
            concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"kubelet-{i}") for i in range(KUBELET_LANES)
        ]
        self._threads = [
            threading.Thread(target=self._heartbeats, name="heartbeats", daemon=True),
            threading.Thread(target=self._run_pods, name="kubelet", daemon=True),
        ]

    def add_nodes(self, count: int) -> None:
        for i in range(count):
            name = f"node-{i:04d}"
            self.core.create_node(
                {
                    "apiVersion": "v1",
                    "kind": "Node",
                    "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
                },
                _preload_content=False,
                _request_timeout=TIMEOUT,
            )
            self._report_node(name, first=True)
            self.leases.create_namespaced_lease(
                "kube-node-lease",
                {
                    "apiVersion": "coordination.k8s.io/v1",
                    "kind": "Lease",
                    "metadata": {"name": name},
                    "spec": {"holderIdentity": name, "leaseDurationSeconds": 40, "renewTime": _micro_now()},
                },
                _preload_content=False,
                _request_timeout=TIMEOUT,
            )
            self.nodes.append(name)

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            pulses, self._pulses = list(self._pulses.values()), {}
        for server in pulses:
            server.stop()
        for lane in self._lanes:
            lane.shutdown(wait=False, cancel_futures=True)

    def pulse_links(self) -> int:
        """Connections the agents' pulse servers hold now (the operator's links)."""
        with self._lock:
            return sum(server.clients for server in self._pulses.values())

    def _pod_ip(self, pod: dict[str, Any]) -> str:
        """The pod's IP (a loopback address of its own), where its agent's pulse is served if it declares one."""
        uid = pod["metadata"]["uid"]
        ip = self._pod_ips.of(uid)
        for container in pod["spec"]["containers"]:
            env = {e["name"]: e.get("value") for e in container.get("env") or []}
            ports = [p for p in container.get("ports") or [] if p.get("name") == constants.AGENT_PULSE_PORT_NAME]
            if ports and env.get(env_names.AGENT_PULSE_SECONDS) and uid not in self._pulses:
                job_uid = (pod["metadata"].get("labels") or {}).get(LABEL_JOB_UID, "")
                key = pulse.job_key(self.operator_pulse_key, job_uid)
                period = float(env[env_names.AGENT_PULSE_SECONDS])
                server = PulseServer(ip, ports[0]["containerPort"], uid, period, key)
                server.start()
                with self._lock:
                    self._pulses[uid] = server
        return ip

    def _forget_pod(self, pod: dict[str, Any]) -> None:
        with self._lock:
            server = self._pulses.pop(pod["metadata"]["uid"], None)
        if server is not None:
            server.stop()

    def _report_node(self, name: str, first: bool = False) -> None:
        stamp = _now()
        status: dict[str, Any] = {
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "KubeletReady",
                    "message": "simulated kubelet",
                    "lastHeartbeatTime": stamp,
                    **({"lastTransitionTime": stamp} if first else {}),
                }
            ]
        }
        if first:
            status.update(
                capacity={"cpu": "64", "memory": "256Gi", "pods": "110"},
                allocatable={"cpu": "64", "memory": "256Gi", "pods": "110"},
            )
        self.core.patch_node_status(
            name,
            {"status": status},
            _content_type="application/strategic-merge-patch+json",
            _preload_content=False,
            _request_timeout=TIMEOUT,
        )

    def _heartbeats(self) -> None:
        started = time.monotonic()
        renewed = 0.0
        count = max(1, len(self.nodes))
        status_due = [started + (i + 1) * NODE_STATUS_SECONDS / count for i in range(len(self.nodes))]  # spread
        while not self._stop.wait(1.0):
            now = time.monotonic()
            try:
                if now - renewed >= LEASE_RENEW_SECONDS:
                    renewed = now
                    for name in self.nodes:
                        self.leases.patch_namespaced_lease(
                            name,
                            "kube-node-lease",
                            {"spec": {"renewTime": _micro_now()}},
                            _content_type=MERGE,
                            _preload_content=False,
                            _request_timeout=TIMEOUT,
                        )
                for i, name in enumerate(self.nodes):
                    if status_due[i] <= now:
                        status_due[i] += NODE_STATUS_SECONDS
                        self._report_node(name)
            except Exception as error:  # noqa: BLE001 (the API server may be stopping; the loop goes on)
                self.errors.append(repr(error))

    def _run_pods(self) -> None:
        while not self._stop.is_set():
            try:
                response = self.core.list_pod_for_all_namespaces(
                    label_selector=constants.LABEL_JOB_NAME,
                    watch=True,
                    timeout_seconds=3600,
                    _preload_content=False,
                    _request_timeout=(10, 3700),
                )
                for event in stream_events(response):
                    if self._stop.is_set():
                        return
                    meta = event["object"]["metadata"]
                    lane = self._lanes[hash((meta["namespace"], meta["name"])) % len(self._lanes)]
                    if event["type"] in ("ADDED", "MODIFIED"):
                        lane.submit(self._act, event["object"])
                    elif event["type"] == "DELETED":
                        lane.submit(self.running.discard, (meta["namespace"], meta["name"]))
            except Exception as error:  # noqa: BLE001 (a broken watch: start another)
                self.errors.append(repr(error))
                time.sleep(1)

    def _act(self, pod: dict[str, Any]) -> None:
        meta, spec, status = pod["metadata"], pod["spec"], pod.get("status") or {}
        ns, name = meta["namespace"], meta["name"]
        try:
            if meta.get("deletionTimestamp"):
                self._forget_pod(pod)
                self.core.delete_namespaced_pod(
                    name, ns, grace_period_seconds=0, _preload_content=False, _request_timeout=TIMEOUT
                )
            elif not spec.get("nodeName"):
                with self._lock:
                    node = self.nodes[self._next_node % len(self.nodes)]
                    self._next_node += 1
                self.core.create_namespaced_pod_binding(
                    name,
                    ns,
                    {
                        "apiVersion": "v1",
                        "kind": "Binding",
                        "metadata": {"name": name},
                        "target": {"apiVersion": "v1", "kind": "Node", "name": node},
                    },
                    _preload_content=False,
                    _request_timeout=TIMEOUT,
                )
            elif status.get("phase", "Pending") == "Pending":
                self._report_running(ns, name, pod)
            elif status.get("phase") == "Running":
                self.running.add((ns, name))
        except k8s.ApiException as error:
            if error.status not in (404, 409):
                self.errors.append(f"{ns}/{name}: {error.status} {error.reason}")
        except Exception as error:  # noqa: BLE001 (a lane's failure is the run's to report, not the lane's end)
            self.errors.append(f"{ns}/{name}: {error!r}")

    def _report_running(self, ns: str, name: str, pod: dict[str, Any]) -> None:
        stamp = _now()
        self.core.patch_namespaced_pod_status(
            name,
            ns,
            {
                "status": {
                    "phase": "Running",
                    "podIP": self._pod_ip(pod),
                    "startTime": stamp,
                    "conditions": [
                        {"type": "Ready", "status": "True", "lastTransitionTime": stamp},
                        {"type": "ContainersReady", "status": "True", "lastTransitionTime": stamp},
                        {"type": "PodScheduled", "status": "True", "lastTransitionTime": stamp},
                    ],
                    "containerStatuses": [
                        {
                            "name": c["name"],
                            "image": c["image"],
                            "imageID": "",
                            "ready": True,
                            "restartCount": 0,
                            "state": {"running": {"startedAt": stamp}},
                        }
                        for c in pod["spec"]["containers"]
                    ],
                }
            },
            _content_type=MERGE,
            _preload_content=False,
            _request_timeout=TIMEOUT,
        )
