"""On the real-control-plane tier: where a reform's seconds go when a machine dies under a running job.

Starts etcd, kube-apiserver, kube-controller-manager (node-monitor-grace-period 20 s) and kube-scheduler from
``../shared/k8s`` (``tests/cluster/controlplane.py``), the real operator as a process under the chart's RBAC, and
kubelets that run every pod as local processes (``tests/cluster/process_kubelet.py``: the real job agent with its
own ServiceAccount token, real torchrun and trainer). A 3-node job of the e2e recorder trains; the machine of one
worker dies (its processes SIGKILLed, its Lease no longer renewed). Printed, per run:

* ``detect_seconds``: the machine's death -> the reform directive in the job's status (reason ``HeartbeatLost``,
  from the launchers' beats; goal <= 1.5 s, independent of Kubernetes' grace period, which is 20 s here);
* ``reform_seconds.<phase>``: ``status.lastReform.phases`` once the group trains at 3 nodes again with the
  replacement that the real scheduler placed.

    python bench/reform_cluster.py [--runs 2] [--spares 1 | --replacement-wait 0 | --replacement-wait auto]

With ``--spares 1`` the job keeps a hot spare (``spec.nodes.spares``): the victim is a member of the round, and the
reform completes with the spare instead of waiting for the replacement pod to be created, scheduled and started.
With ``--replacement-wait 0`` (``spec.elastic.replacementWaitSeconds: 0``) the survivors re-form at 2 nodes at once
and the replacement joins later with a scale-up; the reform timed is the first one. ``--replacement-wait auto`` is
the spec's default (``operator/replacement.py``): no wait where pods take longer than 3 s to start, as these cold
ones do.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import tempfile
import time

from _clusterbench import run_namespace  # puts the repository on sys.path: the test tier's control plane
from tests.cluster.controlplane import ControlPlane
from tests.cluster.harness import (
    PHASES,
    silent_node_reform,
    start_operator,
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--spares", type=int, default=0, help="spec.nodes.spares of the job (hot spares)")
    parser.add_argument(
        "--replacement-wait",
        type=lambda v: v if v == "auto" else int(v),
        default=60,
        help="spec.elastic.replacementWaitSeconds (0: survivors go on; auto: the default, decided by pod start)",
    )
    args = parser.parse_args()
    work = pathlib.Path(tempfile.mkdtemp(prefix="disttrain-reform-cluster-"))
    began = time.time()
    with ControlPlane() as plane:
        plane.start_controllers()
        operator = start_operator(plane, work / "operator.log")
        results = []
        try:
            for run in range(args.runs):
                with run_namespace(plane, work, f"reform-{run}") as (cluster, run_dir):
                    seen = silent_node_reform(
                        cluster, run_dir, spares=args.spares, replacement_wait_s=args.replacement_wait
                    )
                phases = seen.status["lastReform"]["phases"]
                results.append(seen)
                print(
                    f"run {run}: detect {seen.detect_seconds:.2f} s ({seen.control.get('reason')}; node Ready "
                    f"{seen.node_ready_at_directive} at the directive); "
                    + ", ".join(f"{p} {phases[p]:.2f}" for p in (*PHASES, "total")),
                    flush=True,
                )
        finally:
            operator.kill()
    print(f"control plane v1.36.2, node-monitor-grace-period 20 s; bench wall time {time.time() - began:.0f}s")
    print(f"detect_seconds: {', '.join(f'{r.detect_seconds:.2f}' for r in results)}")
    for phase in (*PHASES, "total"):
        values = [r.status["lastReform"]["phases"][phase] for r in results]
        print(
            f"reform_seconds.{phase}: {statistics.median(values):.2f} (runs: {', '.join(f'{v:.2f}' for v in values)})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
