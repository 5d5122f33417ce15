"""Nodes that announce their end: which worker pods should be drained off their node before it goes.

A cordon (``kubectl cordon``, the first half of ``kubectl drain``), a scale-in or spot-interruption taint, or a
configured node condition says that a node will go while it still runs its pods. A worker there is a planned
departure, handled like a scale-down victim: the group checkpoints at the next step boundary and re-forms without
it, and its replacement is created elsewhere at once (``spec.elastic.departure``). Pure: reads views, decides nothing
else.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Optional

from disttrain.api.spec import DepartureSpec
from disttrain.operator.observed import NodeView, PodView


def node_departure(node: Optional[NodeView], rule: DepartureSpec) -> Optional[str]:
    """Why ``node`` announces its end under ``rule`` (a phrase for Events), or None. A node that is not Ready is a
    loss, never a departure: its pods cannot checkpoint any more."""
    if node is None or node.ready is not True:
        return None
    if rule.on_cordon and node.unschedulable:
        return "cordoned"
    taint = next((key for key in rule.taints if key in node.taints), None)
    if taint is not None:
        return f"taint {taint}"
    condition = next((kind for kind in rule.conditions if kind in node.conditions), None)
    if condition is not None:
        return f"condition {condition}=True"
    return None


def pod_departure(pod: PodView, nodes: Optional[Mapping[str, NodeView]], rule: DepartureSpec) -> Optional[str]:
    """Why worker ``pod`` is leaving with its node, or None. Only a pod that can still checkpoint departs: one that
    runs (or is being deleted gracefully, as ``kubectl drain``'s eviction does) on a Ready node."""
    if nodes is None or not pod.node_name or pod.is_finished or pod.phase != "Running":
        return None
    return node_departure(nodes.get(pod.node_name), rule)


def departure_message(pod: PodView, why: str) -> str:
    return (
        f"worker pod {pod.name} leaves with node {pod.node_name} ({why}): drained at the next step boundary and "
        "replaced elsewhere; not a restart"
    )
