"""The chart's RBAC gives the operator exactly what it needs, no more: cluster-wide with the default values,
and with ``watchNamespaces`` a Role per namespace plus a ClusterRole for the cluster-scoped reads only."""

from __future__ import annotations

from typing import Any

from tests.chart.helm import NAMESPACE, SERVICE_ACCOUNT, by_kind, render
from tests.chart.rbac import CLUSTER_SCOPED, granted, needed
from tests.unit.operator.world import job_manifest

from disttrain.api.spec import DistTrainJob
from disttrain.operator import access, pods

SUBJECT = {"kind": "ServiceAccount", "name": SERVICE_ACCOUNT, "namespace": NAMESPACE}


def _agent_role_rules(namespace: str = "default") -> list[dict[str, Any]]:
    manifest = job_manifest("x")
    manifest["metadata"]["namespace"] = namespace
    return pods.build_role(DistTrainJob.model_validate(manifest))["rules"]


def _job_rbac(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """All but the leader election's Role and RoleBinding (tests/chart/test_render.py checks those)."""
    return [obj for obj in objects if not obj["metadata"]["name"].endswith("-leader")]


def _only(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    [obj] = by_kind(objects, kind)
    return obj


def _bound(objects: list[dict[str, Any]], binding_kind: str, role: dict[str, Any]) -> None:
    """``role`` is bound to the operator's ServiceAccount by a binding of ``binding_kind`` in its namespace."""
    namespace = role["metadata"].get("namespace")
    [binding] = [b for b in by_kind(objects, binding_kind) if b["metadata"].get("namespace") == namespace]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": role["kind"],
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [SUBJECT]


def test_all_namespaces_cluster_role_is_exactly_what_is_needed():
    objects = _job_rbac(render())
    role = _only(objects, "ClusterRole")
    _bound(objects, "ClusterRoleBinding", role)
    assert not by_kind(objects, "Role") and not by_kind(objects, "RoleBinding")
    held = granted(role["rules"])
    want = needed(_agent_role_rules(), all_namespaces=True)
    assert want - held == set(), "missing"
    assert held - want == set(), "granted but never used"


def test_watch_namespaces_roles_are_exactly_what_is_needed():
    namespaces = ["team-a", "team-b"]
    objects = _job_rbac(render({"watchNamespaces": namespaces}))
    cluster_role = _only(objects, "ClusterRole")
    _bound(objects, "ClusterRoleBinding", cluster_role)
    cluster_held = granted(cluster_role["rules"])
    assert {resource for _, resource, _ in cluster_held} <= CLUSTER_SCOPED, "namespaced access cluster-wide"
    roles = by_kind(objects, "Role")
    assert sorted(role["metadata"]["namespace"] for role in roles) == namespaces
    for role in roles:
        _bound(objects, "RoleBinding", role)
        held = cluster_held | granted(role["rules"])
        want = needed(_agent_role_rules(role["metadata"]["namespace"]), all_namespaces=False)
        assert want - held == set(), f"missing in {role['metadata']['namespace']}"
        assert held - want == set(), f"granted but never used in {role['metadata']['namespace']}"
        assert not {resource for _, resource, _ in granted(role["rules"])} & CLUSTER_SCOPED


def test_operator_may_create_every_object_it_builds():
    """The per-job support objects, pods and Events are all creatable (the chart's create verbs)."""
    job = DistTrainJob.model_validate(job_manifest("x"))
    built = [*pods.build_support_objects(job), access.build_store_secret(job, "s")]
    created = {obj["kind"] for obj in built} | {"Pod", "Event"}
    plural = {
        "ServiceAccount": "serviceaccounts",
        "Role": "roles",
        "RoleBinding": "rolebindings",
        "Service": "services",
        "Pod": "pods",
        "Event": "events",
        "Secret": "secrets",
        "NetworkPolicy": "networkpolicies",
        "Lease": "leases",
    }
    groups = {
        "Role": "rbac.authorization.k8s.io",
        "RoleBinding": "rbac.authorization.k8s.io",
        "NetworkPolicy": "networking.k8s.io",
        "Lease": "coordination.k8s.io",
    }
    assert created <= set(plural), created - set(plural)
    held = granted(_only(render(), "ClusterRole")["rules"])
    assert {(groups.get(kind, ""), plural[kind], "create") for kind in created} <= held
