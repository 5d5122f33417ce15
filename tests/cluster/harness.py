"""What the real-control-plane tests (and ``bench/reform_cluster.py``) share: waiting, a namespace's helpers,
the checkpoint claim, and the silent-node scenario run on pods whose processes really run."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import itertools
import json
import re
import time
import urllib.error
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

from disttrain.api import constants
from disttrain.api.conditions import format_time
from tests.cluster.controlplane import REPO_ROOT, ControlPlane
from tests.cluster.kubelet import Kubelets
from tests.cluster.operator_process import OperatorProcess
from tests.cluster.process_kubelet import ProcessKubelets
from tests.cluster.rbac import OPERATOR_NAMESPACE, OPERATOR_SERVICE_ACCOUNT, install_operator_rbac
from tests.conftest import JobBuilder
from tests.e2e.conftest import e2e_job

T = TypeVar("T")


def eventually(check: Callable[[], T], timeout: float = 30, interval: float = 0.2, what: str = "") -> T:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"{what or 'condition'} not met within {timeout:.0f} s; last value: {last!r}")


def while_progressing(
    check: Callable[[], T],
    progress: Callable[[], Any],
    stall: float,
    interval: float = 0.5,
    what: str = "",
    seen: Callable[[], Any] = lambda: None,
) -> T:
    """:func:`eventually`, with a deadline that moves while the job moves: it fails once ``progress()`` (a step, the
    pods' phases) has not changed for ``stall`` seconds, saying ``seen()``. A loaded machine slows every step and
    start, which no fixed deadline fits; a job that is stuck still fails ``stall`` seconds after it stopped."""
    last_progress, moved = progress(), time.monotonic()
    last: Any = None
    while time.monotonic() - moved < stall:
        last = check()
        if last:
            return last
        time.sleep(interval)
        now_progress = progress()
        if now_progress != last_progress:
            last_progress, moved = now_progress, time.monotonic()
    raise AssertionError(f"{what or 'condition'}: no progress for {stall:.0f} s (at {last_progress!r}); {seen()}")


def job_state(cluster: Cluster, name: str) -> str:
    """What a failed wait reports: the job's status, its Events and its pods, for the cause (CI keeps no cluster)."""
    status = cluster.status(name)
    events = cluster.plane.request("GET", f"/api/v1/namespaces/{cluster.ns}/events")["items"]
    pods = {
        n: (p["metadata"]["uid"][:8], p["spec"].get("nodeName"), p["status"].get("phase"))
        for role in ("worker", "agent")
        for n, p in cluster.pods(role).items()
    }
    said = [f"{e['reason']}: {e['message']}" for e in events if e["involvedObject"].get("name") == name]
    return f"status {json.dumps(status)}; events {said}; pods {pods}"


def start_progress(cluster: Cluster, name: str) -> tuple[Any, ...]:
    """How far a job's start got: its pods' phases, its phase and step (for :func:`while_progressing`)."""
    pods = [*cluster.pods().values(), *cluster.pods("agent").values()]
    status = cluster.status(name)
    return (sorted(str(p.get("status", {}).get("phase")) for p in pods), status.get("phase"), status.get("step"))


class Cluster:
    """kubectl and REST helpers for one test's namespace and job."""

    def __init__(self, plane: ControlPlane, namespace: str, kubelets: Kubelets) -> None:
        self.plane, self.ns, self.kubelets = plane, namespace, kubelets
        self.tag = uuid.uuid4().hex[:6]

    def jobs(self, name: str = "", sub: str = "") -> str:
        path = f"/apis/{constants.GROUP}/{constants.VERSION}/namespaces/{self.ns}/{constants.PLURAL}"
        return path + (f"/{name}" if name else "") + (f"/{sub}" if sub else "")

    def apply(self, builder: JobBuilder, tmp: Path) -> dict[str, Any]:
        obj = builder.build()
        obj["metadata"]["namespace"] = self.ns
        manifest = tmp / f"{obj['metadata']['name']}.yaml"
        manifest.write_text(yaml.safe_dump(obj))
        self.plane.kubectl("apply", "--server-side", "-f", str(manifest))
        return self.job(obj["metadata"]["name"])

    def job(self, name: str) -> dict[str, Any]:
        return self.plane.request("GET", self.jobs(name))

    def status(self, name: str) -> dict[str, Any]:
        return self.job(name).get("status") or {}

    def pods(self, role: str = "worker") -> dict[str, dict[str, Any]]:
        items = self.plane.request("GET", f"/api/v1/namespaces/{self.ns}/pods")["items"]
        return {
            p["metadata"]["name"]: p for p in items if p["metadata"].get("labels", {}).get(constants.LABEL_ROLE) == role
        }

    def live_workers(self) -> dict[str, dict[str, Any]]:
        return {n: p for n, p in self.pods().items() if not p["metadata"].get("deletionTimestamp")}

    def phase(self, name: str, phase: str) -> dict[str, Any] | None:
        status = self.status(name)
        return status if status.get("phase") == phase else None

    def nodes(self, count: int) -> list[str]:
        names = [f"{self.tag}-n{i}" for i in range(count)]
        for node in names:
            self.kubelets.add_node(node)
        return names

    def agent_kubeconfig(self, job: str) -> Path:
        return self.plane.service_account_kubeconfig(self.ns, f"{job}-agent")

    def agent_reports(self, job: str, token_config: Path, **status: Any) -> None:
        """What the job agent relays, with the agent's own token (the per-job Role allows only this)."""
        self.plane.kubectl(
            "patch",
            "-n",
            self.ns,
            f"{constants.PLURAL}/{job}",
            "--subresource=status",
            "--type=merge",
            "-p",
            json.dumps({"status": status}),
            kubeconfig=token_config,
        )

    def running(
        self, job: str, builder: JobBuilder, tmp: Path, replicas: int, restart_policy: dict[str, Any] | None = None
    ) -> Path:
        """Apply, let the scheduler and the kubelets run every pod, report a first group: phase Running."""
        self.nodes(replicas + 2)
        self.apply(
            builder.nodes(1, 4, replicas)
            .set("spec.elastic", {"scaleDebounceSeconds": 0, "replacementWaitSeconds": 30})
            .set("spec.restartPolicy", restart_policy or {"maxRestarts": 5, "backoffSeconds": 0}),
            tmp,
        )
        eventually(lambda: len(self.pods("agent")) == 1 and len(self.live_workers()) == replicas, what="pods created")
        eventually(
            lambda: all(
                p["status"].get("phase") == "Running" for p in [*self.pods().values(), *self.pods("agent").values()]
            ),
            what="pods scheduled and running",
        )
        agent = eventually(lambda: _try(lambda: self.agent_kubeconfig(job)), what="agent ServiceAccount")
        self.agent_reports(
            job, agent, worldSize=replicas, step=3, rendezvousRound=1, lastProgressTime=format_time(time.time())
        )
        eventually(lambda: self.phase(job, "Running"), what="phase Running")
        return agent


def _try(fn: Callable[[], T]) -> T | None:
    try:
        return fn()
    except urllib.error.HTTPError as error:
        error.close()  # it holds the answer's TLS socket (a ResourceWarning when collected later)
        return None


def checkpoint_claim(controllers: ControlPlane, namespace: str, volume_root: Path) -> None:
    """The checkpoint claim the jobs name (``ckpt``), bound to a hostPath PersistentVolume at ``volume_root`` by the
    real PV controller, or the real scheduler would not place the workers."""
    # ServiceAccount admission refuses pods (403) until the controller created the namespace's "default" account.
    eventually(
        lambda: _try(lambda: controllers.request("GET", f"/api/v1/namespaces/{namespace}/serviceaccounts/default")),
        what="the namespace's default ServiceAccount",
    )
    volume = f"pv-{namespace}"
    controllers.request(
        "POST",
        "/api/v1/persistentvolumes",
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": volume},
            "spec": {
                "capacity": {"storage": "1Gi"},
                "accessModes": ["ReadWriteMany"],
                "storageClassName": "manual",
                "hostPath": {"path": str(volume_root)},
                "claimRef": {"namespace": namespace, "name": "ckpt"},
            },
        },
    )
    controllers.request(
        "POST",
        f"/api/v1/namespaces/{namespace}/persistentvolumeclaims",
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": "ckpt"},
            "spec": {
                "accessModes": ["ReadWriteMany"],
                "storageClassName": "manual",
                "volumeName": volume,
                "resources": {"requests": {"storage": "1Gi"}},
            },
        },
    )


