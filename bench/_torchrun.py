"""Shared by the benchmarks that run themselves under torchrun: one standalone run on this machine."""

from __future__ import annotations

import os
import subprocess
import sys


def run_standalone(script: str, args: list[str], nproc_per_node: int = 2) -> list[str]:
    """The non-empty output lines of ``script`` run under ``torch.distributed.run --standalone`` with one intra-op
    thread per process; a failed run prints the tail of its stderr and exits with its code."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc_per_node}"]
    proc = subprocess.run(
        [*cmd, script, *args], env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True
    )
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-5000:])
        raise SystemExit(proc.returncode)
    return [ln for ln in proc.stdout.splitlines() if ln.strip()]
