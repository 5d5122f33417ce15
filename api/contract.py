"""The worker contract: what the operator hands every trainer process in ``$DISTTRAIN_CONTRACT``.

One JSON document rather than a dozen variables, so the trainer reads exactly the models the operator
validated. The per-node variables (node name, checkpoint dir, agent endpoint, metrics port) are separate
because the local runtime sets them per process.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field

from disttrain.api import constants, containers
from disttrain.api.spec import CheckpointSpec, DebugSpec, DistTrainJobSpec, TrainingSpec

GPU_RESOURCES: tuple[str, ...] = (constants.GPU_RESOURCE, "amd.com/gpu")
"""Extended resources that request GPUs (NVIDIA's and AMD's device plugins); torch sees either as ``cuda``."""


class WorkerContract(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    training: TrainingSpec
    checkpoint: CheckpointSpec
    collective_timeout_seconds: int = Field(60, ge=1)
    nproc_per_node: int = Field(1, ge=1)
    min_nodes: int = Field(1, ge=1)
    max_nodes: int = Field(1, ge=1)
    reform_in_place: bool = False
    """``spec.elastic.reformInPlace`` (false for a contract written without it: every reform restarts)."""
    gpus_per_node: int = Field(0, ge=0)
    """GPUs the trainer container requests (:data:`GPU_RESOURCES`, limits else requests); 0: none. A trainer on
    ``device='auto'`` that finds no CUDA device while this is above 0 exits PERMANENT instead of training on the
    CPU: the job asked for GPUs, and a silent CPU run is slower by orders of magnitude."""
    debug: Optional[DebugSpec] = None
    """``spec.debug`` when any of it is on (the launcher sets the workers' debug environment and log files from it);
    None otherwise, so the contract of a job without debug mode is the same document as without the field."""

    @classmethod
    def from_spec(cls, spec: DistTrainJobSpec) -> WorkerContract:
        return cls(
            training=spec.training,
            checkpoint=spec.checkpoint,
            collective_timeout_seconds=spec.elastic.collective_timeout_seconds,
            nproc_per_node=spec.nproc_per_node,
            min_nodes=spec.nodes.min,
            max_nodes=spec.nodes.max,
            reform_in_place=spec.elastic.reform_in_place,
            gpus_per_node=requested_gpus(spec.template),
            debug=spec.debug if spec.debug.is_on else None,
        )

    def to_env_value(self) -> str:
        return self.model_dump_json(by_alias=True, exclude_none=True)

    @classmethod
    def from_env_value(cls, value: str) -> WorkerContract:
        return cls.model_validate_json(value)


def requested_gpus(template: Mapping[str, Any]) -> int:
    """GPUs the trainer container of a pod template requests: the sum over :data:`GPU_RESOURCES` of its limit (else
    its request). 0 without a trainer container or a readable whole number (validation reports those)."""
    pod_containers = (template.get("spec") or {}).get("containers") or []
    index = containers.find_trainer_index(pod_containers)
    if index is None:
        return 0
    resources = pod_containers[index].get("resources") or {}
    limits, requests = resources.get("limits") or {}, resources.get("requests") or {}
    total = 0
    for name in GPU_RESOURCES:
        value = limits.get(name, requests.get(name))
        try:
            total += max(0, int(str(value))) if value is not None else 0
        except ValueError:
            continue
    return total


def missing_gpu_message(gpus_per_node: int, torch_version: str, torch_build: str, device_count: int) -> str:
    """Why a job that requests GPUs cannot run here, and what to do: the trainer's PERMANENT error and ``disttrain
    local run``'s refusal say the same. ``torch_build``: what the torch build supports (``CUDA 12.8``, ``CPU
    only``)."""
    return (
        f"the trainer container requests {gpus_per_node} GPU(s) per node "
        f"(spec.template.spec.containers[trainer].resources {' or '.join(GPU_RESOURCES)}), but no CUDA device is "
        f"usable here: torch {torch_version} (built for {torch_build}) sees {device_count} CUDA device(s). "
        "Run it where the GPUs are (an image with a CUDA build of torch, on a GPU node), or remove the GPU "
        "request to train on the CPU (`disttrain local run --device cpu` does that for a local run)"
    )


def job_checkpoint_dir(root: str, namespace: str, name: str) -> str:
    """Directory of one job's checkpoints: ``<spec.checkpoint.path>/<namespace>/<job name>``.

    The operator sets it as ``$DISTTRAIN_CHECKPOINT_DIR``, the job agent names ``status.lastCheckpoint.path`` under
    it, and a trainer started without the variable falls back to it, so all three must agree.
    """
    return f"{root.rstrip('/')}/{namespace}/{name}"


def training_config_hash(training: TrainingSpec) -> str:
    """Stable hash of the training contract, recorded in every checkpoint manifest."""
    canonical = json.dumps(training.to_wire(), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()
