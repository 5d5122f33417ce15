"""What belongs to a job is what its owner references say, on a real control plane.

A job deleted and applied again under the same name gets a new uid, while the old job's pods (held Terminating
here by a test finalizer, as a slow kubelet would) still match its label and deterministic names, and an object
of one of its names may belong to someone else. The operator counts neither, adopts neither, and waits. And with
no finalizer on jobs, deleting one while the operator is down completes: the garbage collector removes the rest.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.harness import Cluster, _try, checkpoint_claim, eventually
from tests.cluster.kubelet import Kubelets
from tests.conftest import JobBuilder

pytestmark = [pytest.mark.usefixtures("crd"), pytest.mark.timeout(240)]
HOLD = "disttrain.test/hold"
"""A finalizer of the test's: the pod stays Terminating until the test removes it (a kubelet that is slow to
confirm the kill, or a long grace period)."""


@pytest.fixture
def cluster(controllers, namespace, operator) -> Iterator[Cluster]:
    checkpoint_claim(controllers, namespace, Path(f"/tmp/pv-{namespace}"))
    kubelets = Kubelets(controllers)
    try:
        yield Cluster(controllers, namespace, kubelets)
    finally:
        kubelets.stop()


def _pod_path(cluster: Cluster, name: str) -> str:
    return f"/api/v1/namespaces/{cluster.ns}/pods/{name}"


def _owner_uids(obj: dict[str, Any]) -> set[str]:
    return {ref["uid"] for ref in obj["metadata"].get("ownerReferences") or []}


def _condition(status: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions") or [] if c["type"] == type_), {})


def _job_pods(cluster: Cluster) -> dict[str, dict[str, Any]]:
    return {**cluster.pods(), **cluster.pods("agent")}


def _warnings(cluster: Cluster, uid: str, reason: str) -> list[str]:
    events = cluster.plane.request("GET", f"/api/v1/namespaces/{cluster.ns}/events")["items"]
    return [e["message"] for e in events if e["involvedObject"].get("uid") == uid and e["reason"] == reason]


def _fail_with_permanent_code(cluster: Cluster, pod: dict[str, Any]) -> None:
    """What the kubelet reports of a trainer that exited with code 85 (permanent: it fails the job it counts for)."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    cluster.plane.request(
        "PATCH",
        _pod_path(cluster, pod["metadata"]["name"]) + "/status",
        {
            "status": {
                "phase": "Failed",
                "containerStatuses": [
                    {
                        "name": c["name"],
                        "image": c["image"],
                        "imageID": "",
                        "ready": False,
                        "restartCount": 0,
                        "state": {
                            "terminated": {"exitCode": 85, "reason": "Error", "startedAt": stamp, "finishedAt": stamp}
                        },
                    }
                    for c in pod["spec"]["containers"]
                ],
            }
        },
        content_type="application/strategic-merge-patch+json",
    )


def test_a_job_applied_again_under_its_name_neither_counts_nor_adopts_the_old_jobs_pods(cluster, tmp_path):
    cluster.running("same", JobBuilder("same"), tmp_path, replicas=2)
    old_uid = cluster.job("same")["metadata"]["uid"]
    old_pods = _job_pods(cluster)
    assert sorted(old_pods) == ["same-agent", "same-worker-0", "same-worker-1"]
    for name in old_pods:
        cluster.plane.request(
            "PATCH",
            _pod_path(cluster, name),
            {"metadata": {"finalizers": [HOLD]}},
            content_type="application/merge-patch+json",
        )
    cluster.plane.kubectl("delete", "-n", cluster.ns, "dtj/same", "--wait=false")
    eventually(lambda: _try(lambda: cluster.job("same")) is None, timeout=30, what="the old job gone (no finalizer)")
    # The old pods: Terminating, and one of them ended with a permanent exit code.
    eventually(
        lambda: (
            all(p["metadata"].get("deletionTimestamp") for p in _job_pods(cluster).values())
            and len(_job_pods(cluster)) == 3
        ),
        timeout=60,
        what="the garbage collector deletes the old pods",
    )
    _fail_with_permanent_code(cluster, _job_pods(cluster)["same-worker-0"])

    applied = time.monotonic()
    cluster.apply(
        JobBuilder("same").nodes(1, 4, 2).set("spec.restartPolicy", {"maxRestarts": 5, "backoffSeconds": 0}), tmp_path
    )
    new_uid = cluster.job("same")["metadata"]["uid"]
    assert new_uid != old_uid

    def waiting() -> dict[str, Any] | None:
        created = _condition(cluster.status("same"), "Created")
        return created if created.get("reason") == "NameHeld" and "same-agent" in created["message"] else None

    held = eventually(waiting, timeout=60, what="Created=False NameHeld naming the old agent pod")
    waited = time.monotonic() - applied
    assert held["status"] == "False" and old_uid in held["message"], held
    eventually(
        lambda: any("same-agent" in m for m in _warnings(cluster, new_uid, "NameHeld")),
        what="a Warning Event naming the held object",
    )
    time.sleep(3)  # several reconciles and retries of the new job while the old pods stay
    status = cluster.status("same")
    assert status.get("phase") not in ("Failed", "Succeeded"), status
    assert status.get("restarts", {}).get("total", 0) == 0 and status.get("replicas", 0) == 0, status
    for name, pod in _job_pods(cluster).items():
        assert _owner_uids(pod) == {old_uid}, f"{name} adopted: {pod['metadata'].get('ownerReferences')}"

    released = time.monotonic()
    for name in old_pods:
        cluster.plane.request(
            "PATCH",
            _pod_path(cluster, name),
            {"metadata": {"finalizers": None}},
            content_type="application/merge-patch+json",
        )

    def owned_by_the_new_job() -> dict[str, dict[str, Any]] | None:
        pods = _job_pods(cluster)
        ok = len(pods) == 3 and all(
            _owner_uids(p) == {new_uid} and p["status"].get("phase") == "Running" for p in pods.values()
        )
        return pods if ok else None

    eventually(owned_by_the_new_job, timeout=60, what="the new job's own agent and workers, running")
    started = time.monotonic() - released
    status = eventually(
        lambda: (s := cluster.status("same")) and _condition(s, "Created").get("status") == "True" and s,
        what="Created=True",
    )
    assert status.get("phase") not in ("Failed", "Succeeded") and status.get("restarts", {}).get("total", 0) == 0
    for path in (
        f"/api/v1/namespaces/{cluster.ns}/secrets/same-store-{new_uid}",
        f"/api/v1/namespaces/{cluster.ns}/services/same-agent",
    ):
        assert _owner_uids(cluster.plane.request("GET", path)) == {new_uid}, path
    print(
        f"NameHeld in the status {waited:.1f} s after the re-apply; the new job's pods running "
        f"{started:.1f} s after the old ones went"
    )


