"""The tests' kubelet: Nodes whose Leases are renewed, and pods on them that run and terminate.

Nothing here runs containers. Each simulated node does what a kubelet does to the API: it registers its Node
(Ready, with allocatable resources), renews its Lease in ``kube-node-lease``, reports the pods the real
scheduler bound to it as Running and Ready, and confirms their deletion (graceful delete -> gone). A node
"loses power" by :meth:`Kubelets.power_off`: it stops all of that, and the real node-lifecycle controller
marks it NotReady/unreachable and evicts its pods, which then stay Terminating as in a real cluster.
"""

from __future__ import annotations

import contextlib
import datetime
import threading
import urllib.error
from typing import Any

from tests.cluster.controlplane import ControlPlane

RENEW_SECONDS = 2.0
SYNC_SECONDS = 0.3
LEASES = "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases"


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class PodAddresses:
    """Pod IPs for kubelets that run pods on this machine: a loopback address of its own per pod (127.64.0.0/10 is
    loopback on Linux), so that what listens on the pod's IP (the job agent's pulse) is reached there, and two pods
    never share an address."""

    def __init__(self) -> None:
        self._by_uid: dict[str, str] = {}
        self._lock = threading.Lock()

    def of(self, uid: str) -> str:
        with self._lock:
            if uid not in self._by_uid:
                n = len(self._by_uid) + 1
                self._by_uid[uid] = f"127.{64 + (n >> 16) % 64}.{(n >> 8) % 256}.{n % 256}"
            return self._by_uid[uid]


