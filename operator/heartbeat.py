"""Which worker pods the job agent reports silent in the rendezvous heartbeats (``status.silentNodes``).

Why a module of its own: the report is a second source of node loss beside Kubernetes' (a NotReady node comes
20-50 s after the node died; a silent heartbeat after ``keepAliveMaxAttempts x keepAliveIntervalSeconds``), and
it must never hit the wrong pod. An entry names the pod and its uid, so a report that outlived its pod (the
agent has not caught up yet, and a replacement took the name) matches nothing and is ignored. A pod that
already exited is judged by its exit, not by its silence. Pure; used by :mod:`disttrain.operator.reconcile`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Optional

from disttrain.api.status import SilentNode, StalledNode
from disttrain.operator.observed import PodView


def silent_pods(
    reports: Optional[Sequence[SilentNode]] | Optional[Sequence[StalledNode]], workers: Iterable[PodView]
) -> frozenset[str]:
    """Names of the running (or pending) worker pods the report names, by name and, when given, by uid."""
    if not reports:
        return frozenset()
    wanted = {(r.node, r.pod_uid) for r in reports}
    return frozenset(
        pod.name
        for pod in workers
        if not pod.is_finished and ((pod.name, pod.uid) in wanted or (pod.name, "") in wanted)
    )