def start_operator(plane: ControlPlane, log: Path, extra_args: Sequence[str] = ()) -> OperatorProcess:
    """The CRD as users apply it, the chart's RBAC and FlowSchema, and ``disttrain operator`` as a process logged in
    as the chart's ServiceAccount (what the benchmarks run against), with ``extra_args``."""
    plane.kubectl("apply", "--server-side", "-f", str(REPO_ROOT / "crds"))
    plane.wait_established(constants.CRD_NAME)
    install_operator_rbac(plane)
    operator = OperatorProcess(
        plane.service_account_kubeconfig(OPERATOR_NAMESPACE, OPERATOR_SERVICE_ACCOUNT), log, extra_args
    )
    operator.start(timeout=120)
    return operator


def delete_jobs(plane: ControlPlane, namespace: str) -> None:
    """Delete every DistTrainJob of ``namespace`` and wait until they are gone (before the test's kubelets stop, so
    that the operator does not go on replacing their pods on the next test's nodes)."""
    path = f"/apis/{constants.GROUP}/{constants.VERSION}/namespaces/{namespace}/{constants.PLURAL}"
    plane.request("DELETE", path)
    eventually(lambda: not plane.request("GET", path)["items"], timeout=60, what="jobs deleted")


PHASES = ("detection", "directive", "restart", "imports", "modelBuild", "processGroup", "checkpointLoad", "firstStep")
"""``status.lastReform.phases`` in order (they add up to ``total``)."""


