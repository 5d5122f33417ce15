"""The restart budget is for the job's own failures, on the real control plane: a job with ``maxRestarts: 10`` loses
eleven worker nodes one after another (each machine dies: its kubelet stops, and the job agent reports the node
silent in the rendezvous heartbeats) and keeps training; the node hosting the agent and a worker loses power and
nothing is charged to ``maxRestarts``. Every loss is an infrastructure loss, none a restart, in the status,
``kubectl get dtj`` and the operator's metrics. The tests play the kubelets and the job agent
(:mod:`tests.cluster.harness`)."""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from disttrain.api.conditions import format_time
from disttrain.api.constants import LABEL_JOB_NAME, LABEL_ROLE, ROLE_WORKER
from tests.cluster.harness import Cluster, eventually
from tests.cluster.operator_process import OperatorProcess
from tests.cluster.tables import kubectl_table
from tests.conftest import JobBuilder

pytestmark = [pytest.mark.usefixtures("crd"), pytest.mark.timeout(240)]

LOSSES = 11


def lose_a_worker_node(cluster: Cluster, job: str, agent: Path, rendezvous_round: int) -> dict[str, Any]:
    """A worker's machine dies (not the agent's); the agent reports it silent; once the replacement runs, the agent
    reports the new group at 2 nodes. Returns the status back at Running."""
    agent_node = cluster.pods("agent")[f"{job}-agent"]["spec"]["nodeName"]
    victim = next(p for _, p in sorted(cluster.live_workers().items()) if p["spec"]["nodeName"] != agent_node)
    name, uid = victim["metadata"]["name"], victim["metadata"]["uid"]
    cluster.kubelets.power_off(victim["spec"]["nodeName"])
    silent = {"node": name, "podUid": uid, "lastHeartbeat": format_time(time.time() - 3)}
    cluster.agent_reports(job, agent, silentNodes=[silent])

    def replaced() -> dict[str, Any] | None:
        live = {n: p for n, p in cluster.live_workers().items() if n != name}
        running = len(live) == 2 and all(p["status"].get("phase") == "Running" for p in live.values())
        return live if running and name not in cluster.live_workers() else None

    eventually(replaced, what=f"{name} deleted and its replacement running")
    cluster.agent_reports(
        job,
        agent,
        silentNodes=[],
        worldSize=2,
        step=10 * rendezvous_round,
        rendezvousRound=rendezvous_round,
        lastProgressTime=format_time(time.time() + 1),
    )

    def trains_again() -> dict[str, Any] | None:
        status = cluster.status(job)
        settled = status.get("phase") == "Running" and status.get("control", {}).get("action") == "none"
        return status if settled and status.get("rendezvousRound") == rendezvous_round else None

    return eventually(trains_again, what=f"training at 2 nodes again after the loss of {name}")


