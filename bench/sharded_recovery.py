"""A node of a sharded (FSDP2) job lost between checkpoints: rebuilt from memory, against the restart path and DDP.

Local mode, the example GPT (examples/gptlm/train.py, fp32, FSDP2) on 3 nodes x 1 process, a checkpoint every 20
steps, one node's machine SIGKILLed at step 45 and replaced:

- ``fsdp2_memory``: ``reformInPlace: true`` (the default): the survivors and the replacement rebuild the state from
  the survivors' own shards and the partner copies of the lost node's shards;
- ``fsdp2_restart``: ``reformInPlace: false``: every worker restarts and loads the checkpoint of step 40;
- ``ddp_memory``: the demo's tiny LM under DDP, in place, the same kind of kill (the reference of in-place reforms).

For each: kill -> first step at the new group (``status.lastReform.durationSeconds``), steps lost (steps redone
beyond the one the kill interrupted), restarts charged, where the state came from. Then the cost of keeping the state:
host memory per rank (the trainer's own account of its versions) and the step time of the same FSDP2 job without a
kill, in place (copies every step) against restarting (no copies), measured side by side in this run: the runs
alternate (``--repeats`` of each), and each side's figure is its fastest 20-step window.

    python bench/sharded_recovery.py [--steps 90] [--kill-at 45] [--repeats 2]
"""

from __future__ import annotations

import argparse
import itertools
import re
import time
from typing import Any

import _localbench as lb

KEEPING = re.compile(
    r"keeping the state in memory: ([\d.]+) MB of own shards per version on rank 0, ([\d.]+) MB of its partner's"
)
STEP_LINE = re.compile(r"^(\S+ \S+) \[disttrain rank 0\] INFO step (\d+) loss", re.M)


def gptlm_job(name: str, *, steps: int, in_place: bool) -> dict[str, Any]:
    container = {
        "name": "trainer",
        "image": "local",
        "command": ["python", "-u", "examples/gptlm/train.py"],
        "args": ["--precision", "fp32"],
        "env": [{"name": "OMP_NUM_THREADS", "value": "1"}],
    }
    return lb.local_job(
        name,
        container,
        nodes={"max": 3, "replicas": 3},
        rendezvous={"joinTimeoutSeconds": 600},
        training={"globalBatchSize": 12, "microBatchSize": 2, "lr": {"base": 0.001}, "maxSteps": steps, "seed": 1},
        checkpoint={"claimName": "bench", "intervalSteps": 20},
        elastic={"drainTimeoutSeconds": 120, "collectiveTimeoutSeconds": 10, "reformInPlace": in_place},
        restartPolicy={"maxRestarts": 10},
    )


def run_killed(name: str, obj: dict[str, Any], kill_at: int) -> dict[str, Any]:
    base = lb.workdir(name)
    seen: dict[str, Any] = {}
    runtime = lb.run(
        obj,
        base / "state",
        chaos=f"kill-node@step={kill_at}",
        timeout_s=900,
        on_tick=lambda _runtime, snapshot: seen.update(status=snapshot.status),
    )
    summary = runtime.summary
    reform = (seen.get("status") or {}).get("lastReform") or {}
    logs = "".join(p.read_text(errors="replace") for p in (base / "state").rglob("*.log"))
    return {
        "reform_seconds": reform.get("durationSeconds"),
        "lost_steps": summary.lost_steps if summary else None,
        "restarts": sum(summary.restarts_by_reason.values()) if summary else None,
        "from": reform.get("resumedFrom") or ("memory" if "held in memory" in logs else "checkpoint"),
        "succeeded": bool(summary and summary.succeeded),
        "logs": logs,
    }


def step_seconds(name: str, obj: dict[str, Any]) -> tuple[float, str]:
    """Seconds per step in the fastest window between rank 0's log lines from step 20 on (it logs every 20 steps:
    the quietest stretch of a machine shared with other work), and the logs."""
    base = lb.workdir(name)
    lb.run(obj, base / "state", timeout_s=900)
    logs = "".join(p.read_text(errors="replace") for p in (base / "state").rglob("*.log"))
    stamps: dict[int, float] = {}
    for stamp, step in STEP_LINE.findall(logs):
        day, millis = stamp.split(",")
        stamps.setdefault(int(step), time.mktime(time.strptime(day, "%Y-%m-%d %H:%M:%S")) + int(millis) / 1000)
    steps = sorted(s for s in stamps if s >= 20)
    return min((stamps[b] - stamps[a]) / (b - a) for a, b in itertools.pairwise(steps)), logs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=90)
    parser.add_argument("--kill-at", type=int, default=45)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each side of the step-time measure")
    args = parser.parse_args()
    rows = {
        "fsdp2_memory": run_killed("fsdp2-memory", gptlm_job("mem", steps=args.steps, in_place=True), args.kill_at),
        "fsdp2_restart": run_killed("fsdp2-restart", gptlm_job("rst", steps=args.steps, in_place=False), args.kill_at),
        "ddp_memory": run_killed("ddp-memory", lb.tinylm_job("ddp", replicas=3, max_steps=args.steps), args.kill_at),
    }
    keeps, plains, keep_logs = [], [], ""
    for _ in range(args.repeats):  # alternated, the fastest of each: load from other work hits both sides alike
        seconds, keep_logs = step_seconds("keep", gptlm_job("keep", steps=100, in_place=True))
        keeps.append(seconds)
        plains.append(step_seconds("plain", gptlm_job("plain", steps=100, in_place=False))[0])
    keep_step, plain_step = min(keeps), min(plains)
    kept = KEEPING.search(keep_logs)
    own, partner = (float(kept.group(1)), float(kept.group(2))) if kept else (float("nan"), float("nan"))
    for name, row in rows.items():
        for key in ("reform_seconds", "lost_steps", "restarts", "from", "succeeded"):
            print(f"{name}_{key}: {row[key]}")
    print(f"host_memory_mb_per_rank: {2 * (own + partner):.2f}")
    print(f"host_memory_vs_own_shards: {2 * (own + partner) / own:.2f}" if own else "host_memory_vs_own_shards: nan")
    print(f"step_seconds_keeping: {keep_step:.4f}")
    print(f"step_seconds_not_keeping: {plain_step:.4f}")
    print(f"step_time_overhead_ratio: {keep_step / plain_step:.3f}")


if __name__ == "__main__":
    main()