@dataclasses.dataclass
class SilentNodeReform:
    """What the silent-node scenario saw."""

    victim: str
    detect_seconds: float
    """From the machine's death to the reform directive in the job's status."""
    control: dict[str, Any]
    """``status.control`` when the directive was first seen."""
    node_ready_at_directive: list[str]
    """The dead node's Ready condition status then (``["True"]``: Kubernetes had not noticed yet)."""
    status: dict[str, Any]
    """The status once the group trains at full size again (``lastReform.phases`` filled in)."""


def _is_ready(pod: dict[str, Any]) -> bool:
    return any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in pod.get("status", {}).get("conditions", [])
    )


def silent_node_reform(
    cluster: Cluster, tmp_path: Path, name: str = "hb", spares: int = 0, replacement_wait_s: int | str = 60
) -> SilentNodeReform:
    """A 3-node job of the e2e recorder trains on pods whose processes run (``ProcessKubelets``); the machine of a
    worker that does not host the agent dies (processes SIGKILLed, Lease no longer renewed); wait for the reform
    directive, then for training at 3 nodes again with the replacement. With ``spares``, the victim is a member
    of the round (``status.roundMembers``) and the loss comes once the spares are Ready. With
    ``replacement_wait_s`` 0 (``spec.elastic.replacementWaitSeconds``) the survivors re-form at 2 nodes at once:
    the reform waited for is that one; with ``auto``, the first reform at either size."""
    cluster.nodes(5 + spares)
    job = (
        e2e_job(name, tmp_path / "records", replicas=3, max_steps=5000, dataset=60_000, step_sleep=0.05)
        .set("spec.checkpoint", {"claimName": "ckpt", "path": "/ckpt", "intervalSteps": 5, "keep": 3})
        .set(
            "spec.elastic",
            {
                "scaleDebounceSeconds": 0,
                "replacementWaitSeconds": replacement_wait_s,
                "drainTimeoutSeconds": 60,
                "collectiveTimeoutSeconds": 20,
            },
        )
        .set("spec.restartPolicy", {"backoffSeconds": 0, "maxRestarts": 5})
    )
    if spares:
        job = job.set("spec.nodes.spares", spares)
    cluster.apply(job, tmp_path)

    def training(step: int) -> dict[str, Any] | None:
        status = cluster.status(name)
        if spares and len(status.get("roundMembers") or []) != 3:
            return None
        if spares and sum(_is_ready(p) for p in cluster.live_workers().values()) < 3 + spares:
            return None
        return status if status.get("phase") == "Running" and status.get("step", 0) >= step else None

    running = while_progressing(
        lambda: training(10),
        lambda: start_progress(cluster, name),
        stall=90,
        what="3 nodes training (real agent progress)",
        seen=lambda: job_state(cluster, name),
    )
    agent_node = cluster.pods("agent")[f"{name}-agent"]["spec"]["nodeName"]
    members = set(running.get("roundMembers") or cluster.live_workers())
    victim = next(p for n, p in cluster.live_workers().items() if p["spec"]["nodeName"] != agent_node and n in members)
    node = victim["spec"]["nodeName"]
    killed = time.monotonic()
    cluster.kubelets.power_off(node)

    def directive() -> dict[str, Any] | None:
        control = cluster.status(name).get("control") or {}
        return control if control.get("action") == "reform" else None

    control = eventually(directive, timeout=60, interval=0.1, what="a reform directive")
    detected = time.monotonic() - killed
    conditions = cluster.plane.request("GET", f"/api/v1/nodes/{node}")["status"]["conditions"]
    ready = [c["status"] for c in conditions if c["type"] == "Ready"]

    def reformed() -> dict[str, Any] | None:
        status = cluster.status(name)
        last = status.get("lastReform") or {}
        sizes = {2, 3} if replacement_wait_s == "auto" and not spares else {3} if replacement_wait_s or spares else {2}
        return status if status.get("phase") == "Running" and last.get("to") in sizes and last.get("phases") else None

    back = eventually(reformed, timeout=120, what="training again after the loss")
    return SilentNodeReform(victim["metadata"]["name"], detected, control, ready, back)


