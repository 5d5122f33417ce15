"""Fluent builders and a tiny in-memory world for reconcile tests.

``World`` holds one job (wire form) and its pods and applies :class:`Actions` the way the kube adapter does
(status merge patch, deletions, creations), with a manual clock. It is a collaborator of the unit under
test (``reconcile``), never a replacement for it: every decision comes from the real core.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Optional

from disttrain.api import timestamps
from disttrain.api.spec import DistTrainJob
from disttrain.operator import agentbeat, names, patches
from disttrain.operator.observed import Actions, NodeView, Observed, PodView
from disttrain.operator.reconcile import reconcile

T0 = 1_700_000_000.0


def job_manifest(name: str = "demo", *, min: int = 1, max: int = 4, replicas: int = 2, **spec: Any) -> dict[str, Any]:
    """A valid DistTrainJob (global batch 24, micro 2: every node count 1..4 except none is fine in fixed mode)."""
    manifest: dict[str, Any] = {
        "apiVersion": "disttrain.dev/v1alpha1",
        "kind": "DistTrainJob",
        "metadata": {"name": name, "namespace": "default", "uid": "job-uid-1", "generation": 1},
        "spec": {
            "template": {
                "spec": {
                    "containers": [{"name": "trainer", "image": "example/trainer:1", "command": ["python", "train.py"]}]
                }
            },
            "nodes": {"min": min, "max": max, "replicas": replicas},
            "training": {"globalBatchSize": 24, "microBatchSize": 2, "lr": {"base": 0.1}, "maxSteps": 100},
            "checkpoint": {"claimName": "ckpt", "intervalSteps": 10},
            "elastic": {
                "scaleDebounceSeconds": 10,
                "replacementWaitSeconds": 30,
                "drainTimeoutSeconds": 120,
                "stuckPodTimeoutSeconds": 300,
                "pendingTimeoutSeconds": 600,
            },
            "restartPolicy": {"maxRestarts": 3, "backoffSeconds": 5, "maxBackoffSeconds": 60},
        },
    }
    for dotted, value in spec.items():
        node = manifest["spec"]
        *parents, last = dotted.split("__")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return manifest


def apply_merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 as the API server applies it, on a copy of ``patch`` (the world never shares the core's objects)."""
    return patches.apply_merge_patch(target, copy.deepcopy(patch))


