"""``disttrain local run`` on a machine with GPUs: each local node gets GPUs of its own.

On Kubernetes every worker pod is given its own GPUs by the device plugin, and its processes see them as
``cuda:0..n-1``. Local nodes share one machine: without a split they would all use ``cuda:0..n-1``, the same devices,
and NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU detected"). :class:`GpuSlices` hands every
local node a disjoint slice of the machine's visible GPUs through ``CUDA_VISIBLE_DEVICES``, as the device plugin
does, and takes it back when the node's processes are gone. A node created while no slice is free (a scale-up past
the machine, a replacement whose predecessor has not ended yet) waits, as an unschedulable pod stays Pending.
Pure: the runtime asks torch for the count (:mod:`disttrain.operator.local.gpucheck`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Optional

from disttrain.api import containers
from disttrain.api import contract as contract_mod
from disttrain.api.spec import DistTrainJob

VISIBLE_DEVICES_ENV = "CUDA_VISIBLE_DEVICES"


def visible_devices(mask: Optional[str], count: int) -> tuple[str, ...]:
    """The machine's GPUs as ``CUDA_VISIBLE_DEVICES`` entries: ``0..count-1`` when the mask is unset, else the first
    ``count`` entries of the mask (indices or UUIDs; CUDA stops at the first invalid one, and ``count`` is what torch
    found under it)."""
    if mask is None:
        return tuple(str(i) for i in range(count))
    entries = [entry.strip() for entry in mask.split(",")]
    return tuple(entry for entry in entries if entry)[:count]


def gpus_per_node(job: DistTrainJob) -> int:
    """GPUs each local node needs: the trainer container's GPU request, else one per process (``nprocPerNode``):
    a trainer on ``device='auto'`` that sees CUDA puts every local rank on a GPU of its own."""
    return contract_mod.requested_gpus(job.spec.template) or job.spec.nproc_per_node


def pins_its_own_devices(job: DistTrainJob) -> bool:
    """The trainer container sets ``CUDA_VISIBLE_DEVICES`` itself (``--device cpu`` sets it empty): left as it is."""
    pod_containers: list[Mapping[str, Any]] = job.spec.template.get("spec", {}).get("containers", [])
    index = containers.find_trainer_index(pod_containers)
    if index is None:
        return False
    return any(item.get("name") == VISIBLE_DEVICES_ENV for item in pod_containers[index].get("env") or [])


def shortage_message(devices: tuple[str, ...], mask: Optional[str], nodes: int, per_node: int) -> Optional[str]:
    """Why ``nodes`` local nodes of ``per_node`` GPUs each do not fit on this machine's ``devices``; None if they do."""
    if nodes * per_node <= len(devices):
        return None
    shown = f"{VISIBLE_DEVICES_ENV}={mask!r}" if mask is not None else f"{VISIBLE_DEVICES_ENV} unset"
    fits = len(devices) // per_node
    return (
        f"this machine has {len(devices)} GPU(s) visible ({shown}), but the job asks for {nodes} node(s) x "
        f"{per_node} GPU(s) per node = {nodes * per_node}: each local node needs GPUs of its own (NCCL refuses two "
        f"ranks of one group on one GPU). Run at most {fits} node(s) (--nodes {max(fits, 1)}), fewer GPUs per node "
        "(spec.nprocPerNode and the trainer container's nvidia.com/gpu request), or on the CPU (--device cpu)"
        if fits
        else f"this machine has {len(devices)} GPU(s) visible ({shown}), fewer than the {per_node} one local node "
        "needs (spec.nprocPerNode, or the trainer container's nvidia.com/gpu request); run on the CPU (--device cpu)"
    )


@dataclasses.dataclass
class GpuSlices:
    """Disjoint slices of ``devices``, ``per_node`` GPUs each, one per local node that holds one."""

    devices: tuple[str, ...]
    per_node: int
    held: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    """Pod name -> its GPUs."""

    @property
    def capacity(self) -> int:
        """How many nodes fit at once."""
        return len(self.devices) // self.per_node

    def free(self) -> tuple[str, ...]:
        taken = {device for held in self.held.values() for device in held}
        return tuple(device for device in self.devices if device not in taken)

    def take(self, pod: str) -> Optional[tuple[str, ...]]:
        """``pod``'s slice (the one it holds, else the first free GPUs); None when too few are free."""
        if pod in self.held:
            return self.held[pod]
        free = self.free()
        if len(free) < self.per_node:
            return None
        self.held[pod] = free[: self.per_node]
        return self.held[pod]

    def release(self, pod: str) -> None:
        """``pod``'s processes are gone: its GPUs are free again."""
        self.held.pop(pod, None)

    @staticmethod
    def env(devices: tuple[str, ...]) -> dict[str, str]:
        return {VISIBLE_DEVICES_ENV: ",".join(devices)}
