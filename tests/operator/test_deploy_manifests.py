"""Every manifest under deploy/ is accepted by the Kubernetes 1.33 schema, and the operator's RBAC covers what
the per-job Role grants (RBAC refuses to let anyone create a Role with permissions it does not hold)."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from disttrain.api.spec import DistTrainJob
from disttrain.operator import pods

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DOCUMENTS = [(path.name, i, doc) for path in sorted(DEPLOY.glob("*.yaml"))
             for i, doc in enumerate(yaml.safe_load_all(path.read_text())) if doc]


def test_deploy_has_the_operator_objects():
    kinds = {doc["kind"] for _, _, doc in DOCUMENTS}
    assert {"Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Deployment", "Service"} <= kinds


@pytest.mark.parametrize("document", DOCUMENTS, ids=[f"{name}#{i}-{doc['kind']}" for name, i, doc in DOCUMENTS])
def test_manifest_validates_against_kubernetes_1_33(document):
    kubernetes_validate.validate(document[2], "1.33.0", strict=True)


def test_operator_holds_every_permission_it_grants_the_agent():
    [role] = [doc for _, _, doc in DOCUMENTS if doc["kind"] == "ClusterRole"]
    held = {(group, resource, verb) for rule in role["rules"] for group in rule["apiGroups"]
            for resource in rule["resources"] for verb in rule["verbs"]}
    job = DistTrainJob.model_validate({
        "apiVersion": "disttrain.dev/v1alpha1", "kind": "DistTrainJob", "metadata": {"name": "x", "namespace": "n"},
        "spec": {"template": {"spec": {"containers": [{"name": "trainer", "image": "i", "command": ["python"]}]}},
                 "nodes": {"min": 1, "max": 2, "replicas": 1},
                 "training": {"globalBatchSize": 8, "microBatchSize": 1, "lr": {"base": 0.1}, "maxSteps": 1},
                 "checkpoint": {"claimName": "c"}}})
    granted = {(group, resource, verb) for rule in pods.build_role(job)["rules"] for group in rule["apiGroups"]
               for resource in rule["resources"] for verb in rule["verbs"]}
    assert granted <= held, granted - held
    created = {obj["kind"] for obj in pods.build_support_objects(job)} | {"Pod", "Event"}
    plural = {"ServiceAccount": "serviceaccounts", "Role": "roles", "RoleBinding": "rolebindings",
              "Service": "services", "Pod": "pods", "Event": "events"}
    assert {plural[kind] for kind in created} <= {resource for _, resource, verb in held if verb == "create"}
