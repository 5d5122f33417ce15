"""The operator's diff-base storage builds exactly kopf's essence (the one kopf's default storage builds) for the
objects it watches, without copying status and managedFields first."""

from __future__ import annotations

import copy
import json

import kopf
import pytest

from disttrain.api import constants
from disttrain.operator.diffbase import LeanDiffBaseStorage

pytestmark = pytest.mark.timeout(30)

MANAGED = [
    {
        "manager": "disttrain-agent",
        "operation": "Update",
        "subresource": "status",
        "fieldsType": "FieldsV1",
        "fieldsV1": {"f:status": {"f:step": {}, "f:lastCheckpoint": {"f:step": {}, "f:time": {}}}},
    }
]


def job() -> dict:
    return {
        "apiVersion": constants.API_VERSION,
        "kind": constants.KIND,
        "metadata": {
            "name": "demo",
            "namespace": "team",
            "uid": "uid-1",
            "resourceVersion": "42",
            "generation": 3,
            "labels": {"team": "nlp"},
            "annotations": {
                "kubectl.kubernetes.io/last-applied-configuration": '{"spec": {}}',
                "kopf.zalando.org/touch-dummy": "x",
                "example.com/owner": "alice",
            },
            "finalizers": [f"{constants.GROUP}/operator"],
            "managedFields": MANAGED,
        },
        "spec": {"nodes": {"min": 2, "max": 4, "replicas": 3}, "template": {"spec": {"containers": [{"name": "t"}]}}},
        "status": {"phase": "Running", "step": 120, "conditions": [{"type": "Ready", "status": "True"}]},
    }


def pod() -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "demo-worker-0",
            "namespace": "team",
            "labels": {constants.LABEL_JOB_NAME: "demo"},
            "ownerReferences": [{"kind": constants.KIND, "name": "demo", "uid": "uid-1", "controller": True}],
            "managedFields": MANAGED,
        },
        "spec": {"nodeName": "node-1", "containers": [{"name": "trainer", "image": "trainer:1"}]},
        "status": {"phase": "Running", "podIP": "10.0.0.5", "containerStatuses": [{"name": "trainer", "ready": True}]},
    }


def node() -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": "node-1", "labels": {"kubernetes.io/hostname": "node-1"}},
        "status": {"conditions": [{"type": "Ready", "status": "True"}], "images": [{"names": ["a"]}] * 50},
    }


PREFIX = "example.com"
"""An annotation prefix kopf does not know (it drops its own prefixes' annotations from the essence whatever the
key), so that only the key marked by the owners removes the stored essence from the next essence."""


def replica_set_of_a_deployment() -> dict:
    """The one kind whose annotation key kopf marks by its owners (``-ofDRS``)."""
    stored = {"spec": {"replicas": 1}}
    return {
        "apiVersion": "apps/v1",
        "kind": "ReplicaSet",
        "metadata": {
            "name": "web-1",
            "ownerReferences": [{"kind": "Deployment", "name": "web"}],
            "annotations": {f"{PREFIX}/last-handled-configuration-ofDRS": json.dumps(stored)},
        },
        "spec": {"replicas": 2},
        "status": {"replicas": 2},
    }


@pytest.mark.parametrize("make", [job, pod, node, replica_set_of_a_deployment])
def test_the_essence_is_kopfs_own(make):
    raw = make()
    untouched = copy.deepcopy(raw)
    lean, reference = LeanDiffBaseStorage(prefix=PREFIX), kopf.AnnotationsDiffBaseStorage(prefix=PREFIX)
    essence = lean.build(body=kopf.Body(raw))
    assert essence == reference.build(body=kopf.Body(copy.deepcopy(raw)))
    assert "status" not in essence and "managedFields" not in essence.get("metadata", {})
    assert lean.fetch(body=kopf.Body(raw)) == reference.fetch(body=kopf.Body(raw))
    assert raw == untouched, "building must not change the watched object"


def test_the_essence_is_a_copy_not_a_view_of_the_object():
    raw = job()
    essence = LeanDiffBaseStorage().build(body=kopf.Body(raw))
    raw["spec"]["nodes"]["replicas"] = 4
    raw["metadata"]["labels"]["team"] = "vision"
    assert essence["spec"]["nodes"]["replicas"] == 3 and essence["metadata"]["labels"]["team"] == "nlp"


def test_a_field_filter_takes_kopfs_path_and_keeps_the_field():
    raw = job()
    essence = LeanDiffBaseStorage().build(body=kopf.Body(raw), extra_fields=["status.phase"])
    assert essence == kopf.AnnotationsDiffBaseStorage().build(body=kopf.Body(raw), extra_fields=["status.phase"])
    assert essence["status"] == {"phase": "Running"}


def test_the_stored_essence_is_found_under_kopfs_annotation():
    raw = replica_set_of_a_deployment()
    storage = LeanDiffBaseStorage(prefix=PREFIX)
    assert storage.fetch(body=kopf.Body(raw)) == {"spec": {"replicas": 1}}
    assert storage.build(body=kopf.Body(raw)) == {"spec": {"replicas": 2}}, "the stored essence is not essence"
