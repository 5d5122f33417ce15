"""GPU smoke test: the GPT-style example with FSDP2 and bf16 on every local GPU, through a reform.

    python bench/gpu_smoke.py [--steps 50] [--size small] [--reform-at 20]

Starts a TCPStore in this process (the job agent's role; every value sealed with a fresh job secret) and
``torchrun --nproc-per-node=<GPUs> --max-restarts=1 examples/gptlm/train.py`` with the worker contract, the
secret and ``DISTTRAIN_AGENT_ENDPOINT`` pointing at it. Once the workers report step ``--reform-at``, it writes a
``reform`` directive to the control channel (``disttrain/signal``): every worker's watchdog ends its process at
once (exit 84, as when one rank's process group is lost), torchrun restarts them, and they resume from the last
checkpoint. Prints, as the last lines:

- ``reform_seconds``: from the directive to the first step reported by the new processes;
- ``samples_per_second``: median of the reported rates after the reform (global samples);
- ``max_memory_allocated_gb``: ``torch.cuda.max_memory_allocated`` of global rank 0 at the end.

Needs CUDA GPUs; on a machine without them it says so and exits 2 (it has not run in this project's CI, which
has none).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from disttrain.api import control, storeauth  # noqa: E402
from disttrain.api import env as env_names  # noqa: E402
from disttrain.trainer.store import channel  # noqa: E402


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def contract(steps: int, gpus: int) -> str:
    training = {"globalBatchSize": 8 * gpus, "microBatchSize": 8, "lr": {"base": 1e-3}, "maxSteps": steps, "seed": 0}
    checkpoint = {"path": "/unused", "intervalSteps": 10, "keep": 2}
    return json.dumps({"training": training, "checkpoint": checkpoint, "collective_timeout_seconds": 60})


def progress(store: dist.Store) -> control.ProgressReport | None:
    return control.read_model(store, control.PROGRESS_KEY, control.ProgressReport)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--size", default="small", choices=["small", "medium", "large"])
    parser.add_argument("--reform-at", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        print("gpu_smoke: no CUDA GPU here (torch.cuda.is_available() is False); nothing was run", file=sys.stderr)
        raise SystemExit(2)
    gpus = torch.cuda.device_count()
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    secret, job_uid = storeauth.new_secret(), "gpu-smoke-uid"
    store = channel.scoped(server, secret, job_uid)  # every value sealed, as the job agent's own client
    workdir = Path(tempfile.mkdtemp(prefix="gpu-smoke-"))
    env = dict(
        os.environ,
        DISTTRAIN_CONTRACT=contract(args.steps, gpus),
        DISTTRAIN_CHECKPOINT_DIR=str(workdir / "ckpt"),
        DISTTRAIN_AGENT_ENDPOINT=f"127.0.0.1:{port}",
        DISTTRAIN_JOB_NAME="gpu-smoke",
        **{env_names.STORE_SECRET: secret, env_names.JOB_UID: job_uid},
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={gpus}",
        "--max-restarts=1",
        str(REPO / "examples" / "gptlm" / "train.py"),
        "--size",
        args.size,
        "--precision",
        "bf16",
    ]
    log_path = workdir / "train.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    signalled_at, first_process, reform_seconds = None, None, None
    rates: list[float] = []
    while proc.poll() is None:
        report = progress(store)
        if report is not None:
            first_process = first_process or report.process_id
            if signalled_at is None and report.step >= args.reform_at:
                signal = control.ControlSignal(
                    generation=1, action=control.DirectiveAction.REFORM, reason="gpu_smoke: reform mid-run"
                )
                store.set(control.SIGNAL_KEY, signal.model_dump_json())
                signalled_at = time.time()
            elif signalled_at is not None and report.process_id != first_process:
                if reform_seconds is None:
                    reform_seconds = report.time - signalled_at
                elif report.samples_per_second:
                    rates.append(report.samples_per_second)
        time.sleep(0.05)
    text = log_path.read_text()
    if proc.returncode != 0 or reform_seconds is None:
        sys.stderr.write(text[-5000:])
        print(
            f"gpu_smoke: training exited {proc.returncode}; reform observed: {reform_seconds is not None}",
            file=sys.stderr,
        )
        raise SystemExit(1)
    memory = re.findall(r"max_memory_allocated_gb: ([\d.]+)", text)
    print(f"gpus: {gpus} ({torch.cuda.get_device_name(0)}); log: {log_path}")
    print(f"reform_seconds: {reform_seconds:.2f}")
    print(f"samples_per_second: {statistics.median(rates) if rates else 0.0:.1f}")
    print(f"max_memory_allocated_gb: {memory[-1] if memory else 'unknown'}")


if __name__ == "__main__":
    main()