AGENT_POOL = "test.disttrain.dev/agent-pool"
"""Label of the nodes that host only job agents: no worker shares the agent's node."""


def reserve_agent_nodes(cluster: Cluster, builder: JobBuilder, count: int = 2) -> JobBuilder:
    """``count`` nodes labelled for job agents only (two: the replacement has a node to go to); the job's agent is
    pinned to them (spec.agent.nodeSelector) and its workers kept off them (the template's node affinity)."""
    for index in range(count):
        cluster.kubelets.add_node(f"{cluster.tag}-agents{index}", labels={AGENT_POOL: "true"})
    off_the_pool = {"matchExpressions": [{"key": AGENT_POOL, "operator": "DoesNotExist"}]}
    affinity = {
        "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [off_the_pool]}}
    }
    return builder.set("spec.agent", {"nodeSelector": {AGENT_POOL: "true"}}).set(
        "spec.template.spec.affinity", affinity
    )


def read_records(records: Path) -> list[dict[str, Any]]:
    """Every line the e2e recorder wrote (one per rank and executed step)."""
    found = []
    for path in sorted(records.glob("*.jsonl")):
        found += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return found


def step_times(records: list[dict[str, Any]]) -> dict[int, float]:
    """step -> when its first rank recorded it."""
    times: dict[int, float] = {}
    for record in records:
        times[record["step"]] = min(times.get(record["step"], record["time"]), record["time"])
    return times


@dataclasses.dataclass
class AgentNodeLoss:
    """What the agent-node-loss scenario saw. Times are this machine's ``time.time()``."""

    name: str
    max_steps: int
    powered_off_at: float
    node_not_ready_at: float
    """When the node-lifecycle controller's NotReady (or Unknown) was first seen."""
    agent_deleted_at: float
    """When the lost agent pod was first seen deleted (deletionTimestamp, gone, or replaced)."""
    agent_back_at: float
    """When the new agent pod was first seen Running."""
    before: dict[str, Any]
    """The job's status at the power-off."""
    status: dict[str, Any]
    """The job's status once Succeeded."""
    workers_before: dict[str, str]
    workers_when_back: dict[str, str]
    """Worker pod name -> uid at the power-off and once the new agent runs."""
    agent_uids: tuple[str, str]
    """The lost agent pod's uid and its replacement's."""
    records: list[dict[str, Any]] = dataclasses.field(repr=False)
    agent_log: str = dataclasses.field(repr=False)
    """Both agents' logs (one pod name, one file)."""
    worker_logs: str = dataclasses.field(repr=False)
    events: list[dict[str, Any]] = dataclasses.field(repr=False)

    @property
    def reconnected_at(self) -> float | None:
        """When the workers' last store client said it reconnected after a loss that the outage caused (the logs'
        stamps have millisecond resolution; a line says how long its client was away, so the loss time is known,
        and a reconnection at the job's end, after a loss of its own, is not counted)."""
        stamps = []
        for line in self.worker_logs.splitlines():
            away = re.search(r"reconnected after ([\d.]+) s", line)
            if away is None:
                continue
            with contextlib.suppress(ValueError):
                at = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
                if self.powered_off_at - 1 <= at - float(away.group(1)) <= self.agent_back_at:
                    stamps.append(at)
        return max(stamps) if stamps else None

    def steps_between(self, start: float, end: float) -> list[int]:
        return sorted(step for step, at in step_times(self.records).items() if start < at < end)

    def longest_step_gap(self, start: float, end: float) -> float:
        """The longest time between two consecutive steps of a pair that overlaps ``start``..``end`` (0 if none)."""
        times = sorted(step_times(self.records).values())
        return max((b - a for a, b in itertools.pairwise(times) if b > start and a < end), default=0.0)


