"""The operator's replicas "op-a" and "op-b" as processes with the chart's leader-election flags (shared by
tests/cluster/test_failover.py and bench/operator_failover.py)."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

from tests.cluster.controlplane import ControlPlane
from tests.cluster.operator_process import OperatorProcess
from tests.cluster.rbac import OPERATOR_NAMESPACE, OPERATOR_SERVICE_ACCOUNT, chart_operator_flags

ELECTION_FLAGS = chart_operator_flags(
    "--leader-election-lease",
    "--leader-election-namespace",
    "--leader-election-lease-seconds",
    "--leader-election-renew-deadline-seconds",
    "--leader-election-retry-seconds",
)
LEASE = next(flag.split("=", 1)[1] for flag in ELECTION_FLAGS if flag.startswith("--leader-election-lease="))
NAMES = ("op-a", "op-b")


class Replicas:
    """Two replicas as the chart's Deployment runs them (one pod each), under the chart's RBAC (installed by the
    caller)."""

    def __init__(self, plane: ControlPlane, log_dir: Path) -> None:
        self.plane = plane
        kubeconfig = plane.service_account_kubeconfig(OPERATOR_NAMESPACE, OPERATOR_SERVICE_ACCOUNT)
        self.by_name = {
            name: OperatorProcess(
                kubeconfig, log_dir / f"{name}.log", [*ELECTION_FLAGS, f"--leader-election-identity={name}"]
            )
            for name in NAMES
        }

    def lease(self) -> dict[str, Any]:
        path = f"/apis/coordination.k8s.io/v1/namespaces/{OPERATOR_NAMESPACE}/leases/{LEASE}"
        return dict(self.plane.request("GET", path)["spec"])

    def holder(self) -> str:
        try:
            return str(self.lease().get("holderIdentity") or "")
        except OSError:  # no Lease yet (urllib's HTTPError is an OSError)
            return ""

    def start(self, name: str) -> OperatorProcess:
        """Start ``name`` and wait until it is live (a standby answers the liveness probe too)."""
        replica = self.by_name[name]
        replica.start()
        return replica

    def other(self, name: str) -> str:
        return next(n for n in NAMES if n != name)

    def stop(self) -> list[str]:
        """Kill both; the lines of their logs that show a 403."""
        forbidden: list[str] = []
        for replica in self.by_name.values():
            replica.kill()
            forbidden += replica.forbidden_lines()
        return forbidden


def job_events(plane: ControlPlane, namespace: str, job: str) -> list[tuple[str, str]]:
    """The job's Events (reason, message) in the order they were written (etcd's revision)."""
    items = plane.request("GET", f"/api/v1/namespaces/{namespace}/events")["items"]
    ours = [e for e in items if e["involvedObject"].get("name") == job]
    ours.sort(key=lambda e: int(e["metadata"]["resourceVersion"]))
    return [(e["reason"], e["message"]) for e in ours]


def event_reporters(plane: ControlPlane, namespace: str, job: str) -> dict[str, set[str]]:
    """Each of the job's Event reasons and the operator replicas that reported it (``reportingInstance``)."""
    items = plane.request("GET", f"/api/v1/namespaces/{namespace}/events")["items"]
    reporters: dict[str, set[str]] = {}
    for event in items:
        if event["involvedObject"].get("name") == job:
            reporters.setdefault(event["reason"], set()).add(event.get("reportingInstance", ""))
    return reporters


def repeated_events(events: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Events written twice in a row: the same Event may come again for a new state (Scheduled after a
    replacement), never twice for one."""
    return [first for first, second in itertools.pairwise(events) if first == second]
