"""The Grafana dashboard: every query is valid PromQL (promtool parses it as a recording rule) and reads only
series disttrain exports; the panels the platform team asked for are there; the JSON is one Grafana accepts
(datasource variable, unique ids, panels on the grid without overlap).

``tests/e2e/test_prometheus.py`` runs every query against a real Prometheus that scraped a job and requires data.
"""

from __future__ import annotations

import itertools

import pytest
import yaml
from tests.chart import dashboard
from tests.chart.prometheus_tools import promtool
from tests.chart.promql import disttrain_exported_names, metric_names

QUERIES = dashboard.queries()
VALUES = dashboard.grafana_values(
    namespace="team-a", job="demo", scrape_interval_s=30, range_s=6 * 3600, goodput_window="15m"
)


def test_every_query_is_valid_promql(tmp_path):
    """promtool check rules parses each expression (with Grafana's variables filled in) as PromQL."""
    rules = [
        {"record": f"dashboard:query_{i}", "expr": dashboard.fill(query.expr, VALUES)}
        for i, query in enumerate(QUERIES)
    ]
    path = tmp_path / "dashboard-rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    checked = promtool("check", "rules", str(path))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(QUERIES)} rules found" in checked.stdout


def test_an_invalid_query_would_be_refused(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(
        yaml.safe_dump(
            {"groups": [{"name": "x", "rules": [{"record": "x", "expr": "sum by (job (disttrain_job_world_size)"}]}]}
        )
    )
    assert promtool("check", "rules", str(path)).returncode != 0


@pytest.mark.parametrize("query", QUERIES, ids=lambda q: f"{q.panel}-{q.ref}")
def test_every_metric_a_query_names_is_exported(query):
    """Compared with the metrics of operator/metrics.py and trainer/metrics.py (what exists on a cluster)."""
    names = metric_names(query.expr)
    assert names, "a query that reads no metric"
    assert names <= disttrain_exported_names(), names - disttrain_exported_names()


def test_the_variable_queries_read_exported_series():
    for name, query in dashboard.variable_queries().items():
        assert query.startswith("label_values(") and query.endswith(")"), name
        selector = query[len("label_values(") : -1].rsplit(",", 1)[0]
        assert metric_names(selector) <= disttrain_exported_names(), name


def test_every_query_selects_the_chosen_namespace_and_job():
    """A query without the selector would mix every job of the cluster into one panel."""
    for query in QUERIES:
        for name in metric_names(query.expr):
            for at in _occurrences(query.expr, name):
                assert query.expr[at + len(name) :].startswith('{namespace=~"$namespace", job=~"$job"}'), query


def _occurrences(text: str, word: str) -> list[int]:
    found, start = [], 0
    while (at := text.find(word, start)) >= 0:
        end = at + len(word)
        if (at == 0 or not (text[at - 1].isalnum() or text[at - 1] == "_")) and (
            end == len(text) or not (text[end].isalnum() or text[end] == "_")
        ):
            found.append(at)
        start = end
    return found


def test_every_variable_a_query_uses_is_defined_or_a_grafana_builtin():
    for query in QUERIES:
        dashboard.fill(query.expr, VALUES)  # raises on an unknown variable
    defined = {v["name"] for v in dashboard.load()["templating"]["list"]}
    assert {"datasource", "namespace", "job", "goodput_window"} <= defined


def test_the_panels_the_platform_team_asked_for():
    """World size over time, reforms, restarts and infrastructure losses by reason, reform duration by phase,
    checkpoint age and step, samples/s, goodput and goodput by cause: each has a panel reading the series that tell
    it."""
    panels = {panel["title"]: panel for panel in dashboard.all_panels()}

    def reads(title: str) -> set[str]:
        return set().union(*(metric_names(t["expr"]) for t in panels[title]["targets"]))

    assert "disttrain_job_world_size" in reads("World size over time")
    losses = "Restarts and infrastructure losses by reason"
    assert {"disttrain_job_restarts_total", "disttrain_job_infrastructure_losses_total"} <= reads(losses)
    assert "disttrain_job_reforms_total" in reads("Reforms by reason")
    for title in (losses, "Reforms by reason"):
        assert all("by (namespace, job, reason)" in t["expr"] for t in panels[title]["targets"])
    for title in ("Reform duration by phase", "Reform duration by phase (time range)"):
        assert reads(title) & {
            "disttrain_job_reform_duration_seconds_sum",
            "disttrain_job_reform_duration_seconds_bucket",
        }
        assert all("phase" in t["expr"] for t in panels[title]["targets"])
    assert reads("Checkpoints: step and age") == {
        "disttrain_job_last_complete_checkpoint_step",
        "disttrain_job_checkpoint_age_seconds",
    }
    assert reads("Samples/s") == {"disttrain_trainer_samples_per_second"}
    assert reads("Goodput") == {"disttrain_job_samples_consumed", "disttrain_trainer_samples_per_second"}
    assert "Goodput" in panels["Goodput"]["description"] and "deriv" in panels["Goodput"]["description"]
    assert reads("Goodput by cause") == {"disttrain_job_goodput_seconds_total"}
    assert panels["Goodput by cause"]["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal"
    assert all("by (namespace, job, cause)" in t["expr"] for t in panels["Goodput by cause"]["targets"])
    assert reads("Goodput ratio by cause (time range)") == {
        "disttrain_job_goodput_seconds_total",
        "disttrain_job_goodput_ratio",
    }


def test_grafana_can_load_it():
    board = dashboard.load()
    assert board["uid"] and board["title"] and board["schemaVersion"] >= 36
    panels = dashboard.all_panels(board)
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids))
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["description"], panel["title"]
        refs = [target["refId"] for target in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
    cells = [
        {
            (x, y)
            for x in range(p["gridPos"]["x"], p["gridPos"]["x"] + p["gridPos"]["w"])
            for y in range(p["gridPos"]["y"], p["gridPos"]["y"] + p["gridPos"]["h"])
        }
        for p in panels
    ]
    assert all(p["gridPos"]["x"] + p["gridPos"]["w"] <= 24 for p in panels)
    for (i, a), (j, b) in itertools.combinations(enumerate(cells), 2):
        assert not a & b, (panels[i]["title"], panels[j]["title"])
