"""The metric names a PromQL expression reads, and the names disttrain exports: so a test can tell that a dashboard
or an alert only asks for series that exist.

Not a PromQL parser (promtool and a real Prometheus judge syntax): a scanner that skips strings, label matchers
``{...}``, ranges ``[...]``, the label lists after ``by``/``without``/``on``/``ignoring``/``group_*``, numbers and
durations, calls and aggregations; every other identifier is a metric name.
"""

from __future__ import annotations

import re

from prometheus_client import CollectorRegistry

KEYWORDS = frozenset(
    {
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "bool",
        "offset",
        "and",
        "or",
        "unless",
        "atan2",
        "inf",
        "nan",
    }
)
LABEL_LIST_KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
_IDENTIFIER = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_NUMBER = re.compile(r"[0-9.][0-9A-Za-z.+]*")
_CLOSING = {"{": "}", "[": "]", "(": ")"}
_GROUPING_CLAUSE = re.compile(r"(by|without)\s*\(", re.IGNORECASE)


def _skip_group(text: str, start: int) -> int:
    """Index after the bracket group opening at ``start`` (strings inside are skipped whole)."""
    opening, depth, i = text[start], 0, start
    while i < len(text):
        char = text[i]
        if char in "\"'`":
            i = _skip_string(text, i)
            continue
        if char == opening:
            depth += 1
        elif char == _CLOSING[opening]:
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    raise ValueError(f"unbalanced {opening!r} at {start} in {text!r}")


def _skip_string(text: str, start: int) -> int:
    quote, i = text[start], start + 1
    while i < len(text):
        if text[i] == "\\" and quote != "`":
            i += 2
            continue
        if text[i] == quote:
            return i + 1
        i += 1
    raise ValueError(f"unterminated string at {start} in {text!r}")


def metric_names(expr: str) -> set[str]:
    """Every metric name the expression selects (``name{...}``, ``name[5m]`` or a bare ``name``)."""
    names: set[str] = set()
    i = 0
    while i < len(expr):
        char = expr[i]
        if char in "\"'`":
            i = _skip_string(expr, i)
        elif char in "{[":
            i = _skip_group(expr, i)
        elif _NUMBER.match(expr, i) and (i == 0 or not (expr[i - 1].isalnum() or expr[i - 1] in "_:")):
            i = _NUMBER.match(expr, i).end()
        elif match := _IDENTIFIER.match(expr, i):
            word, i = match.group(), match.end()
            rest = expr[i:].lstrip()
            if word.lower() in LABEL_LIST_KEYWORDS and rest.startswith("("):
                i = _skip_group(expr, len(expr) - len(rest))
            elif word.lower() in KEYWORDS or rest.startswith("(") or _GROUPING_CLAUSE.match(rest):
                continue  # a keyword, a call, or an aggregation written ``sum by (...) (...)``
            else:
                names.add(word)
        else:
            i += 1
    return names


def exported_names(*registries: CollectorRegistry) -> set[str]:
    """The series names the registries' metrics expose: a gauge's own name, a counter's ``_total``, a
    histogram's ``_bucket``/``_sum``/``_count`` (prometheus-client's ``_created`` companions left out)."""
    suffixes = {
        "gauge": ("",),
        "counter": ("_total",),
        "histogram": ("_bucket", "_sum", "_count"),
        "summary": ("", "_sum", "_count"),
        "info": ("_info",),
    }
    return {
        family.name + suffix
        for registry in registries
        for family in registry.collect()
        for suffix in suffixes[family.type]
    }


def disttrain_exported_names() -> set[str]:
    """Everything the operator (operator/metrics.py) and every worker (trainer/metrics.py) export on a cluster."""
    from disttrain.operator.metrics import OperatorMetrics
    from disttrain.trainer.metrics import TrainerMetrics

    operator_registry = CollectorRegistry()
    OperatorMetrics(operator_registry)
    return exported_names(operator_registry, TrainerMetrics().registry)
