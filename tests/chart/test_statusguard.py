"""The chart's status guard refuses changes to exactly the operator's status fields, with the rule
api/statusguard.py writes; the operator's Deployment names the agent image. The policy's effect on a real API
server is tested in tests/cluster/test_operator.py."""

from __future__ import annotations

from tests.chart.helm import NON_DEFAULT_VALUES, by_kind, render

from disttrain.api.status import AGENT_FIELDS
from disttrain.api.statusguard import operator_fields, unchanged_rule
from disttrain.operator import cli, names


def test_every_status_field_but_the_agents_is_guarded_with_the_same_rule():
    [policy] = by_kind(render(), "ValidatingAdmissionPolicy")
    validations = policy["spec"]["validations"]
    assert [v["expression"] for v in validations] == [unchanged_rule(field) for field in operator_fields()]
    assert not set(operator_fields()) & set(AGENT_FIELDS)
    assert {"restarts", "handledPods", "control", "phase"} <= set(operator_fields())
    resources = policy["spec"]["matchConstraints"]["resourceRules"][0]["resources"]
    assert resources == ["disttrainjobs/status"]
    [condition] = policy["spec"]["matchConditions"]
    job = "demo"
    agent_account = names.service_account_name(job)
    assert condition["expression"] == (
        'request.userInfo.username == "system:serviceaccount:" + request.namespace + ":" + request.name + "-agent"'
    )
    assert agent_account == f"{job}-agent", "the rule's spelling of the agent's ServiceAccount"
    [binding] = by_kind(render(), "ValidatingAdmissionPolicyBinding")
    assert binding["spec"] == {"policyName": policy["metadata"]["name"], "validationActions": ["Deny"]}


def test_the_agent_image_is_the_operators_choice():
    for values, image in (
        (None, "ghcr.io/disttrain/trainer:0.1.0"),
        (NON_DEFAULT_VALUES, "registry.example/disttrain-trainer:1.2.3"),
    ):
        [deployment] = by_kind(render(values), "Deployment")
        [container] = deployment["spec"]["template"]["spec"]["containers"]
        assert cli.build_parser().parse_args(["operator", *container["args"]]).agent_image == image
    assert not by_kind(render(NON_DEFAULT_VALUES), "ValidatingAdmissionPolicy"), "statusGuard.enabled=false"
