"""The kopf adapter end to end against the kmock API emulator over HTTP (no cluster, real kopf, real HTTP)."""

from __future__ import annotations

import asyncio
import copy

import kubernetes_validate
import pytest
from tests.operator.conftest import JOBS, PODS, eventually

from disttrain.api import constants, env

pytestmark = pytest.mark.timeout(60)

MANIFEST = {
    "apiVersion": "disttrain.dev/v1alpha1",
    "kind": "DistTrainJob",
    "metadata": {"name": "demo", "namespace": "default"},
    "spec": {
        "template": {
            "spec": {
                "containers": [{"name": "trainer", "image": "example/trainer:1", "command": ["python", "train.py"]}]
            }
        },
        "nodes": {"min": 1, "max": 4, "replicas": 2},
        "training": {"globalBatchSize": 24, "microBatchSize": 2, "lr": {"base": 0.1}, "maxSteps": 100},
        "checkpoint": {"claimName": "ckpt", "intervalSteps": 10},
        "elastic": {"scaleDebounceSeconds": 0, "replacementWaitSeconds": 30},
        "restartPolicy": {"maxRestarts": 5, "backoffSeconds": 0},
    },
}


def manifest(**spec):
    body = copy.deepcopy(MANIFEST)
    body["spec"].update(spec)
    return body


async def apply(k, body=None):
    await k.request("POST", JOBS, body or manifest())
    return await k.job()


async def workers(k):
    return {n: p for n, p in (await k.pods()).items() if p["metadata"]["labels"].get(constants.LABEL_ROLE) == "worker"}


async def running_job(k, replicas=2):
    """Apply, let every pod run on its own node, and report progress as the agent would."""
    await apply(k, manifest(nodes={"min": 1, "max": 4, "replicas": replicas}))
    pods = await eventually(lambda: _count(k, replicas + 1))
    for i, name in enumerate(sorted(pods)):
        await k.node(f"node-{i}")
        await k.run_pod(name, f"node-{i}")
    await k.agent_reports("demo", worldSize=replicas, step=3, lastProgressTime=_future(0), rendezvousRound=1)
    await eventually(lambda: _phase(k, "Running"))


def _future(seconds):
    import time

    from disttrain.api.conditions import format_time

    return format_time(time.time() + seconds)


async def _count(k, n):
    pods = await k.pods()
    return (pods or True) if len(pods) == n else None


async def _phase(k, phase):
    job = await k.job()
    return job if job and (job.get("status") or {}).get("phase") == phase else None


async def test_apply_creates_agent_services_rbac_and_workers_owned_by_the_job(operator, api, k):
    job = await apply(k)
    uid = job["metadata"]["uid"]
    pods = await eventually(lambda: _count(k, 3))
    assert set(pods) == {"demo-agent", "demo-worker-0", "demo-worker-1"}
    owner = {
        "apiVersion": "disttrain.dev/v1alpha1",
        "kind": "DistTrainJob",
        "name": "demo",
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }
    for path in (
        "/api/v1/namespaces/default/services/demo-agent",
        "/api/v1/namespaces/default/services/demo-workers",
        "/api/v1/namespaces/default/serviceaccounts/demo-agent",
        "/apis/rbac.authorization.k8s.io/v1/namespaces/default/roles/demo-agent",
        "/apis/rbac.authorization.k8s.io/v1/namespaces/default/rolebindings/demo-agent",
        "/apis/coordination.k8s.io/v1/namespaces/default/leases/demo-agent-heartbeat",  # the agent's heartbeat
    ):
        obj = await k.get(path)
        assert obj is not None, path
        assert obj["metadata"]["ownerReferences"] == [owner]
    for pod in pods.values():
        assert pod["metadata"]["ownerReferences"] == [owner]
        assert pod["metadata"]["labels"][constants.LABEL_JOB_NAME] == "demo"
    worker = pods["demo-worker-1"]
    assert worker["metadata"]["labels"][constants.LABEL_NODE_INDEX] == "1"
    container = worker["spec"]["containers"][0]
    assert f"--rdzv-id={uid}" in container["command"]
    assert "--rdzv-endpoint=demo-agent.default.svc:29400" in container["command"]
    assert container["command"][-2:] == ["python", "train.py"]
    values = {e["name"]: e.get("value") for e in container["env"]}
    assert values[env.NODE_NAME] == "demo-worker-1" and values[env.JOB_UID] == uid
    # What the operator posted is what a real apiserver accepts (server-set fields stripped).
    for pod in pods.values():
        posted = {key: pod[key] for key in ("apiVersion", "kind", "spec")}
        posted["metadata"] = {
            k: v for k, v in pod["metadata"].items() if k not in ("uid", "resourceVersion", "creationTimestamp")
        }
        kubernetes_validate.validate(posted, "1.33.0", strict=True)

    async def counted():
        job = await _phase(k, "Pending")
        return job if job and job["status"].get("replicas") == 2 else None

    status = (await eventually(counted))["status"]
    assert status["desiredNodes"] == 2 and status["replicas"] == 2
    assert status["selector"] == "disttrain.dev/job-name=demo,disttrain.dev/role=worker"
    events = (await k.get("/api/v1/namespaces/default/events"))["items"]
    assert any(e["reason"] == "Created" and e["involvedObject"]["uid"] == uid for e in events)


