"""Queueing and gang scheduling on a real control plane, with the operator under the chart's RBAC.

The PodGroup CRDs are Volcano's and scheduler-plugins' published schemas (minimal copies in tests/data/podgroups);
no gang scheduler or Kueue runs here, so the tests check what those read: the PodGroup the operator applies
(owned by the job, minMember following spec.nodes.min) and the labels, annotations and schedulerName of the
worker pods, all as the real API server stored them.
"""

from __future__ import annotations

import pytest

from tests.cluster.harness import Cluster, _try, eventually
from tests.conftest import JobBuilder

pytestmark = [pytest.mark.usefixtures("crd", "pod_group_crds"), pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def operator_after_crds(pod_group_crds, operator):
    """The PodGroup CRDs exist before the operator starts (as on a cluster where Volcano is installed)."""
    return operator


def _pod_group(cluster: Cluster, api: str, name: str) -> dict | None:
    """The PodGroup, or None while the API server answers 404 (until the operator applied it)."""
    return _try(lambda: cluster.plane.request("GET", f"/apis/{api}/namespaces/{cluster.ns}/podgroups/{name}"))


@pytest.mark.parametrize(
    "scheduler, api, pod_key, in_labels",
    [
        ("volcano", "scheduling.volcano.sh/v1beta1", "scheduling.k8s.io/group-name", False),
        ("scheduler-plugins", "scheduling.x-k8s.io/v1alpha1", "scheduling.x-k8s.io/pod-group", True),
    ],
    ids=["volcano", "scheduler-plugins"],
)
def test_a_gang_job_gets_an_owned_pod_group_that_follows_nodes_min(
    operator_after_crds,
    cluster,
    tmp_path,
    scheduler,
    api,
    pod_key,
    in_labels,
):
    name = f"gang-{scheduler[:3]}"
    job = cluster.apply(JobBuilder(name).nodes(1, 4, 2).set("spec.gang", {"scheduler": scheduler}), tmp_path)
    group = eventually(lambda: _pod_group(cluster, api, name), what="the PodGroup")
    assert group["spec"]["minMember"] == 1
    [owner] = group["metadata"]["ownerReferences"]
    assert owner["uid"] == job["metadata"]["uid"] and owner["controller"] is True
    workers = eventually(lambda: len(cluster.pods()) == 2 and cluster.pods(), what="worker pods")
    for pod in workers.values():
        where = pod["metadata"]["labels"] if in_labels else pod["metadata"]["annotations"]
        assert where[pod_key] == name
        assert pod["spec"]["schedulerName"] == ("volcano" if scheduler == "volcano" else "scheduler-plugins-scheduler")
    cluster.plane.kubectl(
        "patch", "-n", cluster.ns, f"dtj/{name}", "--type=merge", "-p", '{"spec": {"nodes": {"min": 2}}}'
    )
    eventually(
        lambda: (_pod_group(cluster, api, name) or {}).get("spec", {}).get("minMember") == 2,
        what="minMember follows spec.nodes.min",
    )
    listed = cluster.plane.kubectl("get", f"podgroups.{api.split('/')[0]}", "-n", cluster.ns).stdout
    assert name in listed


def test_a_job_with_a_kueue_queue_label_gives_its_workers_kueues_pod_group_metadata(
    operator_after_crds,
    cluster,
    tmp_path,
):
    builder = JobBuilder("queued").nodes(1, 4, 3).set("metadata.labels", {"kueue.x-k8s.io/queue-name": "team-a"})
    job = cluster.apply(builder, tmp_path)
    workers = eventually(lambda: len(cluster.pods()) == 3 and cluster.pods(), what="worker pods")
    group = f"queued-{job['metadata']['uid'].replace('-', '')[:8]}"
    for pod in workers.values():
        assert pod["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
        assert pod["metadata"]["labels"]["kueue.x-k8s.io/pod-group-name"] == group
        assert pod["metadata"]["annotations"]["kueue.x-k8s.io/pod-group-total-count"] == "3"
    agent = eventually(lambda: cluster.pods("agent"), what="agent pod")
    assert not any(k.startswith("kueue.x-k8s.io/") for p in agent.values() for k in p["metadata"]["labels"])
    selected = cluster.plane.kubectl(
        "get", "pods", "-n", cluster.ns, "-l", f"kueue.x-k8s.io/pod-group-name={group}", "-o", "name"
    ).stdout.split()
    assert len(selected) == 3, "Kueue finds the group by its label"
