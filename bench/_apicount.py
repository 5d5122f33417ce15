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
