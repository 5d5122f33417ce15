"""On the real-control-plane tier: what a node that announces its end costs a running job.

The control plane of ``tests/cluster`` (etcd, kube-apiserver, kube-controller-manager, kube-scheduler from
``../shared/k8s``), the real operator under the chart's RBAC, and kubelets that run every pod as local processes
(``tests/cluster/process_kubelet.py``: the real job agent, torchrun and trainer). A 2-node job of the e2e recorder
trains; then one worker's node (never the agent's) announces its end:

* ``drain``: ``kubectl drain`` of the node (cordon, then eviction); side by side with ``drain-old``, the same with
  ``spec.elastic.departure`` off (``onCordon: false``, no taints), which is the path before departures: the
  eviction is a lost pod, an infrastructure loss with a reform (no restart is charged for it either);
* ``scale-in``: the cluster autoscaler's ``ToBeDeletedByClusterAutoscaler`` taint.

Printed per scenario: ``noticed_seconds`` (the announcement -> a directive in the job's status),
``training_again_seconds`` (the announcement -> progress of the next rendezvous round), ``steps_lost`` (steps the
recorder saw executed more than once) and ``restarts`` (status.restarts.total at the end).

    python bench/departure_cluster.py [--scenarios drain,drain-old,scale-in]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import pathlib
import subprocess
import sys
import tempfile
import time
from typing import Any

from _clusterbench import run_namespace  # puts the repository on sys.path: the test tier's control plane
from tests.cluster.controlplane import KUBECTL, ControlPlane
from tests.cluster.harness import Cluster, eventually, start_operator
from tests.e2e.conftest import e2e_job

SCENARIOS = ("drain", "drain-old", "scale-in")
OLD_PATH = {"onCordon": False, "taints": []}
"""spec.elastic.departure that turns departures off: the operator's behaviour before them."""


@dataclasses.dataclass
class Outcome:
    scenario: str
    noticed_seconds: float
    training_again_seconds: float
    steps_lost: int
    restarts: int
    reason: str


def steps_run_twice(records: pathlib.Path) -> int:
    """Steps the e2e recorder saw executed by more than one group (work lost and redone)."""
    groups: dict[int, set[str]] = collections.defaultdict(set)
    for path in records.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                groups[record["step"]].add(record["group"])
    return sum(1 for seen in groups.values() if len(seen) > 1)


def run_scenario(cluster: Cluster, work: pathlib.Path, scenario: str) -> Outcome:
    name = scenario.replace("-", "")
    records = work / "records"
    cluster.nodes(4)
    elastic: dict[str, Any] = {"scaleDebounceSeconds": 0, "replacementWaitSeconds": 60, "drainTimeoutSeconds": 60}
    if scenario == "drain-old":
        elastic["departure"] = OLD_PATH
    job = (
        e2e_job(name, records, replicas=2, max_steps=100_000, dataset=600_000, step_sleep=0.05)
        .set("spec.checkpoint", {"claimName": "ckpt", "path": "/ckpt", "intervalSteps": 50, "keep": 3})
        .set("spec.elastic", elastic)
        .set("spec.restartPolicy", {"backoffSeconds": 0, "maxRestarts": 5})
    )
    cluster.apply(job, work)
    running = eventually(
        lambda: (s := cluster.status(name)).get("phase") == "Running" and s.get("step", 0) >= 20 and s,
        timeout=240,
        what="2 nodes training",
    )
    agent_node = cluster.pods("agent")[f"{name}-agent"]["spec"]["nodeName"]
    victim = next(p for _, p in sorted(cluster.live_workers().items()) if p["spec"]["nodeName"] != agent_node)
    node = victim["spec"]["nodeName"]
    first_round = running.get("rendezvousRound", 0)
    announced = time.monotonic()
    drain = None
    if scenario == "scale-in":
        cluster.plane.kubectl("taint", "nodes", node, f"ToBeDeletedByClusterAutoscaler={int(time.time())}:NoSchedule")
    else:
        drain = subprocess.Popen(
            [KUBECTL, f"--kubeconfig={cluster.plane.kubeconfig}", "drain", node, "--ignore-daemonsets", "--timeout=2m"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    control = eventually(
        lambda: (c := cluster.status(name).get("control") or {}).get("action") in ("drain", "reform") and c,
        timeout=120,
        interval=0.1,
        what="a directive",
    )
    noticed = time.monotonic() - announced

    def training_again() -> bool:
        status = cluster.status(name)
        return status.get("rendezvousRound", 0) > first_round and status.get("step", 0) > running["step"]

    eventually(training_again, timeout=180, interval=0.1, what="the next round training")
    again = time.monotonic() - announced
    time.sleep(3)  # the next round's steps reach the recorder's files
    if drain is not None:
        drain.wait(timeout=120)
    status = cluster.status(name)
    return Outcome(
        scenario,
        noticed,
        again,
        steps_run_twice(records),
        int((status.get("restarts") or {}).get("total", 0)),
        str(control.get("reason")),
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    args = parser.parse_args()
    scenarios = [s for s in args.scenarios.split(",") if s]
    unknown = set(scenarios) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenarios {sorted(unknown)}; allowed: {', '.join(SCENARIOS)}")
    work = pathlib.Path(tempfile.mkdtemp(prefix="disttrain-departure-"))
    began = time.time()
    outcomes = []
    with ControlPlane() as plane:
        plane.start_controllers()
        operator = start_operator(plane, work / "operator.log")
        try:
            for scenario in scenarios:
                with run_namespace(plane, work, f"dep-{scenario}") as (cluster, run_dir):
                    outcome = run_scenario(cluster, run_dir, scenario)
                outcomes.append(outcome)
                print(outcome, flush=True)
        finally:
            operator.kill()
    print(f"bench wall time {time.time() - began:.0f}s")
    print("| scenario | directive | noticed_seconds | training_again_seconds | steps_lost | restarts |")
    print("|---|---|---|---|---|---|")
    for o in outcomes:
        print(
            f"| {o.scenario} | {o.reason} | {o.noticed_seconds:.2f} | {o.training_again_seconds:.2f} | "
            f"{o.steps_lost} | {o.restarts} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
