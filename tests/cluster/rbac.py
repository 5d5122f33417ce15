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


def _chart_deployment() -> dict[str, Any]:
    [deployment] = [obj for obj in render() if obj["kind"] == "Deployment"]
    return deployment


def chart_operator_flags(*names: str) -> list[str]:
    """The flags ``names`` (e.g. ``--operator-namespace``) as the chart's Deployment gives them to the operator."""
    [container] = _chart_deployment()["spec"]["template"]["spec"]["containers"]
    return [arg for arg in container["args"] if arg.split("=", 1)[0] in names]


def chart_operator_pod_labels() -> dict[str, str]:
    """The labels of the chart's operator pods."""
    return dict(_chart_deployment()["spec"]["template"]["metadata"]["labels"])


def install_operator_rbac(plane: ControlPlane) -> None:
    plane.kubectl("create", "namespace", OPERATOR_NAMESPACE, check=False)  # absent or there: both fine
    plane.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(operator_rbac_documents()))
