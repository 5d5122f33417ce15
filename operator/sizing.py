"""How many nodes, which ones and where: the sizing rules of the reconcile core, pure.

The desired node count (clamped to the node range, snapped to a count valid for the batch contract, debounced),
the restart backoff, scale-down victims, the node indices new pods take and the nodes they must avoid.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Optional, TypedDict

from disttrain.api import timestamps
from disttrain.api.conditions import Reason
from disttrain.api.plan import valid_node_counts
from disttrain.api.spec import DistTrainJobSpec
from disttrain.operator.losses import loss_reason, node_loss_reason
from disttrain.operator.observed import NodeView, PodView


class PendingScaleWire(TypedDict):
    """``status.pendingScale`` on the wire: a scale request waiting out the debounce."""

    replicas: int
    since: str


def clamp_nodes(spec: DistTrainJobSpec, requested: int) -> int:
    """``requested`` limited to [nodes.min, nodes.max]."""
    return max(spec.nodes.min, min(spec.nodes.max, requested))


def snap_to_valid(spec: DistTrainJobSpec, count: int, *, allow_up: bool = True) -> Optional[int]:
    """The largest valid node count <= ``count``; if none and ``allow_up``, the smallest valid one above it.

    Valid means within [min, max] and dividing the batch contract (``plan.valid_node_counts``).
    """
    valid = valid_node_counts(spec)
    below = [n for n in valid if n <= count]
    if below:
        return below[-1]
    if allow_up:
        above = [n for n in valid if n > count]
        return above[0] if above else None
    return None


def debounce_scale(
    current: int, requested: int, pending: Optional[PendingScaleWire], debounce_s: float, now: float
) -> tuple[int, Optional[PendingScaleWire]]:
    """(desired now, pendingScale to keep). A request must stand ``debounce_s`` before it takes effect.

    ``current`` 0 means the job has no size yet: the request applies at once.
    """
    if current == 0 or requested == current:
        return requested if current == 0 else current, None
    if pending is not None and pending["replicas"] == requested:
        since = timestamps.parse_time(pending["since"]) or now
        if now - since >= debounce_s:
            return requested, None
        return current, pending
    if debounce_s <= 0:
        return requested, None
    return current, {"replicas": requested, "since": timestamps.format_time(now)}


def backoff_seconds(spec: DistTrainJobSpec, consecutive_failures: int) -> float:
    """Delay before restarting after the n-th consecutive failure: backoff x 2^(n-1), capped."""
    policy = spec.restart_policy
    if consecutive_failures <= 0:
        return 0.0
    return min(policy.max_backoff_seconds, policy.backoff_seconds * 2.0 ** min(consecutive_failures - 1, 30))


def choose_victims(live: Iterable[PodView], count: int) -> list[PodView]:
    """Pods to remove on scale-down: not-running ones first (they hold no work), then the highest index.

    The lowest index usually hosts rank 0; keeping it avoids moving rank-0-only duties without need.
    """
    ordered = sorted(live, key=lambda p: (p.is_running and p.ready, p.is_running, -p.node_index))
    return ordered[:count]


def free_indices(
    existing: Iterable[PodView],
    count: int,
    nodes: Optional[Mapping[str, NodeView]] = None,
    lost: Iterable[str] = (),
) -> list[int]:
    """The ``count`` lowest node indices that no live worker pod holds.

    A lost pod (:func:`loss_reason`, or named in ``lost``: silent in the heartbeats) frees its index even while
    the pod still exists, so its replacement takes that index and, through the rendezvous handler's rank order,
    the lost node's ranks.
    """
    gone = frozenset(lost)
    taken = {p.node_index for p in existing if loss_reason(p, nodes) is None and p.name not in gone}
    found: list[int] = []
    index = 0
    while len(found) < count:
        if index not in taken:
            found.append(index)
        index += 1
    return found


def nodes_to_avoid(
    workers: Sequence[PodView],
    *,
    silent: Collection[str],
    lost: Collection[str],
    nodes: Optional[Mapping[str, NodeView]] = None,
) -> tuple[str, ...]:
    """Nodes a new worker must not land on: where a pod went silent in the rendezvous heartbeats, where a pod
    declared lost lingers Terminating (no kubelet confirms its deletion), or where a worker's node is NotReady or
    unreachable. Kubernetes may still read a silent node Ready for its whole grace period, and it taints an
    unreachable one NoSchedule only some moments after its Ready turned Unknown; meanwhile the scheduler would place
    the replacement there, to be lost again (seen on the real control plane: the replacement of a HeartbeatLost pod
    went to the dead node, and its NodeUnreachable loss 20 s later cost a second restart)."""
    unready = (Reason.NODE_NOT_READY, Reason.NODE_UNREACHABLE)
    return tuple(
        sorted(
            {
                p.node_name
                for p in workers
                if p.node_name
                and (
                    p.name in silent
                    or (p.is_terminating and p.name in lost)
                    or node_loss_reason(p.node_name, nodes) in unready
                )
            }
        )
    )


def world_column(world_size: int, desired_world_size: int) -> str:
    """``status.world``, the WORLD column of ``kubectl get dtj``: the running group's world size / the desired."""
    return f"{world_size}/{desired_world_size}"
