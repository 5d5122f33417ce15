"""``disttrain local run``'s GPU check: a job that requests GPUs on a machine without CUDA is refused at once.

Without it such a run starts every node, each worker imports torch, joins the group and only then exits PERMANENT
(the trainer's own check, :func:`disttrain.trainer.bootstrap._use_cuda_or_exit`), minutes later with 16 processes on a
laptop. The refusal says the same as the trainer (:func:`disttrain.api.contract.missing_gpu_message`). torch is
asked in a child interpreter, the one the nodes run (the operator side never imports torch), and only when the job
requests GPUs. ``--device cpu`` is the way out: :func:`train_on_cpu` drops the GPU request and hides CUDA from the
nodes, so they really train on the CPU.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import subprocess
import sys
from typing import Any, Optional

from disttrain.api import containers
from disttrain.api import contract as contract_mod
from disttrain.api.spec import DistTrainJob

PROBE = """
import json, torch
v = torch.version
build = f"CUDA {v.cuda}" if v.cuda else (f"ROCm {v.hip}" if getattr(v, "hip", None) else "CPU only")
print(json.dumps({"version": torch.__version__, "build": build, "available": torch.cuda.is_available(),
                  "devices": torch.cuda.device_count()}))
"""
PROBE_TIMEOUT_S = 120.0
"""Importing torch takes seconds; a machine that needs minutes has other problems (the check is then skipped)."""


@dataclasses.dataclass(frozen=True)
class TorchFacts:
    """What the nodes' torch finds on this machine."""

    version: str
    build: str
    available: bool
    devices: int


def probe_torch(python: str = sys.executable) -> TorchFacts | str:
    """Ask ``python``'s torch about CUDA; a string says why it could not be asked."""
    try:
        done = subprocess.run(
            [python, "-c", PROBE], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        return lines[-1] if lines else f"exit code {done.returncode}"
    try:
        facts: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
        return TorchFacts(str(facts["version"]), str(facts["build"]), bool(facts["available"]), int(facts["devices"]))
    except (ValueError, LookupError, TypeError) as exc:
        return f"unreadable answer {done.stdout!r} ({exc})"


GPU_DEVICE_FILES = ("/dev/nvidia[0-9]*", "/dev/kfd")
"""Device files of NVIDIA's and AMD's GPU drivers: without one, torch finds no GPU and need not be asked."""


def machine_has_gpus(patterns: tuple[str, ...] = GPU_DEVICE_FILES) -> bool:
    """Whether a GPU driver's device file is here (cheap: the torch probe costs seconds, and a job that requests no
    GPU still trains on the machine's GPUs with ``device='auto'``, so its nodes need GPUs of their own)."""
    return any(glob.glob(pattern) for pattern in patterns)


def refusal(job: DistTrainJob, facts: TorchFacts) -> Optional[str]:
    """Why ``job`` cannot run here: it requests GPUs and torch finds no CUDA device; None when it can."""
    gpus = contract_mod.requested_gpus(job.spec.template)
    if gpus == 0 or facts.available:
        return None
    return contract_mod.missing_gpu_message(gpus, facts.version, facts.build, facts.devices)


def train_on_cpu(job: DistTrainJob) -> int:
    """Drop the trainer container's GPU request and hide CUDA from it (``CUDA_VISIBLE_DEVICES=""``), in place: the
    contract then asks for no GPU and ``device='auto'`` picks the CPU even on a machine with GPUs. Returns the
    number of GPUs the request had."""
    pod_containers: list[dict[str, Any]] = job.spec.template.get("spec", {}).get("containers", [])
    index = containers.find_trainer_index(pod_containers)
    if index is None:
        return 0
    gpus = contract_mod.requested_gpus(job.spec.template)
    trainer = pod_containers[index]
    for section in ("limits", "requests"):
        values = (trainer.get("resources") or {}).get(section) or {}
        for name in contract_mod.GPU_RESOURCES:
            values.pop(name, None)
    env = [item for item in trainer.get("env") or [] if item.get("name") != "CUDA_VISIBLE_DEVICES"]
    trainer["env"] = [*env, {"name": "CUDA_VISIBLE_DEVICES", "value": ""}]
    return gpus
