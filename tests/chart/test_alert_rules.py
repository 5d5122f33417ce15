"""The chart's PrometheusRule: off by default; its rules pass ``promtool check rules``, fire and stay quiet as
``alert_rules_test.yaml`` says on synthetic series (``promtool test rules``), and read only exported series."""

from __future__ import annotations

import pathlib
import shutil
from typing import Any

import pytest
import yaml
from tests.chart.helm import NON_DEFAULT_VALUES, by_kind, render
from tests.chart.prometheus_tools import promtool
from tests.chart.promql import disttrain_exported_names, metric_names

UNIT_TESTS = pathlib.Path(__file__).with_name("alert_rules_test.yaml")
ALERTS = {
    "DistTrainCheckpointTooOld",
    "DistTrainRestartBudgetNearlySpent",
    "DistTrainInfrastructureLossesNearLimit",
    "DistTrainStuckReforming",
}


def _rule_groups(values: dict[str, Any] | None) -> list[dict[str, Any]]:
    [rule] = by_kind(render(values), "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    return rule["spec"]["groups"]


def _write_rules(directory: pathlib.Path, groups: list[dict[str, Any]]) -> pathlib.Path:
    path = directory / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    return path


def test_off_by_default():
    assert not by_kind(render(), "PrometheusRule")


@pytest.mark.parametrize(
    "values", [{"prometheusRule": {"enabled": True}}, NON_DEFAULT_VALUES], ids=["default", "non-default"]
)
def test_promtool_check_rules_accepts_them(tmp_path, values):
    groups = _rule_groups(values)
    assert {rule["alert"] for group in groups for rule in group["rules"]} == ALERTS
    checked = promtool("check", "rules", str(_write_rules(tmp_path, groups)))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in checked.stdout, checked.stdout


def test_the_thresholds_come_from_the_values():
    rules = {rule["alert"]: rule for group in _rule_groups(NON_DEFAULT_VALUES) for rule in group["rules"]}
    assert "> 1800" in rules["DistTrainCheckpointTooOld"]["expr"]
    assert rules["DistTrainCheckpointTooOld"]["for"] == "10m"
    assert "> 0.5" in rules["DistTrainRestartBudgetNearlySpent"]["expr"]
    assert "> 0.75" in rules["DistTrainInfrastructureLossesNearLimit"]["expr"]
    assert rules["DistTrainStuckReforming"]["for"] == "30m"


def test_promtool_unit_tests_on_synthetic_series(tmp_path):
    _write_rules(tmp_path, _rule_groups({"prometheusRule": {"enabled": True}}))
    shutil.copy(UNIT_TESTS, tmp_path / UNIT_TESTS.name)
    tested = promtool("test", "rules", UNIT_TESTS.name, cwd=tmp_path)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout, tested.stdout


def test_every_alert_reads_only_series_disttrain_exports():
    exported = disttrain_exported_names()
    for group in _rule_groups({"prometheusRule": {"enabled": True}}):
        for rule in group["rules"]:
            names = metric_names(rule["expr"])
            assert names and names <= exported, (rule["alert"], names - exported)
