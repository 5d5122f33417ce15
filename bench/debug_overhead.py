"""What ``spec.debug.distributed: DETAIL`` costs per collective: gloo on the CPU, 2 ranks, one process each.

Each rank runs the same sequence of small all-reduces (the size of the trainer's step-boundary agreement) and
1 MiB all-reduces, with ``TORCH_DISTRIBUTED_DEBUG`` OFF and then DETAIL; DETAIL adds torch's fingerprint exchange
(a monitored barrier and an all-gather on a gloo side group) before each one. Prints the median time per
collective and the ratio. Usage: ``python bench/debug_overhead.py`` (about 30 s).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

ROUNDS = 400


def worker() -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    for numel in (8, 262_144):
        tensor = torch.ones(numel)
        for _ in range(20):
            dist.all_reduce(tensor)
        times = []
        for _ in range(ROUNDS):
            began = time.perf_counter()
            dist.all_reduce(tensor)
            times.append(time.perf_counter() - began)
        if dist.get_rank() == 0:
            print(f"{numel} {statistics.median(times) * 1e6:.1f}", flush=True)
    dist.destroy_process_group()


def measure(level: str) -> dict[int, float]:
    environ = dict(os.environ, TORCH_DISTRIBUTED_DEBUG=level, OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", __file__, "--worker"]
    out = subprocess.run(command, env=environ, capture_output=True, text=True, check=True).stdout
    return {int(n): float(us) for n, us in (line.split() for line in out.splitlines() if line[:1].isdigit())}


def main() -> None:
    off, detail = measure("OFF"), measure("DETAIL")
    for numel in off:
        print(
            f"all_reduce of {numel * 4} bytes: OFF {off[numel]:.0f} us, DETAIL {detail[numel]:.0f} us "
            f"(x{detail[numel] / off[numel]:.1f})"
        )


if __name__ == "__main__":
    worker() if "--worker" in sys.argv else main()
