"""The CEL rules in the CRD evaluate (with a real CEL interpreter) exactly as their Python mirrors.

No API server runs here, so cel-python stands in for its CEL evaluation: every rule compiles, holds or fails
on the same manifests as the Python predicate `disttrain validate` uses, and its messageExpression renders
the same text. (The server's cost estimator cannot be run here; see the README.)
"""

from __future__ import annotations

from typing import Any

import celpy
import pydantic
import pytest
from tests.conftest import JobBuilder
from tests.unit.api.test_validation import MALFORMED

from disttrain.api import rules
from disttrain.api.spec import DistTrainJob

_ENV = celpy.Environment()


def _cel_format(template: Any, args: Any) -> celpy.celtypes.StringType:
    return celpy.celtypes.StringType(str(template) % tuple(int(a) if isinstance(a, int) else str(a) for a in args))


def _evaluate(expression: str, activation: dict[str, Any]) -> Any:
    program = _ENV.program(_ENV.compile(expression), functions={"format": _cel_format})
    return program.evaluate(activation)


def _wire_objects() -> list[tuple[str, dict[str, Any]]]:
    """Every manifest of the validation matrix that parses (CEL only runs on well-typed objects)."""
    objects = []
    for case_id, build, *_ in [("valid", lambda b: b), *MALFORMED]:
        try:
            job = DistTrainJob.model_validate(build(JobBuilder()).build())
        except pydantic.ValidationError:
            continue
        objects.append((case_id, job.model_dump(mode="json", by_alias=True, exclude_none=True)))
    # pydantic refuses these names before the rules run; the API server only has the CEL rules for them.
    long_name = dict(objects[0][1], metadata={"name": "a" * 50})
    not_dns = dict(objects[0][1], metadata={"name": "my.job"})
    # Malformed checkpoint URIs, which pydantic refuses too: the CEL pattern must refuse each of them.
    uris = []
    for case_id, uri in URIS_FOR_CEL:
        spec = dict(objects[0][1]["spec"], checkpoint={"uri": uri, "path": "/ckpt", "keep": 3})
        uris.append((case_id, dict(objects[0][1], spec=spec)))
    return [*objects, ("name-too-long-for-cel", long_name), ("name-not-dns-for-cel", not_dns), *uris]


URIS_FOR_CEL = [
    ("uri-gs-for-cel", "gs://bucket/jobs"),
    ("uri-upper-case-bucket-for-cel", "s3://Bucket/jobs"),
    ("uri-short-bucket-for-cel", "s3://ab/jobs"),
    ("uri-empty-segment-for-cel", "s3://bucket/a//b"),
    ("uri-dot-segment-for-cel", "s3://bucket/a/./b"),
    ("uri-dot-dot-segment-for-cel", "s3://bucket/a/.."),
    ("uri-valid-with-dots-for-cel", "s3://my.bucket/a/..b/.c/"),
    ("uri-valid-bucket-only-for-cel", "s3://bucket"),
]


OBJECTS = _wire_objects()
STATIC_RULES = [r for r in rules.RULES if not r.transition]


@pytest.mark.parametrize("case_id,obj", OBJECTS, ids=[o[0] for o in OBJECTS])
def test_cel_rules_agree_with_their_python_mirrors(case_id, obj):
    checks = [(rule, node) for rule in STATIC_RULES for _, node in rules.nodes_at(obj, rule.node)]
    for rule, node in checks:
        activation = {"self": celpy.json_to_cel(node)}
        assert bool(_evaluate(rule.cel, activation)) == rule.holds(node), f"{case_id}: {rule.cel}"
        cel = rule.to_cel()
        if "messageExpression" in cel and not rule.holds(node):  # the server renders it on failure only
            assert str(_evaluate(cel["messageExpression"], activation)) == rule.render(node)


def test_the_fixed_batch_rule_admits_a_batch_the_data_degree_divides():
    from tests.unit.api.test_validation import fixed_batch_under_tensor_parallel

    job = DistTrainJob.model_validate(fixed_batch_under_tensor_parallel().build())
    spec = job.model_dump(mode="json", by_alias=True, exclude_none=True)["spec"]
    [rule] = [r for r in STATIC_RULES if r.field_path == ".training.globalBatchSize"]
    assert rule.holds(spec) and bool(_evaluate(rule.cel, {"self": celpy.json_to_cel(spec)}))


def test_the_matrix_makes_every_static_rule_fail_at_least_once():
    failed = {
        rule.cel
        for _, obj in OBJECTS
        for rule in STATIC_RULES
        for _, node in rules.nodes_at(obj, rule.node)
        if not rule.holds(node)
    }
    assert failed == {rule.cel for rule in STATIC_RULES}


def _transition(old_phase: str | None, change_training: bool) -> bool:
    [rule] = [r for r in rules.RULES if r.transition]
    old = JobBuilder().build()
    if old_phase:
        old["status"] = {"phase": old_phase}
    new = JobBuilder().build()
    if change_training:
        new["spec"]["training"]["maxSteps"] = 999
    return bool(_evaluate(rule.cel, {"self": celpy.json_to_cel(new), "oldSelf": celpy.json_to_cel(old)}))


@pytest.mark.parametrize(
    "phase,change,allowed",
    [
        ("Running", True, False),
        ("Reforming", True, False),
        ("Running", False, True),
        ("Suspended", True, True),
        ("Pending", True, True),
        (None, True, True),
    ],
)
def test_training_contract_is_immutable_while_the_job_runs(phase, change, allowed):
    assert _transition(phase, change) is allowed