def logs_of(cluster: Cluster, pod: str) -> str:
    """What the processes of ``pod`` wrote (every pod of that name, in order): only kubelets that run pods keep logs."""
    assert isinstance(cluster.kubelets, ProcessKubelets), "only ProcessKubelets run pods"
    return cluster.kubelets.log_of(pod)


def agent_node_loss(
    cluster: Cluster, tmp_path: Path, name: str = "agentnode", max_steps: int = 160, step_sleep: float = 0.25
) -> AgentNodeLoss:
    """A 2-node job of the e2e recorder trains on pods whose processes run (``ProcessKubelets``), its agent alone on
    a node of the agent pool; once it trains, that node dies (its processes SIGKILLed, its Lease no longer renewed).
    The scenario waits for the node-lifecycle controller, the replacement agent and the job's end, and returns what
    it saw. ``max_steps`` x ``step_sleep`` must outlast the 20 s grace period and the new agent's start."""
    cluster.nodes(2)
    records = tmp_path / "records"
    job = (
        e2e_job(name, records, replicas=2, max_steps=max_steps, dataset=max_steps * 12, step_sleep=step_sleep)
        .set("spec.checkpoint", {"claimName": "ckpt", "path": "/ckpt", "intervalSteps": 50, "keep": 2})
        .set("spec.restartPolicy", {"backoffSeconds": 0, "maxRestarts": 5})
    )
    cluster.apply(reserve_agent_nodes(cluster, job), tmp_path)

    def training() -> dict[str, Any] | None:
        status = cluster.status(name)
        return status if status.get("phase") == "Running" and status.get("step", 0) >= 5 else None

    before = (
        while_progressing(
            training,
            lambda: start_progress(cluster, name),
            stall=90,
            what="2 nodes training (real agent progress)",
            seen=lambda: job_state(cluster, name),
        )
        or {}
    )
    old = cluster.pods("agent")[f"{name}-agent"]
    node = old["spec"]["nodeName"]
    workers_before = {n: p["metadata"]["uid"] for n, p in cluster.live_workers().items()}
    assert node not in {p["spec"]["nodeName"] for p in cluster.live_workers().values()}, "a worker shares the node"
    powered_off_at = time.time()
    cluster.kubelets.power_off(node)

    seen: dict[str, Any] = {}

    def node_ready() -> str:
        conditions = cluster.plane.request("GET", f"/api/v1/nodes/{node}")["status"].get("conditions", [])
        return next((c["status"] for c in conditions if c["type"] == "Ready"), "")

    def back() -> bool:
        now = time.time()
        if "not_ready" not in seen and node_ready() != "True":
            seen["not_ready"] = now
        agent = cluster.pods("agent").get(f"{name}-agent")
        replaced = agent is None or agent["metadata"]["uid"] != old["metadata"]["uid"]
        if "deleted" not in seen and (replaced or (agent or {}).get("metadata", {}).get("deletionTimestamp")):
            seen["deleted"] = now
        if replaced and agent is not None and agent["status"].get("phase") == "Running":
            seen["back"] = now
            seen["new_uid"] = agent["metadata"]["uid"]
        return "back" in seen

    eventually(back, timeout=120, interval=0.1, what="a new agent pod running")
    workers_when_back = {n: p["metadata"]["uid"] for n, p in cluster.live_workers().items()}
    status = (
        while_progressing(
            lambda: cluster.phase(name, "Succeeded"),
            lambda: cluster.status(name).get("step"),
            stall=60,
            what="the job Succeeded",
            seen=lambda: job_state(cluster, name),
        )
        or {}
    )
    time.sleep(1)  # the last lines reach the logs
    events = cluster.plane.request("GET", f"/api/v1/namespaces/{cluster.ns}/events")["items"]
    return AgentNodeLoss(
        name=name,
        max_steps=max_steps,
        powered_off_at=powered_off_at,
        node_not_ready_at=seen.get("not_ready", float("nan")),
        agent_deleted_at=seen["deleted"],
        agent_back_at=seen["back"],
        before=before,
        status=status,
        workers_before=workers_before,
        workers_when_back=workers_when_back,
        agent_uids=(old["metadata"]["uid"], seen["new_uid"]),
        records=read_records(records),
        agent_log=logs_of(cluster, f"{name}-agent"),
        worker_logs="".join(logs_of(cluster, w) for w in sorted(workers_before)),
        events=[e for e in events if e["involvedObject"].get("name") == name],
    )
