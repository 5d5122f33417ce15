"""The operator's ServiceAccount and RBAC exactly as the Helm chart installs them, applied to the real API server."""

from __future__ import annotations

from typing import Any

import yaml

from tests.chart.helm import NAMESPACE, object_name, render
from tests.cluster.controlplane import ControlPlane

OPERATOR_NAMESPACE = NAMESPACE
OPERATOR_SERVICE_ACCOUNT = object_name()
RBAC_KINDS = {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}
GUARD_KINDS = {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}
"""The status guard (templates/statusguard.yaml): who may change the operator's status fields."""
FLOW_KINDS = {"FlowSchema", "PriorityLevelConfiguration"}
"""API Priority and Fairness (templates/flowschema.yaml): the operator's requests in a level of their own, the agents'
progress writes in a bounded one."""


def operator_rbac_documents() -> list[dict[str, Any]]:
    """The chart's RBAC objects, its status guard and its FlowSchema (default values: the operator watches all
    namespaces)."""
    return [obj for obj in render() if obj["kind"] in RBAC_KINDS | GUARD_KINDS | FLOW_KINDS]


def install_operator_rbac(plane: ControlPlane) -> None:
    plane.kubectl("create", "namespace", OPERATOR_NAMESPACE, check=False)  # absent or there: both fine
    plane.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(operator_rbac_documents()))