def test_eleven_node_losses_with_max_restarts_10_keep_the_job_training(
    cluster: Cluster, operator: OperatorProcess, tmp_path: Path
) -> None:
    for index in range(LOSSES):  # a machine for each replacement
        cluster.kubelets.add_node(f"{cluster.tag}-spare{index}")
    one_per_machine = {  # each loss is one machine's and one worker's: the scheduler may not stack two workers
        "podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {
                    "labelSelector": {"matchLabels": {LABEL_JOB_NAME: "spot", LABEL_ROLE: ROLE_WORKER}},
                    "topologyKey": "kubernetes.io/hostname",
                }
            ]
        }
    }
    builder = JobBuilder("spot").set("spec.template.spec.affinity", one_per_machine)
    agent = cluster.running(
        "spot", builder, tmp_path, replicas=2, restart_policy={"maxRestarts": 10, "backoffSeconds": 0}
    )
    for loss in range(LOSSES):
        status = lose_a_worker_node(cluster, "spot", agent, rendezvous_round=loss + 2)
        assert status["restarts"] == {"total": 0, "byReason": {}}, status["restarts"]
        assert status["infrastructureLosses"]["total"] == loss + 1, status["infrastructureLosses"]

    final = cluster.status("spot")
    assert final["phase"] == "Running" and final["reforms"] == LOSSES, final
    assert final["restarts"] == {"total": 0, "byReason": {}}, final["restarts"]
    losses = final["infrastructureLosses"]
    assert losses["total"] == LOSSES and losses["byReason"] == {"HeartbeatLost": LOSSES}, losses
    assert len(losses["recent"]) == LOSSES, "the window holds every loss of the last hour"
    assert not any(c["type"] == "Failed" and c["status"] == "True" for c in final["conditions"]), final["conditions"]

    [row] = kubectl_table(cluster.plane.kubectl("get", "dtj", "-n", cluster.ns, "spot").stdout)
    assert row["RESTARTS"] == "0" and row["INFRA LOSSES"] == str(LOSSES), row

    with urllib.request.urlopen(f"http://127.0.0.1:{operator.metrics_port}/metrics", timeout=5) as response:
        metrics = response.read().decode()
    labels = f'job="spot",namespace="{cluster.ns}"'
    assert f'disttrain_job_infrastructure_losses_total{{{labels},reason="HeartbeatLost"}} {LOSSES}.0' in metrics
    assert f'disttrain_job_restarts_total{{{labels},reason="HeartbeatLost"}} 0.0' in metrics
    assert f"disttrain_job_infrastructure_losses_last_hour{{{labels}}} {LOSSES}.0" in metrics


SHARED_POOL = "test.disttrain.dev/shared-pool"
"""Label of the nodes the job agent may run on, which its worker prefers too: the two share a node."""


def test_the_node_of_the_agent_and_a_worker_loses_power_and_nothing_is_charged_to_max_restarts(
    cluster: Cluster, tmp_path: Path
) -> None:
    cluster.kubelets.add_node(f"{cluster.tag}-shared0", labels={SHARED_POOL: "true"})
    shared = {"matchExpressions": [{"key": SHARED_POOL, "operator": "In", "values": ["true"]}]}
    builder = (
        JobBuilder("both")
        .set("spec.agent", {"nodeSelector": {SHARED_POOL: "true"}, "avoidWorkers": False})
        .set(
            "spec.template.spec.affinity",
            {
                "nodeAffinity": {
                    "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 100, "preference": shared}]
                }
            },
        )
    )
    agent = cluster.running(
        "both", builder, tmp_path, replicas=1, restart_policy={"maxRestarts": 0, "backoffSeconds": 0}
    )
    node = cluster.pods("agent")["both-agent"]["spec"]["nodeName"]
    [(worker, pod)] = cluster.live_workers().items()
    assert pod["spec"]["nodeName"] == node, "the worker shares the agent's node"
    cluster.kubelets.add_node(f"{cluster.tag}-shared1", labels={SHARED_POOL: "true"})  # for the new agent
    cluster.kubelets.power_off(node)

    def both_replaced() -> bool:
        new_agent = cluster.pods("agent").get("both-agent")
        workers = [p for n, p in cluster.live_workers().items() if n != worker]
        return bool(
            new_agent
            and new_agent["spec"].get("nodeName") not in (None, node)
            and new_agent["status"].get("phase") == "Running"
            and workers
            and workers[0]["status"].get("phase") == "Running"
        )

    eventually(both_replaced, timeout=90, what="a new agent and a replacement worker running off the dead node")
    cluster.agent_reports(
        "both", agent, worldSize=1, step=20, rendezvousRound=2, lastProgressTime=format_time(time.time() + 1)
    )

    def trains_again() -> dict[str, Any] | None:
        status = cluster.status("both")
        settled = status.get("phase") == "Running" and status.get("control", {}).get("action") == "none"
        return status if settled and status.get("rendezvousRound") == 2 else None

    status = eventually(trains_again, what="training again")
    assert status["restarts"] == {"total": 0, "byReason": {}}, "maxRestarts: 0, and the job lives"
    losses = status["infrastructureLosses"]["byReason"]
    assert losses.get("AgentRestarted") == 1 and sum(losses.values()) == 2, losses
