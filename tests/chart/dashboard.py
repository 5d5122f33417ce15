"""The chart's Grafana dashboard as the tests see it: its queries, and each query with Grafana's variables filled in
the way Grafana would before sending it to Prometheus."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from tests.chart.helm import CHART

DASHBOARD = CHART / "dashboards" / "disttrain.json"
_VARIABLE = re.compile(r"\$\{(\w+)\}|\$(\w+)")


@dataclasses.dataclass(frozen=True)
class Query:
    panel: str
    ref: str
    expr: str

    def __str__(self) -> str:
        return f"{self.panel!r} {self.ref}: {self.expr}"


def load() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def queries(dashboard: dict[str, Any] | None = None) -> list[Query]:
    """Every panel target's PromQL, panels inside collapsed rows included."""
    dashboard = dashboard or load()
    found = []
    for panel in _panels(dashboard["panels"]):
        for target in panel.get("targets", []):
            found.append(Query(panel["title"], target["refId"], target["expr"]))
    return found


def variable_queries(dashboard: dict[str, Any] | None = None) -> dict[str, str]:
    """name -> the Grafana ``label_values(...)`` query of every query variable."""
    dashboard = dashboard or load()
    return {v["name"]: v["query"]["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"}


def _panels(panels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for panel in panels:
        out.append(panel)
        out.extend(_panels(panel.get("panels", [])))
    return out


def all_panels(dashboard: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    return _panels((dashboard or load())["panels"])


def fill(expr: str, values: dict[str, str]) -> str:
    """``expr`` with every ``$name`` / ``${name}`` replaced from ``values``; an unknown variable is an error (a
    typo in a dashboard variable leaves the panel empty in Grafana)."""

    def replace(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name not in values:
            raise KeyError(f"unknown dashboard variable ${name} in {expr}")
        return values[name]

    return _VARIABLE.sub(replace, expr)


def grafana_values(
    *, namespace: str, job: str, scrape_interval_s: float, range_s: float, goodput_window: str
) -> dict[str, str]:
    """What Grafana substitutes: the chosen variables, and its built-ins as it computes them for a panel
    (``$__rate_interval`` is at least four scrape intervals)."""
    return {
        "namespace": namespace,
        "job": job,
        "goodput_window": goodput_window,
        "__range": f"{int(range_s)}s",
        "__range_s": str(int(range_s)),
        "__interval": f"{int(max(1, scrape_interval_s))}s",
        "__rate_interval": f"{int(max(4 * scrape_interval_s, 1))}s",
    }
