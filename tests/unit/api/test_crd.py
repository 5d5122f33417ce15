"""The CRD rendered from the models: checked in, structural, valid for the API server's own schema."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import yaml
from tests.conftest import REPO_ROOT

from disttrain.api import crd, rules

CHECKED_IN = REPO_ROOT / "crds" / crd.CRD_FILE


def test_checked_in_crd_equals_the_rendered_one():
    assert CHECKED_IN.read_text() == crd.render_crd(), "run: disttrain crd > crds/" + crd.CRD_FILE


def test_crd_validates_against_the_apiextensions_schema():
    kubernetes_validate.validate(crd.build_crd(), "1.33", strict=True)


def _walk(schema: dict[str, Any], path: str = ""):
    yield path, schema
    for key, sub in schema.get("properties", {}).items():
        yield from _walk(sub, f"{path}.{key}")
    if isinstance(schema.get("items"), dict):
        yield from _walk(schema["items"], f"{path}[*]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from _walk(schema["additionalProperties"], f"{path}.*")


def test_schema_is_structural():
    root = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, node in _walk(root):
        assert ("$ref" not in node and "anyOf" not in node) or node.get("x-kubernetes-int-or-string"), path
        assert (
            "type" in node or node.get("x-kubernetes-int-or-string") or node.get("x-kubernetes-preserve-unknown-fields")
        ), f"{path} has no type"
        assert not ("properties" in node and "additionalProperties" in node), path
        assert "title" not in node and "nullable" not in node, path


def test_every_rule_is_attached_to_its_node():
    root = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    attached = {path.lstrip("."): node.get("x-kubernetes-validations", []) for path, node in _walk(root)}
    for rule in rules.RULES:
        assert rule.to_cel() in attached[rule.node], rule.node


def test_scale_subresource_points_at_replicas_and_selector():
    version = crd.build_crd()["spec"]["versions"][0]
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.nodes.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    assert version["subresources"]["status"] == {}


def test_printer_columns_and_names():
    spec = crd.build_crd()["spec"]
    columns = [c["name"] for c in spec["versions"][0]["additionalPrinterColumns"]]
    assert columns[:9] == [
        "Phase",
        "World",
        "Step",
        "Samples/s",
        "Checkpoint",
        "Restarts",
        "Infra Losses",
        "Last Reform",
        "Age",
    ]
    by_name = {c["name"]: c for c in spec["versions"][0]["additionalPrinterColumns"]}
    assert by_name["Checkpoint"] == {**by_name["Checkpoint"], "type": "date", "jsonPath": ".status.lastCheckpoint.time"}
    status = spec["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    for column in by_name.values():  # every column reads a field the schema declares
        path = column["jsonPath"].split(".")[1:]
        if path[0] == "status":
            node = {"properties": status}
            for part in path[1:]:
                node = node["properties"][part]
    assert spec["names"]["shortNames"] == ["dtj"] and spec["group"] == "disttrain.dev"


def test_optional_parent_objects_default_to_empty_so_nested_defaults_apply():
    spec = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    for key in ("rendezvous", "elastic", "restartPolicy", "runPolicy"):
        assert spec["properties"][key]["default"] == {}, key
    assert spec["properties"]["restartPolicy"]["properties"]["exitCodes"]["properties"]["permanent"]["default"] == [85]


def test_every_spec_field_has_a_description_for_kubectl_explain():
    spec = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    for path, node in _walk(spec):
        if path.startswith((".template.", ".agent.affinity.")):
            continue  # Kubernetes' own schemas (api/schemas): the Kubernetes API reference describes them
        if path.endswith(("[*]", ".*")):
            continue  # list items and map values are described by their field
        assert node.get("description"), f"spec{path} has no description"


def test_the_checked_in_file_is_plain_yaml_a_kubectl_apply_accepts():
    docs = list(yaml.safe_load_all(CHECKED_IN.read_text()))
    assert len(docs) == 1 and docs[0]["kind"] == "CustomResourceDefinition"
