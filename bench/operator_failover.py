"""On the real-control-plane tier: how long a job goes unserved when the operator's leader dies.

The control plane of ``tests/cluster`` (etcd, kube-apiserver, kube-controller-manager, kube-scheduler from
``../shared/k8s``), kubelets that only report pods Running (``tests/cluster/kubelet.py``), and two operator
replicas as the chart runs them: processes under the chart's RBAC with its leader-election flags and timings
(``tests/cluster/replicas.py``). Each round runs a 2-node job, then at the same instant SIGKILLs the leader (to the
API server, a node that lost power: its renewals stop) and fails one of the job's workers (exit 137). The killed
replica is started again as the standby for the next round.

Printed, over the rounds (median and max): ``lease_takeover_seconds`` (kill -> the standby holds the Lease),
``directive_after_kill_seconds`` (kill -> the job's reform directive, the loss counted),
``replacement_after_kill_seconds`` (kill -> the replacement worker created); side by side, in the same run,
``directive_without_failover_seconds``: the same worker loss with the leader alive. ``duplicates`` counts, over all
rounds, directives beyond one per loss, replacement pods beyond one, and Events written twice in a row.

    python bench/operator_failover.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import datetime
import pathlib
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.cluster: the control plane, operator processes and kubelets of the test tier

from tests.cluster.controlplane import ControlPlane  # noqa: E402
from tests.cluster.harness import Cluster, checkpoint_claim, delete_jobs, eventually  # noqa: E402
from tests.cluster.kubelet import Kubelets  # noqa: E402
from tests.cluster.rbac import install_operator_rbac  # noqa: E402
from tests.cluster.replicas import Replicas, job_events, repeated_events  # noqa: E402
from tests.conftest import REPO_ROOT, JobBuilder  # noqa: E402

from disttrain.api.conditions import format_time  # noqa: E402


def lose_a_worker(
    plane: ControlPlane, kubelets: Kubelets, work: pathlib.Path, name: str, kill: Callable[[], None]
) -> dict[str, float]:
    """Run job ``name`` on 2 nodes, in a namespace of its own, then ``kill()`` and fail worker 1 at once; seconds
    to each outcome, and the duplicates seen once the job runs again."""
    namespace = plane.create_namespace(f"failover-{name}")
    (work / namespace).mkdir()
    checkpoint_claim(plane, namespace, work / namespace)
    cluster = Cluster(plane, namespace, kubelets)
    try:
        return _lose_a_worker(cluster, work, name, kill)
    finally:
        delete_jobs(plane, namespace)


def _lose_a_worker(cluster: Cluster, work: pathlib.Path, name: str, kill: Callable[[], None]) -> dict[str, float]:
    agent = cluster.running(name, JobBuilder(name), work, replicas=2)
    before = cluster.status(name)
    began = time.monotonic()
    kill()
    cluster.kubelets.finish(f"{name}-worker-1", 137)
    seconds: dict[str, float] = {}
    directive = eventually(lambda: cluster.phase(name, "Reforming"), timeout=60, interval=0.05, what="a directive")
    seconds["directive"] = time.monotonic() - began
    eventually(lambda: f"{name}-worker-1-1" in cluster.live_workers(), timeout=60, interval=0.05, what="replaced")
    seconds["replacement"] = time.monotonic() - began
    eventually(lambda: cluster.pods()[f"{name}-worker-1-1"]["status"].get("phase") == "Running", what="running")
    cluster.agent_reports(
        name, agent, worldSize=2, step=9, rendezvousRound=2, lastProgressTime=format_time(time.time())
    )
    done = eventually(lambda: cluster.phase(name, "Running"), what="back to Running")
    time.sleep(1.5)  # whoever leads had time to act on everything it saw
    replacements = [p for p in cluster.pods() if p.startswith(f"{name}-worker-1-")]
    seconds["duplicates"] = (
        (done["control"]["generation"] - before["control"]["generation"] - 1)
        + (len(replacements) - 1)
        + len(repeated_events(job_events(cluster.plane, cluster.ns, name)))
    )
    assert directive["restarts"]["total"] == 1, directive
    return seconds


def summary(values: list[float]) -> str:
    return f"median {statistics.median(values):.2f} max {max(values):.2f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be 1 or more")
    work = pathlib.Path(tempfile.mkdtemp(prefix="disttrain-failover-"))
    began = time.time()
    takeover: list[float] = []
    after_kill: dict[str, list[float]] = {"directive": [], "replacement": []}
    alive: list[float] = []
    duplicates = 0
    with ControlPlane() as plane:
        plane.start_controllers()
        plane.kubectl("apply", "--server-side", "-f", str(REPO_ROOT / "crds"))
        plane.wait_established("disttrainjobs.disttrain.dev")
        install_operator_rbac(plane)
        replicas = Replicas(plane, work)
        replicas.start("op-a")
        eventually(lambda: replicas.holder() == "op-a", what="op-a leads")
        replicas.start("op-b")
        kubelets = Kubelets(plane)
        try:
            for round_ in range(args.rounds):
                seconds = lose_a_worker(plane, kubelets, work, f"alive{round_}", lambda: None)
                alive.append(seconds["directive"])
                duplicates += int(seconds["duplicates"])

                leader = replicas.holder()
                killed_at: list[float] = []

                def kill_the_leader(leader: str = leader, killed_at: list[float] = killed_at) -> None:
                    replicas.by_name[leader].kill()
                    killed_at.append(time.time())

                standby = replicas.other(leader)
                seconds = lose_a_worker(plane, kubelets, work, f"failover{round_}", kill_the_leader)
                eventually(lambda s=standby: replicas.holder() == s, timeout=60, what="the standby leads")
                takeover.append(took_over_at(replicas, standby) - killed_at[0])
                for key in after_kill:
                    after_kill[key].append(seconds[key])
                duplicates += int(seconds["duplicates"])
                replicas.start(leader)  # back, as the standby
                print(
                    f"round {round_}: takeover {takeover[-1]:.2f} s, directive {seconds['directive']:.2f} s "
                    f"(leader alive: {alive[-1]:.2f} s), replacement {seconds['replacement']:.2f} s",
                    flush=True,
                )
        finally:
            kubelets.stop()
            forbidden = replicas.stop()
    print(f"bench wall time {time.time() - began:.0f}s; logs in {work}")
    print(f"rounds: {args.rounds}")
    print(f"lease_takeover_seconds: {summary(takeover)}")
    print(f"directive_after_kill_seconds: {summary(after_kill['directive'])}")
    print(f"replacement_after_kill_seconds: {summary(after_kill['replacement'])}")
    print(f"directive_without_failover_seconds: {summary(alive)}")
    print(f"duplicates: {duplicates}")
    print(f"forbidden_lines: {len(forbidden)}")
    return 0


def took_over_at(replicas: Replicas, name: str) -> float:
    """When ``name`` last took the Lease (wall clock), from its own log line: the API is only polled here."""
    lines = [
        line for line in replicas.by_name[name].log_text().splitlines() if f"leader: {name} holds the Lease" in line
    ]
    stamp = datetime.datetime.strptime(lines[-1][:23], "%Y-%m-%d %H:%M:%S,%f")
    return stamp.timestamp()


if __name__ == "__main__":
    sys.exit(main())