class Kubelets:
    """Simulated nodes of one test, driven by one background thread."""

    def __init__(self, plane: ControlPlane) -> None:
        self.plane = plane
        self.alive: set[str] = set()
        self.created: list[str] = []
        self.exit_codes: dict[str, int] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._pod_ips = PodAddresses()
        self.errors: list[str] = []
        self._thread = threading.Thread(target=self._run, name="kubelets", daemon=True)
        self._thread.start()
        # The Leases on a thread of their own, as a kubelet's node lease controller: starting a pod may wait for a
        # fork server's imports (tens of seconds on a loaded machine), longer than the node-monitor grace period.
        self._renewer = threading.Thread(target=self._renew, name="kubelets-leases", daemon=True)
        self._renewer.start()

    def pod_ip(self, pod: dict[str, Any]) -> str:
        return self._pod_ips.of(pod["metadata"]["uid"])

    # --- nodes -------------------------------------------------------------------------------------------

    def add_node(self, name: str, labels: dict[str, str] | None = None) -> None:
        stamp = _now()
        self.plane.request(
            "POST",
            "/api/v1/nodes",
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **(labels or {})}},
            },
        )
        self.plane.request(
            "PATCH",
            f"/api/v1/nodes/{name}/status",
            {
                "status": {
                    "capacity": {"cpu": "16", "memory": "64Gi", "pods": "110"},
                    "allocatable": {"cpu": "16", "memory": "64Gi", "pods": "110"},
                    "conditions": [
                        {
                            "type": "Ready",
                            "status": "True",
                            "reason": "KubeletReady",
                            "message": "simulated kubelet",
                            "lastHeartbeatTime": stamp[:19] + "Z",
                            "lastTransitionTime": stamp[:19] + "Z",
                        }
                    ],
                }
            },
            content_type="application/merge-patch+json",
        )
        self.plane.request(
            "POST",
            LEASES,
            {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": name},
                "spec": {"holderIdentity": name, "leaseDurationSeconds": 40, "renewTime": stamp},
            },
        )
        with self._lock:
            self.alive.add(name)
            self.created.append(name)

    def power_off(self, name: str) -> None:
        """The node stops renewing its Lease and its kubelet stops acting: nothing on it confirms anything."""
        with self._lock:
            self.alive.discard(name)

    def finish(self, pod: str, exit_code: int) -> None:
        """The pod's container exits with ``exit_code`` (reported at the next sync; a later pod of the same name
        runs normally)."""
        with self._lock:
            self.exit_codes[pod] = exit_code

    def stop(self) -> None:
        """Stop the loop and remove this test's Nodes, so the scheduler places no later test's pod on them."""
        self._stop.set()
        self._thread.join(timeout=10)
        self._renewer.join(timeout=10)
        for name in self.created:
            with contextlib.suppress(urllib.error.HTTPError):
                self.plane.request("DELETE", f"/api/v1/nodes/{name}")

    # --- the loop ----------------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                alive = set(self.alive)
                exits = dict(self.exit_codes)
            try:
                if alive:
                    self._sync_pods(alive, exits)
            except (urllib.error.URLError, OSError, ValueError) as error:  # the API server may be stopping
                self.errors.append(repr(error))
            self._stop.wait(SYNC_SECONDS)

    def _renew(self) -> None:
        while not self._stop.wait(RENEW_SECONDS):
            with self._lock:
                alive = set(self.alive)
            for name in alive:
                try:
                    self.plane.request(
                        "PATCH",
                        f"{LEASES}/{name}",
                        {"spec": {"renewTime": _now()}},
                        content_type="application/merge-patch+json",
                    )
                except (urllib.error.URLError, OSError, ValueError) as error:  # the API server may be stopping
                    self.errors.append(repr(error))

    def _sync_pods(self, alive: set[str], exits: dict[str, int]) -> None:
        pods = self.plane.request("GET", "/api/v1/pods")["items"]
        for pod in pods:
            node = pod["spec"].get("nodeName")
            if node not in alive:
                continue
            meta = pod["metadata"]
            path = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}"
            try:
                if meta.get("deletionTimestamp"):
                    self._delete_now(path, meta)
                elif meta["name"] in exits and pod["status"].get("phase") == "Running":
                    self._report(path, pod, exit_code=exits[meta["name"]])
                    with self._lock:  # once: a replacement that reuses the name runs on
                        self.exit_codes.pop(meta["name"], None)
                elif pod["status"].get("phase", "Pending") == "Pending":
                    self._report(path, pod, exit_code=None)
            except urllib.error.HTTPError as error:
                if error.code not in (404, 409):
                    raise
                error.close()  # it holds the answer's TLS socket (a ResourceWarning when collected later)

    def _delete_now(self, path: str, meta: dict[str, Any]) -> None:
        """Remove the pod at once, as a kubelet does once its containers are gone (and only that pod: its uid)."""
        self.plane.request(
            "DELETE",
            path,
            {
                "apiVersion": "v1",
                "kind": "DeleteOptions",
                "gracePeriodSeconds": 0,
                "preconditions": {"uid": meta["uid"]},
            },
        )

    def _report(self, path: str, pod: dict[str, Any], exit_code: int | None, ready_when_running: bool = True) -> None:
        stamp = _now()[:19] + "Z"
        containers = pod["spec"]["containers"]
        if exit_code is None:
            state: dict[str, Any] = {"running": {"startedAt": stamp}}
            phase, ready = "Running", "True" if ready_when_running else "False"
        else:
            state = {
                "terminated": {
                    "exitCode": exit_code,
                    "reason": "Completed" if exit_code == 0 else "Error",
                    "startedAt": stamp,
                    "finishedAt": stamp,
                }
            }
            phase, ready = ("Succeeded" if exit_code == 0 else "Failed"), "False"
        self.plane.request(
            "PATCH",
            path + "/status",
            {
                "status": {
                    "phase": phase,
                    "podIP": self.pod_ip(pod),
                    "startTime": stamp,
                    "conditions": [
                        {"type": "Ready", "status": ready, "lastTransitionTime": stamp},
                        {"type": "ContainersReady", "status": ready, "lastTransitionTime": stamp},
                        {"type": "PodScheduled", "status": "True", "lastTransitionTime": stamp},
                    ],
                    "containerStatuses": [
                        {
                            "name": c["name"],
                            "image": c["image"],
                            "imageID": "",
                            "ready": ready == "True",
                            "restartCount": 0,
                            "state": state,
                        }
                        for c in containers
                    ],
                }
            },
            content_type="application/strategic-merge-patch+json",
        )