def test_an_object_of_the_jobs_name_owned_by_another_uid_is_waited_for_never_adopted(cluster, tmp_path):
    cluster.nodes(3)
    owner = cluster.plane.request(
        "POST",
        f"/api/v1/namespaces/{cluster.ns}/configmaps",
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "someone-else"}},
    )
    blocker = cluster.plane.request(
        "POST",
        f"/api/v1/namespaces/{cluster.ns}/services",
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {
                "name": "held-agent",
                "ownerReferences": [
                    {"apiVersion": "v1", "kind": "ConfigMap", "name": "someone-else", "uid": owner["metadata"]["uid"]}
                ],
            },
            "spec": {"ports": [{"port": 29400}], "selector": {"app": "someone-else"}},
        },
    )
    cluster.apply(JobBuilder("held").nodes(1, 4, 2), tmp_path)
    uid = cluster.job("held")["metadata"]["uid"]

    def held() -> dict[str, Any] | None:
        created = _condition(cluster.status("held"), "Created")
        return created if created.get("reason") == "NameHeld" else None

    condition = eventually(held, timeout=30, what="Created=False NameHeld")
    assert "Service held-agent" in condition["message"] and owner["metadata"]["uid"] in condition["message"]
    eventually(lambda: _warnings(cluster, uid, "NameHeld"), what="a Warning Event")
    time.sleep(2)
    assert not _job_pods(cluster), "no pod may start behind a Service that is not the job's"
    service = cluster.plane.request("GET", f"/api/v1/namespaces/{cluster.ns}/services/held-agent")
    assert service["metadata"]["uid"] == blocker["metadata"]["uid"]
    assert _owner_uids(service) == {owner["metadata"]["uid"]}

    cluster.plane.request("DELETE", f"/api/v1/namespaces/{cluster.ns}/services/held-agent")
    eventually(lambda: len(cluster.pods("agent")) == 1, timeout=60, what="the agent, once the name is free")
    mine = cluster.plane.request("GET", f"/api/v1/namespaces/{cluster.ns}/services/held-agent")
    assert _owner_uids(mine) == {uid} and mine["metadata"]["uid"] != blocker["metadata"]["uid"]
    eventually(lambda: _condition(cluster.status("held"), "Created").get("status") == "True", what="Created=True")


def test_deleting_a_job_while_the_operator_is_down_completes(cluster, operator, tmp_path):
    cluster.nodes(3)
    cluster.apply(JobBuilder("orphan").nodes(1, 4, 2), tmp_path)
    uid = cluster.job("orphan")["metadata"]["uid"]
    eventually(lambda: len(_job_pods(cluster)) == 3, timeout=60, what="pods created")
    assert not cluster.job("orphan")["metadata"].get("finalizers"), "the operator puts no finalizer on a job"
    operator.kill()
    try:
        started = time.monotonic()
        cluster.plane.kubectl("delete", "-n", cluster.ns, "dtj/orphan", "--timeout=30s")  # waits until it is gone
        deleted = time.monotonic() - started
        assert _try(lambda: cluster.job("orphan")) is None
        eventually(lambda: not _job_pods(cluster), timeout=90, what="the garbage collector removes the pods")
        for path in (
            f"/api/v1/namespaces/{cluster.ns}/secrets/orphan-store-{uid}",
            f"/api/v1/namespaces/{cluster.ns}/services/orphan-agent",
            f"/apis/rbac.authorization.k8s.io/v1/namespaces/{cluster.ns}/roles/orphan-agent",
        ):
            eventually(
                lambda path=path: _try(lambda: cluster.plane.request("GET", path)) is None, timeout=60, what=path
            )

        # A job an older operator finalized, deleted while no operator runs, is freed by the new one's start.
        cluster.apply(JobBuilder("legacy").nodes(1, 4, 1), tmp_path)
        cluster.plane.request(
            "PATCH",
            cluster.jobs("legacy"),
            {"metadata": {"finalizers": ["disttrain.dev/operator"]}},
            content_type="application/merge-patch+json",
        )
        cluster.plane.kubectl("delete", "-n", cluster.ns, "dtj/legacy", "--wait=false")
        time.sleep(1)
        assert cluster.job("legacy")["metadata"].get("deletionTimestamp"), "held by the old finalizer"
    finally:
        operator.start()
    eventually(
        lambda: _try(lambda: cluster.job("legacy")) is None,
        timeout=60,
        what="the new operator removes the old finalizer: the deletion completes",
    )
    print(f"kubectl delete with the operator down: {deleted:.1f} s (job uid {uid})")
    assert json.dumps(cluster.plane.request("GET", cluster.jobs())["items"]) == "[]"
