"""What a node's worker start costs: cold interpreters, one warm interpreter per worker, or workers forked from one.

Runs the worker pod's launcher (``python -m disttrain.trainer.launch --standalone``) on ``examples/tinylm`` for a
few steps, N processes on this node, in each mode of ``DISTTRAIN_WARM_WORKERS``, one after the other and
``--rounds`` times in rotating order (the machine's load moves single runs):

- ``cold`` (``0``): every worker is a new Python that imports torch and the trainer itself;
- ``spawn``: one warm interpreter per worker, each importing torch, each becoming a worker;
- ``fork`` (the default): one warm interpreter imports once and forks every worker.

Prints per mode the median wall seconds of the whole run and the CPU seconds of the launcher and all its processes,
then ``cpu_ratio_fork_vs_spawn`` and ``wall_ratio_fork_vs_spawn`` (below 1: forking is cheaper).

    python bench/worker_start.py [--nproc 4] [--steps 5] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODES = {"cold": "0", "spawn": "spawn", "fork": "1"}


def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_once(mode: str, nproc: int, steps: int, folder: Path) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one launcher run to the end of its training."""
    contract = {
        "training": {"globalBatchSize": 8 * nproc, "microBatchSize": 8, "lr": {"base": 0.003}, "maxSteps": steps},
        "checkpoint": {"path": str(folder / f"ckpt-{mode}"), "intervalSteps": 1000, "keep": 1},
    }
    environ = {
        **os.environ,
        "DISTTRAIN_CONTRACT": json.dumps(contract),
        "DISTTRAIN_CHECKPOINT_DIR": str(folder / f"ckpt-{mode}"),
        "DISTTRAIN_JOB_NAME": "bench",
        "DISTTRAIN_WARM_WORKERS": MODES[mode],
        "OMP_NUM_THREADS": "1",
    }
    command = [
        sys.executable,
        "-m",
        "disttrain.trainer.launch",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "--max-restarts=0",
        "examples/tinylm/train.py",
        "--d-model",
        "32",
        "--layers",
        "1",
    ]
    cpu, began = children_cpu_seconds(), time.monotonic()
    done = subprocess.run(command, env=environ, cwd=REPO, capture_output=True, text=True, timeout=600)
    wall = time.monotonic() - began
    if done.returncode != 0:
        raise SystemExit(f"{mode}: the launcher exited {done.returncode}:\n{(done.stdout + done.stderr)[-3000:]}")
    return wall, children_cpu_seconds() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=4, help="worker processes on the node")
    parser.add_argument("--steps", type=int, default=5, help="training steps of each run")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each mode, in rotating order")
    args = parser.parse_args()
    results: dict[str, list[tuple[float, float]]] = {mode: [] for mode in MODES}
    order = list(MODES)
    with tempfile.TemporaryDirectory(prefix="worker-start-") as tmp:
        for round_ in range(args.rounds):
            for mode in order[round_ % len(order) :] + order[: round_ % len(order)]:
                wall, cpu = run_once(mode, args.nproc, args.steps, Path(tmp) / f"r{round_}")
                results[mode].append((wall, cpu))
                print(f"round {round_} {mode:5} wall {wall:6.2f} s  cpu {cpu:6.2f} s", flush=True)
    medians = {
        mode: (statistics.median(w for w, _ in runs), statistics.median(c for _, c in runs))
        for mode, runs in results.items()
    }
    print(f"nproc {args.nproc}, {args.steps} steps, {args.rounds} rounds, load {os.getloadavg()[0]:.1f}")
    for mode, (wall, cpu) in medians.items():
        print(f"{mode}_wall_seconds {wall:.2f}")
        print(f"{mode}_cpu_seconds {cpu:.2f}")
    print(f"cpu_ratio_fork_vs_spawn {medians['fork'][1] / medians['spawn'][1]:.3f}")
    print(f"wall_ratio_fork_vs_spawn {medians['fork'][0] / medians['spawn'][0]:.3f}")


if __name__ == "__main__":
    main()