@dataclasses.dataclass
class World:
    """One job, its pods and nodes, a clock; ``step()`` runs reconcile once and applies the actions."""

    manifest: dict[str, Any]
    now: float = T0
    workers: dict[str, PodView] = dataclasses.field(default_factory=dict)
    agent: Optional[PodView] = None
    nodes: Optional[dict[str, NodeView]] = None
    last: Optional[Actions] = None
    events: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    uid_counter: int = 0
    auto_schedule: bool = True
    refused: Optional[str] = None
    """What the API server answered the last refused pod creation (the adapter's memory)."""
    beats: agentbeat.AgentBeats = dataclasses.field(default_factory=agentbeat.AgentBeats)
    """The agent's Lease renewals as the adapter saw them (the world's clock stands for its monotonic one)."""

    @property
    def name(self) -> str:
        return self.manifest["metadata"]["name"]

    @property
    def status(self) -> dict[str, Any]:
        return self.manifest.setdefault("status", {})

    def observed(self) -> Observed:
        key = (self.manifest["metadata"].get("namespace", "default"), self.name)
        return Observed(
            workers=tuple(self.workers.values()),
            agent=self.agent,
            nodes=self.nodes,
            refused=self.refused,
            agent_silence=self.beats.silence(key, self.agent, self.now),
        )

    def renew_agent_lease(self) -> World:
        """The current agent renews its Lease now (the Lease watch delivers it at once)."""
        assert self.agent is not None
        key = (self.manifest["metadata"].get("namespace", "default"), self.name)
        lease = {"spec": {"holderIdentity": self.agent.uid, "renewTime": f"renewed at {self.now}"}}
        self.beats.renewed(key, lease, self.now)
        return self

    def agent_pulses(self) -> World:
        """The current agent pulses now (its connection delivers it at once)."""
        assert self.agent is not None
        key = (self.manifest["metadata"].get("namespace", "default"), self.name)
        self.beats.pulsed(key, self.agent.uid, self.now)
        return self

    def step(self, seconds: float = 0.0) -> Actions:
        self.now += seconds
        actions = reconcile(DistTrainJob.model_validate(self.manifest), self.observed(), self.now)
        self.manifest["status"] = apply_merge_patch(self.manifest.get("status") or {}, dict(actions.status_patch))
        assert self.manifest["status"] == dict(actions.status), "status patch must reproduce the full status"
        for deletion in actions.delete_pods:
            pod = self.workers.get(deletion.name) or (
                self.agent if self.agent and self.agent.name == deletion.name else None
            )
            if pod is None:
                continue
            if deletion.force or pod.phase in ("Failed", "Succeeded", "Pending") or not pod.node_name:
                self._remove(deletion.name)
            else:
                self._replace(pod, deleting_since=self.now)
        for worker in actions.create_workers:
            assert worker.name not in self.workers, f"reconcile asked to create {worker.name} which exists"
            self.workers[worker.name] = PodView(
                name=worker.name, uid=self._uid(), node_index=worker.node_index, created_at=self.now
            )
        if actions.create_agent:
            assert self.agent is None
            self.agent = PodView(name=names.agent_name(self.name), uid=self._uid(), created_at=self.now)
        self.events.extend((e.reason, e.message) for e in actions.events)
        self.last = actions
        return actions

    # -- the cluster's side
    def _uid(self) -> str:
        self.uid_counter += 1
        return f"uid-{self.uid_counter}"

    def _remove(self, name: str) -> None:
        if self.agent is not None and self.agent.name == name:
            self.agent = None
        else:
            self.workers.pop(name, None)

    def _replace(self, pod: PodView, **changes: Any) -> None:
        new = dataclasses.replace(pod, **changes)
        if self.agent is not None and pod.name == self.agent.name:
            self.agent = new
        else:
            self.workers[pod.name] = new

    def run_all(self) -> World:
        """Schedule and start every Pending pod (worker and agent) on node-<index>."""
        for pod in list(self.workers.values()):
            if pod.phase == "Pending" and not pod.is_terminating:
                self._replace(pod, phase="Running", ready=True, ready_at=self.now, node_name=f"node-{pod.node_index}")
        if self.agent is not None and self.agent.phase == "Pending":
            self._replace(self.agent, phase="Running", ready=True, node_name="node-agent")
        return self

    def worker(self, index: int) -> PodView:
        """The live pod of node ``index`` (the newest, when a lost one still lingers with the same index)."""
        pods = [p for p in self.workers.values() if p.node_index == index]
        live = [p for p in pods if not p.is_terminating and p.phase not in ("Failed", "Succeeded")]
        return max(live or pods, key=lambda p: int(p.uid.split("-")[-1]))

    def set_worker(self, index: int, **changes: Any) -> World:
        self._replace(self.worker(index), **changes)
        return self

    def vanish(self, index: int) -> World:
        self.workers.pop(self.worker(index).name)
        return self

    def finish_terminations(self) -> World:
        for pod in [p for p in self.workers.values() if p.is_terminating]:
            self._remove(pod.name)
        if self.agent is not None and self.agent.is_terminating:
            self.agent = None
        return self

    def progress(self, nodes: int, step: int, *, nproc: int = 1, same_round: bool = False) -> World:
        """The agent relays a progress report at ``nodes`` nodes: of a new rendezvous round (its first report), or,
        with ``same_round``, of the group that is already running."""
        now = timestamps.format_time(self.now)
        self.status.update(worldSize=nodes * nproc, step=step, samplesConsumed=step * 24, lastProgressTime=now)
        if not same_round:
            self.status.update(rendezvousRound=self.status.get("rendezvousRound", 0) + 1, roundStartTime=now)
        return self

    def checkpoint(self, step: int) -> World:
        self.status["lastCheckpoint"] = {
            "step": step,
            "samples": step * 24,
            "path": f"/ckpt/step-{step}",
            "time": timestamps.format_time(self.now),
            "worldSize": self.status.get("worldSize", 0),
        }
        return self

    def spec(self, dotted: str, value: Any) -> World:
        node = self.manifest["spec"]
        *parents, last = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
        return self

    # -- reading
    def condition(self, type_: str) -> Optional[dict[str, Any]]:
        return next((c for c in self.status.get("conditions", []) if c.get("type") == type_), None)

    def reasons(self) -> list[str]:
        return [reason for reason, _ in self.events]

    def infrastructure_losses(self) -> dict[str, Any]:
        """``status.infrastructureLosses`` without the window's times: total and byReason."""
        counts = self.status.get("infrastructureLosses", {})
        return {"total": counts.get("total", 0), "byReason": counts.get("byReason", {})}

    @property
    def control(self) -> dict[str, Any]:
        return self.status.get("control", {})

    def assert_reformed_without(self, actions: Actions, pod: PodView, reason: str) -> None:
        """The group re-forms for ``reason`` without ``pod``: fenced out of the next round, its pod deleted."""
        assert self.control["action"] == "reform" and self.control["reason"] == reason
        assert pod.name in self.control["exclude"], "fenced: kept out of the next rendezvous round"
        assert [(d.name, d.reason) for d in actions.delete_pods] == [(pod.name, reason)]

    def running_world(self, nodes: int = 2) -> World:
        """Helper: create the job, run every pod and report progress at ``nodes`` nodes."""
        self.step()
        self.run_all()
        self.step()
        self.progress(nodes, step=5)
        self.step()
        return self
