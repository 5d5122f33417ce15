"""On the real-control-plane tier: what losing the job agent's node costs a running job.

The control plane of ``tests/cluster`` (etcd, kube-apiserver, kube-controller-manager with node-monitor-grace-period
20 s, kube-scheduler from ``../shared/k8s``), the real operator under the chart's RBAC, and kubelets that run every
pod as local processes (``tests/cluster/process_kubelet.py``: the real job agent, torchrun and trainer). A 2-node job
of the e2e recorder trains with its agent alone on a node of an agent pool; that node dies (its processes SIGKILLed,
its Lease no longer renewed). The scenario is ``tests.cluster.harness.agent_node_loss``, the one
``tests/cluster/test_agent_node_loss.py`` asserts on. Printed per run, all from the power-off:

* ``noticed_seconds``: -> the lost agent pod deleted by the operator (it emits ``AgentRestarted`` then): the
  agent's pulse silent for a second (the default); with ``--agent-pulse-seconds=0``, its Lease silent for three
  renewal periods; on the old path (no pulse, ``--agent-heartbeat-seconds=0``), the node's NotReady after the
  node-lifecycle controller's grace period;
* ``agent_back_seconds``: -> the new agent pod Running;
* ``reconnected_seconds``: -> the last "reconnected after" line of the workers' store clients (their logs);
* ``longest_step_gap_seconds``: the largest gap between two consecutive steps recorded from the power-off to the
  reconnection, beside ``median_step_seconds`` over the whole run: whether training paused;
* ``steps_during_outage``: steps recorded between the power-off and the new agent's Running;
* ``steps_lost``: steps run more than once or never; ``restarts``: status.restarts.total at the end.

Each run is made with the agent's pulse (the default), with its Lease alone and on the old path, one after the other
on the same control plane (``--paths`` picks some).

    python bench/agent_loss_cluster.py [--runs 2] [--max-steps 160] [--step-sleep 0.25] [--paths pulse,lease,notready]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import itertools
import pathlib
import statistics
import sys
import tempfile
import time

from _clusterbench import run_namespace  # puts the repository on sys.path: the test tier's control plane
from tests.cluster.controlplane import ControlPlane
from tests.cluster.harness import (
    AgentNodeLoss,
    agent_node_loss,
    start_operator,
    step_times,
)

PATHS = {
    "pulse": ("pulse 0.2 s", ()),
    "lease": ("Lease 1 s alone", ("--agent-pulse-seconds=0",)),
    "notready": ("NotReady only", ("--agent-pulse-seconds=0", "--agent-heartbeat-seconds=0")),
}
"""The operator's flags of each path, by name (the default: all three)."""


@dataclasses.dataclass
class Outcome:
    noticed_seconds: float
    agent_back_seconds: float
    reconnected_seconds: float
    longest_step_gap_seconds: float
    median_step_seconds: float
    steps_during_outage: int
    steps_lost: int
    restarts: int


def outcome_of(seen: AgentNodeLoss) -> Outcome:
    off = seen.powered_off_at
    reconnected = seen.reconnected_at
    times = sorted(step_times(seen.records).values())
    gaps = [b - a for a, b in itertools.pairwise(times)]
    outage_end = max(seen.agent_back_at, reconnected or 0.0)
    executions: dict[int, collections.Counter[int]] = collections.defaultdict(collections.Counter)
    for record in seen.records:
        executions[record["step"]][record["rank"]] += 1
    twice = sum(1 for ranks in executions.values() if max(ranks.values()) > 1)
    missing = len(set(range(1, seen.max_steps + 1)) - set(executions))
    return Outcome(
        noticed_seconds=seen.agent_deleted_at - off,
        agent_back_seconds=seen.agent_back_at - off,
        reconnected_seconds=(reconnected or float("nan")) - off,
        longest_step_gap_seconds=seen.longest_step_gap(off, outage_end),
        median_step_seconds=statistics.median(gaps),
        steps_during_outage=len(seen.steps_between(off, seen.agent_back_at)),
        steps_lost=twice + missing,
        restarts=int((seen.status.get("restarts") or {}).get("total", 0)),
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=160, help="the job's maxSteps (must outlive the outage)")
    parser.add_argument("--step-sleep", type=float, default=0.25, help="seconds each step sleeps (E2E_STEP_SLEEP)")
    parser.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated, of {', '.join(PATHS)}")
    args = parser.parse_args()
    work = pathlib.Path(tempfile.mkdtemp(prefix="disttrain-agent-loss-"))
    began = time.time()
    outcomes: list[tuple[str, Outcome]] = []
    chosen = args.paths.split(",")
    unknown = sorted(set(chosen) - set(PATHS))
    if unknown:
        parser.error(f"--paths: unknown {unknown}; choose from {', '.join(PATHS)}")
    paths = [(PATHS[p][0], PATHS[p][1]) for p in chosen]
    with ControlPlane() as plane:
        plane.start_controllers()
        for path, flags in paths:
            operator = start_operator(plane, work / f"operator-{len(outcomes)}.log", flags)
            try:
                for _ in range(args.runs):  # one at a time: each run's namespace is numbered by the runs before it
                    outcomes.append((path, run_once(plane, work, len(outcomes), args)))
            finally:
                operator.kill()
    print(
        f"node-monitor-grace-period 20 s, {args.max_steps} steps, step sleep {args.step_sleep} s; "
        f"bench wall time {time.time() - began:.0f}s; work dir {work}"
    )
    fields = [f.name for f in dataclasses.fields(Outcome)]
    print("| path | " + " | ".join(fields) + " |")
    print("|---" * (len(fields) + 1) + "|")
    for path, o in outcomes:
        values = [getattr(o, f) for f in fields]
        print(f"| {path} | " + " | ".join(f"{v:.2f}" if isinstance(v, float) else str(v) for v in values) + " |")
    return 0


def run_once(plane: ControlPlane, work: pathlib.Path, run: int, args: argparse.Namespace) -> Outcome:
    """One job through the loss of its agent's node, in a namespace of its own."""
    with run_namespace(plane, work, f"agentloss-{run}") as (cluster, run_dir):
        seen = agent_node_loss(cluster, run_dir, max_steps=args.max_steps, step_sleep=args.step_sleep)
    outcome = outcome_of(seen)
    print(f"run {run}: {outcome}", flush=True)
    return outcome


if __name__ == "__main__":
    sys.exit(main())
