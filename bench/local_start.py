"""Local mode's pod start: forked from a fork server that imported torch once, against cold interpreters.

Runs the same local job (the e2e recorder program, 3 nodes, ``--steps`` steps of ``--step-sleep`` s, a node's
machine killed at step ``--kill-at`` and a new one added) with ``DISTTRAIN_LOCAL_FORK`` on and off, alternating,
``--rounds`` times each, and prints per run:

- ``first_step_s``: from the runtime's start to the first step (the agent and three nodes start, import, meet);
- ``replacement_s``: from the kill to the first step of the group that includes the replacement node;
- ``cpu_s``: CPU seconds of the runtime and every process it started and reaped (the fork servers included);
- ``wall_s`` and ``lost_steps``.

and the ratios fork / cold of the medians. Why it matters: on one machine every pod's import of torch takes CPU
from the nodes that train (and a test suite's jobs spend most of their CPU importing).

    python bench/local_start.py [--rounds 2] [--steps 120] [--kill-at 40]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import time
from typing import Any

import _localbench as lb

from disttrain.api import env as env_names


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def one_run(fork: bool, args: argparse.Namespace) -> dict[str, Any]:
    os.environ[env_names.LOCAL_FORK] = "1" if fork else "0"
    work = lb.workdir("local-start")
    out = work / "out"
    out.mkdir()
    obj = lb.recorder_job("start", out, replicas=3, max_steps=args.steps, step_sleep=args.step_sleep)
    obj["spec"]["elastic"] = {"replacementWaitSeconds": 60}
    chaos = f"kill-node@step={args.kill_at},add-node@step={args.kill_at}"
    began, cpu_before = time.time(), _cpu_seconds()
    try:
        runtime = lb.run(obj, work / "state", chaos=chaos, timeout_s=600)
        wall, cpu = time.time() - began, _cpu_seconds() - cpu_before
        found = lb.records(out)
        kill = next(e["time"] for e in runtime.events if e["reason"] == "ChaosKillNode")
        before = [r for r in found if r["time"] <= kill]
        old_group = before[-1]["group"] if before else None
        groups = [r for r in found if r["time"] > kill and r["group"] != old_group]
        return {
            "mode": "fork" if fork else "cold",
            "first_step_s": round(found[0]["time"] - began, 2),
            "replacement_s": round(groups[0]["time"] - kill, 2) if groups else float("nan"),
            "cpu_s": round(cpu, 1),
            "wall_s": round(wall, 1),
            "lost_steps": lb.lost_steps(found),
            "phase": runtime.obj["status"].get("phase"),
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--step-sleep", type=float, default=0.1)
    parser.add_argument("--kill-at", type=int, default=40)
    args = parser.parse_args()
    runs = []
    for _ in range(args.rounds):
        for fork in (True, False):
            runs.append(one_run(fork, args))
            print(runs[-1], flush=True)
    for key in ("first_step_s", "replacement_s", "cpu_s", "wall_s"):
        fork = statistics.median(r[key] for r in runs if r["mode"] == "fork")
        cold = statistics.median(r[key] for r in runs if r["mode"] == "cold")
        print(f"{key}: fork {fork:.2f}, cold {cold:.2f}, ratio_fork_vs_cold {fork / cold:.3f}")


if __name__ == "__main__":
    main()
