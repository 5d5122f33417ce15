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
    "customresourcedefinitions",
    "namespaces",
}
"""Everything the operator (kopf included) and the agents call; the API server's own loops (endpoints, leases,
API services) are left out."""
HARNESS_ONLY = {
    ("PATCH", "nodes", ""),
    ("PATCH", "nodes", "status"),
    ("PUT", "nodes", "status"),
    ("PATCH", "pods", "status"),
    ("POST", "pods", "binding"),
    ("PATCH", "disttrainjobs", "scale"),
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
    buckets: Buckets = collections.defaultdict(lambda: collections.defaultdict(float))
    for family in text_string_to_metric_families(metrics_text):
        if family.name != "apiserver_request_duration_seconds":
            continue
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                labels = sample.labels
                key = (labels.get("verb", ""), labels.get("resource", ""), labels.get("subresource", ""))
                buckets[key][float(labels["le"])] += sample.value
    return {key: dict(by_le) for key, by_le in buckets.items()}


def duration_quantile(before: Buckets, after: Buckets, key: RequestKey, q: float) -> float | None:
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