async def test_deleting_a_worker_reforms_and_replaces_only_it(operator, k):
    await running_job(k, 3)
    before = await workers(k)
    await k.request("DELETE", f"{PODS}/demo-worker-1")
    job = await eventually(lambda: _phase(k, "Reforming"))
    assert job["status"]["control"]["action"] == "reform"
    assert job["status"]["infrastructureLosses"]["byReason"] == {"PodDeleted": 1}
    assert job["status"]["restarts"]["total"] == 0, "a deletion is not the user's failure"
    after = await eventually(lambda: _count_workers(k, 3))
    assert after["demo-worker-1"]["metadata"]["uid"] != before["demo-worker-1"]["metadata"]["uid"]
    for name in ("demo-worker-0", "demo-worker-2"):
        assert after[name]["metadata"]["uid"] == before[name]["metadata"]["uid"], "survivors are never restarted"
    await asyncio.sleep(0.5)
    assert (await k.job())["status"]["infrastructureLosses"]["total"] == 1


async def _count_workers(k, n):
    pods = await workers(k)
    return pods if len(pods) == n else None


async def test_a_not_ready_node_loses_its_pod(operator, k):
    await running_job(k, 2)
    await k.node("node-1", ready="False")
    job = await eventually(lambda: _node_lost(k))
    assert job["status"]["infrastructureLosses"]["byReason"] == {"NodeNotReady": 1}
    assert job["status"]["restarts"]["total"] == 0
    assert job["status"]["control"]["reason"] == "NodeNotReady"


async def _node_lost(k):
    job = await k.job()
    return job if job["status"].get("infrastructureLosses", {}).get("total") else None


async def test_scale_subresource_drains_then_deletes_the_victim(operator, k):
    await running_job(k, 3)
    await k.merge(f"{JOBS}/demo/scale", {"spec": {"replicas": 2}})
    job = await eventually(lambda: _phase(k, "Reforming"))
    assert job["status"]["control"]["action"] == "drain"
    assert job["status"]["control"]["exclude"] == ["demo-worker-2"]
    assert "demo-worker-2" in await workers(k), "victims wait for the drain checkpoint"
    await k.agent_reports("demo", lastCheckpoint={"step": 10, "time": _future(1)})
    await eventually(lambda: _count_workers(k, 2))
    await k.agent_reports("demo", worldSize=2, lastProgressTime=_future(2), rendezvousRound=2)  # the new group
    job = await eventually(lambda: _phase(k, "Running"))
    assert job["status"]["restarts"]["total"] == 0, job["status"]
    assert job["status"]["lastReform"]["to"] == 2, job["status"]


async def test_a_permanent_exit_code_fails_the_job_with_the_reason(operator, k):
    await running_job(k, 2)
    await k.fail_pod("demo-worker-0", 85)
    job = await eventually(lambda: _phase(k, "Failed"))
    failed = next(c for c in job["status"]["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "PermanentExitCode" and "85" in failed["message"]
    await eventually(lambda: _count(k, 0))


async def test_suspend_removes_pods_keeps_status_and_resume_recreates_them(operator, k):
    await running_job(k, 2)
    await k.agent_reports("demo", lastCheckpoint={"step": 30, "time": _future(0)})
    await k.merge(f"{JOBS}/demo", {"spec": {"runPolicy": {"suspend": True}}})
    job = await eventually(lambda: _phase(k, "Suspended"))
    await eventually(lambda: _count(k, 0))
    assert job["status"]["lastCheckpoint"]["step"] == 30
    await k.merge(f"{JOBS}/demo", {"spec": {"runPolicy": {"suspend": False}}})
    await eventually(lambda: _count(k, 3))

    async def announced():
        reasons = [e["reason"] for e in (await k.get("/api/v1/namespaces/default/events"))["items"]]
        return {"Suspended", "Resumed", "ResumedFromStep"} <= set(reasons)

    await eventually(announced)


async def test_ttl_deletes_the_finished_job(operator, k):
    await apply(k, manifest(runPolicy={"ttlSecondsAfterFinished": 1}, nodes={"min": 1, "max": 4, "replicas": 1}))
    pods = await eventually(lambda: _count(k, 2))
    await k.node("node-0")
    await k.run_pod("demo-worker-0", "node-0")
    await k.merge(f"{PODS}/demo-worker-0/status", {"status": {"phase": "Succeeded"}})
    await eventually(lambda: _phase(k, "Succeeded"))
    assert pods
    await eventually(lambda: _gone(k), timeout=10)


async def _gone(k):
    return await k.job() is None
