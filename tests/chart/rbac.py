"""What the operator needs from RBAC, written down once, and the permissions a set of rendered rules grants.

Shared with tests/cluster, which asks the real API server (``kubectl auth can-i``) the same questions.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

Permission = tuple[str, str, str]
"""(apiGroup, resource, verb)"""

CLUSTER_SCOPED = {"customresourcedefinitions", "nodes", "namespaces"}


def _expand(group: str, resources: Iterable[str], verbs: Iterable[str]) -> set[Permission]:
    return {(group, resource, verb) for resource in resources for verb in verbs}


KOPF = (
    _expand("apiextensions.k8s.io", ["customresourcedefinitions"], ["list", "watch"])  # resource observer
    | _expand("disttrain.dev", ["disttrainjobs"], ["list", "watch", "patch"])  # watch; finalizer, annotations
    | _expand("", ["pods", "nodes"], ["list", "watch"])  # @kopf.on.event("v1", "pods" / "nodes")
    | _expand("coordination.k8s.io", ["leases"], ["list", "watch"])  # the agents' Leases (operator/agentbeat.py)
    | _expand("", ["events"], ["create"])
)  # kopf's own Events (core/v1) about handler failures
"""kopf 1.45 itself (kopf/_core/reactor/observation.py, posting.py) for the handlers in operator/handlers.py."""

KOPF_NAMESPACE_LIST = _expand("", ["namespaces"], ["list", "watch"])
"""kopf's namespace observer, which runs only when serving a list of namespaces (not --all-namespaces)."""

ADAPTER = (
    _expand("disttrain.dev", ["disttrainjobs"], ["list", "delete"])  # Kube.list_scope, Kube.delete_job (TTL)
    | _expand("disttrain.dev", ["disttrainjobs/status"], ["patch"])  # Kube.patch_status
    | _expand("", ["pods"], ["list", "create", "delete"])  # Kube.list_scope, create, delete_pod
    | _expand("", ["nodes"], ["list"])  # Kube.list_scope
    | _expand("", ["services", "serviceaccounts", "events", "secrets"], ["create"])  # Kube.create
    | _expand("networking.k8s.io", ["networkpolicies"], ["create"])  # Kube.create (operator/access.py)
    | _expand("rbac.authorization.k8s.io", ["roles", "rolebindings"], ["create"])
    | _expand("coordination.k8s.io", ["leases"], ["create", "get"])  # Kube.create, Kube.read: the agent's Lease
    # Kube.read: after a 409 on create, whose the existing object is (owner uid)
    | _expand("", ["pods", "services", "serviceaccounts"], ["get"])  # not secrets: names.store_secret_name
    | _expand("networking.k8s.io", ["networkpolicies"], ["get"])
    | _expand("rbac.authorization.k8s.io", ["roles", "rolebindings"], ["get"])
    # Kube.apply_pod_group: a server-side apply, authorized as create while the PodGroup does not exist
    | _expand("scheduling.volcano.sh", ["podgroups"], ["create", "patch"])
    | _expand("scheduling.x-k8s.io", ["podgroups"], ["create", "patch"])
)
"""The API calls of operator/handlers.py's ``Kube`` (its lists are operator/listing.py's: once per namespace and
after a re-list, never per reconcile). ``get`` on disttrainjobs is no call of the operator's: the agent Role
grants it (see ``needed``)."""


def granted(rules: Iterable[dict[str, Any]]) -> set[Permission]:
    """Every (group, resource, verb) that ``rules`` allow, ignoring resourceNames (which only narrow them)."""
    return {
        (group, resource, verb)
        for rule in rules
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def needed(agent_role_rules: Iterable[dict[str, Any]], *, all_namespaces: bool) -> set[Permission]:
    """All the operator needs: kopf's, the adapter's, and what it grants the per-job agent Role (RBAC refuses to
    let anyone create a Role that grants a permission its creator does not hold)."""
    return KOPF | ADAPTER | granted(agent_role_rules) | (set() if all_namespaces else KOPF_NAMESPACE_LIST)
