"""Nodes that announce their end, on the real control plane: ``kubectl drain`` (with a PodDisruptionBudget that
would block its evictions forever) and the cluster autoscaler's scale-in taint. The worker is drained off its node
only after a checkpoint (no step lost), replaced on another node, and no restart is charged. The tests play the
kubelets and the job agent (:mod:`tests.cluster.harness`)."""

from __future__ import annotations

import json
import subprocess
import time
from typing import Any

import pytest

from disttrain.api import constants
from disttrain.api.conditions import format_time
from tests.cluster.controlplane import KUBECTL
from tests.cluster.harness import Cluster, eventually
from tests.conftest import JobBuilder

pytestmark = [pytest.mark.usefixtures("crd"), pytest.mark.timeout(180)]


def worker_off_the_agents_node(cluster: Cluster) -> tuple[str, str]:
    """A worker pod and its node, where the job agent does not run (``kubectl drain`` would evict the agent too)."""
    agent_node = next(iter(cluster.pods("agent").values()))["spec"]["nodeName"]
    pod = next(p for _, p in sorted(cluster.pods().items()) if p["spec"]["nodeName"] != agent_node)
    return pod["metadata"]["name"], pod["spec"]["nodeName"]


def drained_off(cluster: Cluster, job: str, agent: Any, victim: str, node: str) -> dict[str, Any]:
    """The departure's whole course: a NodeDeparting drain that keeps the victim until a checkpoint, its replacement
    on another node, the group at 1 node and then back at 2, nothing charged. Returns the final status."""
    drain = eventually(lambda: cluster.phase(job, "Reforming"), what="the NodeDeparting drain")
    assert drain["control"]["action"] == "drain" and drain["control"]["reason"] == "NodeDeparting", drain["control"]
    assert drain["control"]["exclude"] == [victim] and drain["control"]["targetNodes"] == 1
    assert drain["restarts"]["total"] == 0
    time.sleep(2)
    assert victim in cluster.live_workers(), "the leaving worker waits for the drain's checkpoint: no step is lost"
    replacement = eventually(
        lambda: (
            next((p for n, p in cluster.live_workers().items() if n != victim and p["spec"].get("nodeName")), None)
            if len(cluster.live_workers()) == 3
            else None
        ),
        what="a replacement created at once",
    )
    assert replacement["spec"]["nodeName"] != node, "the replacement avoids the leaving node"
    cluster.agent_reports(job, agent, lastCheckpoint={"step": 10, "time": format_time(time.time() + 1)})
    eventually(lambda: victim not in cluster.pods(), what="the leaving worker deleted after the checkpoint")
    cluster.agent_reports(
        job, agent, worldSize=1, step=11, rendezvousRound=2, lastProgressTime=format_time(time.time() + 2)
    )
    eventually(
        lambda: (s := cluster.status(job)).get("control", {}).get("reason") == "ScaledUp" and s,
        what="the group grows back once the replacement runs",
    )
    cluster.agent_reports(
        job,
        agent,
        lastCheckpoint={"step": 12, "time": format_time(time.time() + 3)},
        worldSize=2,
        step=13,
        rendezvousRound=3,
        lastProgressTime=format_time(time.time() + 4),
    )
    done = eventually(lambda: cluster.phase(job, "Running"), what="Running at 2 nodes")
    assert done["restarts"]["total"] == 0 and done["worldSize"] == 2
    assert done["infrastructureLosses"]["byReason"] == {"NodeDeparting": 1}, done["infrastructureLosses"]
    events = cluster.plane.request("GET", f"/api/v1/namespaces/{cluster.ns}/events")["items"]
    assert any(e["reason"] == "NodeDeparting" and victim in e["message"] for e in events)
    return done


def test_kubectl_drain_of_a_workers_node_is_a_drain_not_a_restart_and_no_pdb_blocks_it(cluster, tmp_path):
    agent = cluster.running("kd", JobBuilder("kd"), tmp_path, replicas=2)
    # A budget that no eviction of the job's workers can ever satisfy: kubectl drain alone would retry forever.
    budget = {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": "kd-workers", "namespace": cluster.ns},
        "spec": {
            "minAvailable": 2,
            "selector": {"matchLabels": {constants.LABEL_JOB_NAME: "kd", constants.LABEL_ROLE: constants.ROLE_WORKER}},
        },
    }
    cluster.plane.kubectl("apply", "-f", "-", input=json.dumps(budget))
    victim, node = worker_off_the_agents_node(cluster)
    # --delete-emptydir-data as an operator drains a shared node: another test's operator pod (an emptyDir) may
    # have been scheduled there, and without it kubectl refuses the whole node (seen in a full run).
    command = ["drain", node, "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=120s"]
    drain = subprocess.Popen(
        [KUBECTL, f"--kubeconfig={cluster.plane.kubeconfig}", *command],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        drained_off(cluster, "kd", agent, victim, node)
        output, _ = drain.communicate(timeout=60)
    finally:
        drain.kill()
    assert drain.returncode == 0, f"kubectl drain did not finish:\n{output}"
    assert "drained" in output


def test_a_node_tainted_for_scale_in_by_the_cluster_autoscaler_is_drained_first(cluster, tmp_path):
    agent = cluster.running("ca", JobBuilder("ca"), tmp_path, replicas=2)
    victim, node = worker_off_the_agents_node(cluster)
    cluster.plane.kubectl("taint", "nodes", node, f"ToBeDeletedByClusterAutoscaler={int(time.time())}:NoSchedule")
    drained_off(cluster, "ca", agent, victim, node)
