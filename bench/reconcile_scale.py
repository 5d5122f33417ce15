"""Reconcile core at scale: 500 jobs / 5,000 worker pods through the pure ``reconcile`` (no API).

Each job has 10 running workers and one agent, a status as a running job has it (conditions, tracked pods,
progress, checkpoint); every round, one job in ten sees a change (a lost pod, a scale request, a checkpoint).
Prints the p99 time of one job's reconcile and the process's peak RSS as the last lines.
"""

from __future__ import annotations

import argparse
import dataclasses
import resource
import statistics
import time

from disttrain.api import timestamps
from disttrain.api.spec import DistTrainJob
from disttrain.operator import patches
from disttrain.operator.observed import NodeView, Observed, PodView
from disttrain.operator.reconcile import reconcile


def manifest(i: int, nodes: int) -> dict:
    return {
        "apiVersion": "disttrain.dev/v1alpha1",
        "kind": "DistTrainJob",
        "metadata": {"name": f"job-{i}", "namespace": f"ns-{i % 20}", "uid": f"uid-{i}", "generation": 1},
        "spec": {
            "template": {"spec": {"containers": [{"name": "trainer", "image": "t:1", "command": ["python", "t.py"]}]}},
            "nodes": {"min": 2, "max": 16, "replicas": nodes},
            "training": {"globalBatchSize": 5040, "microBatchSize": 1, "lr": {"base": 0.1}, "maxSteps": 100000},
            "checkpoint": {"claimName": "ckpt"},
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=500)
    parser.add_argument("--pods-per-job", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    t0 = time.time()
    nodes = {f"node-{n}": NodeView(f"node-{n}") for n in range(args.jobs * args.pods_per_job + 1)}
    jobs = []
    for i in range(args.jobs):
        m = manifest(i, args.pods_per_job)
        workers = tuple(
            PodView(
                f"job-{i}-worker-{w}",
                f"u-{i}-{w}",
                w,
                "Running",
                True,
                f"node-{i * args.pods_per_job + w}",
                created_at=t0,
            )
            for w in range(args.pods_per_job)
        )
        agent = PodView(f"job-{i}-agent", f"a-{i}", -1, "Running", True, "node-0", created_at=t0)
        jobs.append([m, Observed(workers=workers, agent=agent, nodes=nodes)])
    timings: list[float] = []
    now = t0
    for rnd in range(args.rounds):
        now += 1.0
        for i, (m, seen) in enumerate(jobs):
            if rnd == 2:  # every job reports a running group
                m["status"] = dict(
                    m.get("status") or {},
                    worldSize=args.pods_per_job,
                    step=10,
                    lastProgressTime=timestamps.format_time(now - 0.5),
                    lastCheckpoint={"step": 10, "time": timestamps.format_time(now - 0.5)},
                )
            if rnd >= 3 and i % 10 == rnd:
                lost = seen.workers[0]
                seen = dataclasses.replace(
                    seen, workers=(dataclasses.replace(lost, phase="Failed", exit_code=1), *seen.workers[1:])
                )
                jobs[i][1] = seen
            job = DistTrainJob.model_validate(m)
            started = time.perf_counter()
            actions = reconcile(job, seen, now)
            timings.append((time.perf_counter() - started) * 1000)
            m["status"] = patches.apply_merge_patch(m.get("status") or {}, dict(actions.status_patch))
    timings.sort()
    p99 = timings[int(len(timings) * 0.99) - 1]
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"reconciles: {len(timings)}")
    print(f"median_reconcile_ms: {statistics.median(timings):.3f}")
    print(f"p99_reconcile_ms: {p99:.3f}")
    print(f"rss_mb: {rss_mb:.1f}")


if __name__ == "__main__":
    main()
