"""What the API server itself counted: ``apiserver_request_total`` read from its ``/metrics``, split into the
requests disttrain makes (operator and job agents) and the benchmark's own (the simulated kubelets and the
scale requests).

The counter has no user label, so the split is by resource (the API server's own loops and the node Leases
the harness renews are not disttrain's) and by what only the harness does: it reports node and pod status
(``PATCH nodes``, ``PATCH pods/status``), binds pods (``pods/binding``) and scales jobs (``disttrainjobs/scale``).
disttrain never makes those calls, and the harness makes no other call during a measuring window (its one pod
watch stays open for the whole run, and a watch is counted when it ends).
"""

from __future__ import annotations

import collections
from collections.abc import Mapping

from prometheus_client.parser import text_string_to_metric_families

RequestKey = tuple[str, str, str]
"""(verb, resource, subresource)"""

DISTTRAIN_RESOURCES = {
    "disttrainjobs",
    "pods",
    "nodes",
    "events",
    "services",
    "serviceaccounts",
    "roles",
    "rolebindings",
    "secrets",
    "networkpolicies",
    "leases",
    "customresourcedefinitions",
    "namespaces",
}
"""Everything the operator (kopf included) and the agents call; the API server's own loops (endpoints, API
services) are left out. Of the Leases only the operator's calls count: the harness renews the nodes' Leases with
``PATCH``, which is also how a job agent renews its own (``trainer/agent/lease.py``); the benchmark's agents run no
renewer, so those writes are in no count (one per job and ``--agent-heartbeat-seconds``)."""
HARNESS_ONLY = {
    ("PATCH", "nodes", ""),
    ("PATCH", "nodes", "status"),
    ("PUT", "nodes", "status"),
    ("PATCH", "pods", "status"),
    ("POST", "pods", "binding"),
    ("PATCH", "disttrainjobs", "scale"),
    ("PATCH", "leases", ""),
}


def read_counts(metrics_text: str) -> dict[RequestKey, float]:
    """Requests by (verb, resource, subresource) since the API server started."""
    counts: dict[RequestKey, float] = collections.defaultdict(float)
    for family in text_string_to_metric_families(metrics_text):
        if family.name != "apiserver_request":
            continue
        for sample in family.samples:
            if sample.name != "apiserver_request_total":
                continue
            labels = sample.labels
            counts[labels.get("verb", ""), labels.get("resource", ""), labels.get("subresource", "")] += sample.value
    return dict(counts)


def is_disttrain(key: RequestKey) -> bool:
    """A request of the operator or a job agent (every request the harness makes is of another kind)."""
    _verb, resource, _subresource = key
    return resource in DISTTRAIN_RESOURCES and key not in HARNESS_ONLY


def disttrain_delta(before: Mapping[RequestKey, float], after: Mapping[RequestKey, float]) -> dict[RequestKey, float]:
    """disttrain's requests between two readings, only the kinds that occurred."""
    delta = {key: after[key] - before.get(key, 0.0) for key in after if is_disttrain(key)}
    return {key: value for key, value in delta.items() if value > 0}


def describe(key: RequestKey) -> str:
    verb, resource, subresource = key
    return f"{verb} {resource}{'/' + subresource if subresource else ''}"


Buckets = dict[RequestKey, dict[float, float]]
"""Cumulative counts of ``apiserver_request_duration_seconds`` by request kind and upper bound ``le``."""


def read_durations(metrics_text: str) -> Buckets:
    """The API server's own latency histogram, by (verb, resource, subresource), summed over scopes."""
    return read_histogram(metrics_text, "apiserver_request_duration_seconds", ("verb", "resource", "subresource"))


Histogram = dict[tuple[str, ...], dict[float, float]]
"""Cumulative bucket counts by label values and upper bound ``le``."""


def read_histogram(metrics_text: str, family_name: str, label_names: tuple[str, ...]) -> Histogram:
    """Cumulative bucket counts of the histogram ``family_name``, by the values of ``label_names`` (the other labels
    summed over)."""
    buckets: Histogram = collections.defaultdict(lambda: collections.defaultdict(float))
    for family in text_string_to_metric_families(metrics_text):
        if family.name != family_name:
            continue
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                key = tuple(sample.labels.get(name, "") for name in label_names)
                buckets[key][float(sample.labels["le"])] += sample.value
    return {key: dict(by_le) for key, by_le in buckets.items()}


WAIT_STAGES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("apiserver_flowcontrol_request_wait_duration_seconds", ("priority_level", "execute")),
    ("apiserver_flowcontrol_request_execution_seconds", ("priority_level", "type")),
    ("etcd_request_duration_seconds", ("operation", "type")),
)
"""Where a request's time goes inside the API server: queued by API Priority and Fairness (per priority level),
executing once dispatched, and the part of that spent waiting on etcd."""


def read_stages(metrics_text: str) -> dict[str, Histogram]:
    """The histograms of :data:`WAIT_STAGES`, by family."""
    return {family: read_histogram(metrics_text, family, labels) for family, labels in WAIT_STAGES}


def stage_lines(before: dict[str, Histogram], after: dict[str, Histogram], min_count: int = 20) -> list[str]:
    """One line per series of :data:`WAIT_STAGES` with at least ``min_count`` observations between two readings:
    its count, p50 and p99 (bucket upper bounds, seconds)."""
    lines = []
    for family, _labels in WAIT_STAGES:
        for key in sorted(after.get(family, {})):
            now, then = after[family][key], before.get(family, {}).get(key, {})
            count = max(now.values(), default=0.0) - max(then.values(), default=0.0)
            if count < min_count:
                continue
            p50, p99 = (duration_quantile(before.get(family, {}), after[family], key, q) for q in (0.5, 0.99))
            lines.append(f"  {family} {{{', '.join(key)}}}: {count:.0f}, p50 <= {p50} s, p99 <= {p99} s")
    return lines


def duration_quantile(before: Buckets, after: Buckets, key: tuple[str, ...], q: float) -> float | None:
    """The ``q`` quantile (seconds, the bucket's upper bound) of the requests of ``key`` between two readings."""
    now, then = after.get(key) or {}, before.get(key) or {}
    bounds = sorted(now)
    counts = [now[le] - then.get(le, 0.0) for le in bounds]
    if not counts or counts[-1] <= 0:
        return None
    for le, count in zip(bounds, counts, strict=True):
        if count >= q * counts[-1]:
            return le
    return None


def read_flows(metrics_text: str) -> dict[str, float]:
    """Requests dispatched by API Priority and Fairness since the API server started, by FlowSchema.

    Why: ``apiserver_request_total`` has no user label, but the chart's FlowSchemas do tell the callers apart:
    ``<release>`` matches the operator's ServiceAccount (all its requests) and ``<release>-progress`` the job
    agents' status writes, so the two split disttrain's requests between the operator and the agents."""
    flows: dict[str, float] = collections.defaultdict(float)
    for family in text_string_to_metric_families(metrics_text):
        if family.name != "apiserver_flowcontrol_dispatched_requests":
            continue
        for sample in family.samples:
            if sample.name == "apiserver_flowcontrol_dispatched_requests_total":
                flows[sample.labels.get("flow_schema", "")] += sample.value
    return dict(flows)
