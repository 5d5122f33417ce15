"""values.schema.json refuses wrong types and unknown keys: helm template and helm lint fail and the message
names the field (helm prints the JSON pointer of each violation)."""

from __future__ import annotations

import json

import jsonschema
import pytest
import yaml
from tests.chart.helm import CHART, NON_DEFAULT_VALUES, RELEASE, helm

BAD = [
    ({"bogus": 1}, "additional properties 'bogus' not allowed"),
    ({"image": {"repo": "x"}}, "at '/image': additional properties 'repo' not allowed"),
    ({"image": {"pullPolicy": "Sometimes"}}, "at '/image/pullPolicy'"),
    ({"image": {"tag": 1.2}}, "at '/image/tag': got number, want string"),
    ({"watchNamespaces": "team-a"}, "at '/watchNamespaces': got string, want array"),
    ({"watchNamespaces": ["ml-*"]}, "at '/watchNamespaces/0'"),
    ({"watchNamespaces": ["a", "a"]}, "at '/watchNamespaces'"),
    ({"metrics": {"port": "9090"}}, "at '/metrics/port': got string, want integer"),
    ({"metrics": {"port": 70000}}, "at '/metrics/port'"),
    ({"liveness": {"port": 0}}, "at '/liveness/port'"),
    ({"logLevel": "loud"}, "at '/logLevel'"),
    ({"serviceMonitor": {"enabled": "yes"}}, "at '/serviceMonitor/enabled': got string, want boolean"),
    ({"serviceMonitor": {"interval": "30"}}, "at '/serviceMonitor/interval'"),
    ({"podMonitor": {"enabled": 1}}, "at '/podMonitor/enabled': got number, want boolean"),
    ({"podMonitor": {"port": "metrics"}}, "at '/podMonitor': additional properties 'port' not allowed"),
    ({"prometheusRule": {"restartBudgetRatio": 80}}, "at '/prometheusRule/restartBudgetRatio'"),
    (
        {"prometheusRule": {"checkpointMaxAgeSeconds": "1h"}},
        "at '/prometheusRule/checkpointMaxAgeSeconds': got string, want integer",
    ),
    ({"prometheusRule": {"reformingFor": "15 minutes"}}, "at '/prometheusRule/reformingFor'"),
    ({"dashboards": {"namespace": "Monitoring"}}, "at '/dashboards/namespace'"),
    ({"dashboards": {"labels": {"grafana_dashboard": 1}}}, "at '/dashboards/labels/grafana_dashboard'"),
    ({"resources": {"request": {"cpu": "1"}}}, "at '/resources': additional properties 'request' not allowed"),
    ({"nodeSelector": {"disk": 1}}, "at '/nodeSelector/disk': got number, want string"),
    ({"tolerations": {"key": "x"}}, "at '/tolerations': got object, want array"),
    ({"fullnameOverride": "Not_A_Name"}, "at '/fullnameOverride'"),
    ({"networkPolicy": {"enabled": "true"}}, "at '/networkPolicy/enabled': got string, want boolean"),
    ({"networkPolicy": {"scraper": {}}}, "at '/networkPolicy': additional properties 'scraper' not allowed"),
    (
        {"networkPolicy": {"metricsScraper": {"podSelector": {"app": "prometheus"}}}},
        "at '/networkPolicy/metricsScraper/podSelector': additional properties 'app' not allowed",
    ),
    (
        {
            "networkPolicy": {
                "metricsScraper": {"namespaceSelector": {"matchExpressions": [{"key": "a", "operator": "Is"}]}}
            }
        },
        "at '/networkPolicy/metricsScraper/namespaceSelector/matchExpressions/0/operator'",
    ),
]


@pytest.mark.parametrize(("values", "message"), BAD, ids=[message.split(":")[0] for _, message in BAD])
def test_template_refuses(values, message):
    done = helm("template", RELEASE, str(CHART), values=values, check=False)
    assert done.returncode != 0
    assert "values don't meet the specifications of the schema" in done.stderr
    assert message in done.stderr, done.stderr


def test_lint_refuses_too():
    done = helm("lint", str(CHART), values={"metrics": {"port": "9090"}}, check=False)
    assert done.returncode != 0
    assert "at '/metrics/port': got string, want integer" in done.stdout


@pytest.mark.parametrize("values", [None, NON_DEFAULT_VALUES], ids=["default", "non-default"])
def test_schema_accepts_the_documented_values(values):
    """The schema is draft-07 and the chart's own values.yaml (and every documented key) satisfies it."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    jsonschema.Draft7Validator(schema).validate({**defaults, **(values or {})})
    assert set(NON_DEFAULT_VALUES) | set(defaults) <= set(schema["properties"])


def test_non_default_values_change_every_key():
    """So that lint/template/validation with NON_DEFAULT_VALUES exercise every value (the name override aside:
    it would rename the objects the other tests look up)."""
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    assert set(defaults) - set(NON_DEFAULT_VALUES) == {"fullnameOverride"}
    for key, value in NON_DEFAULT_VALUES.items():
        assert value != defaults[key], key
