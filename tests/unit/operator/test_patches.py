"""JSON documents: the operator's copy is a deep copy (nothing shared with the original), also of what is not
plain decoded JSON."""

from __future__ import annotations

import copy

import kopf
import pytest

from disttrain.operator.patches import copy_json

pytestmark = pytest.mark.timeout(30)


def document() -> dict:
    return {
        "metadata": {"name": "demo", "labels": {"a": "b"}, "managedFields": [{"fieldsV1": {"f:status": {}}}]},
        "spec": {"nodes": {"min": 1, "max": 4}, "flags": [True, False, None], "lr": 0.1},
        "status": {"members": [{"name": "p0", "ranks": [0, 1]}], "step": 3},
    }


def test_the_copy_equals_the_original_and_shares_nothing_mutable():
    original = document()
    copied = copy_json(original)
    assert copied == original
    assert copied is not original
    assert copied["status"]["members"] is not original["status"]["members"]
    copied["status"]["members"][0]["ranks"].append(2)
    copied["metadata"]["labels"]["a"] = "changed"
    copied["spec"]["nodes"].pop("max")
    assert original == document()


def test_what_is_not_decoded_json_is_copied_as_deepcopy_copies_it():
    view = kopf.Body({"spec": {"x": 1}})  # a kopf view over a dict, not a dict
    held = {"body": view, "set": {1, 2}, "tuple": ([1],)}
    copied = copy_json(held)
    assert copied["set"] == {1, 2} and copied["set"] is not held["set"]
    assert copied["tuple"] == ([1],) and copied["tuple"][0] is not held["tuple"][0]
    assert copied["body"] is not view and dict(copied["body"]) == dict(copy.deepcopy(view))
