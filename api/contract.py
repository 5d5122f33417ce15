"""The worker contract: what the operator hands every trainer process in ``$DISTTRAIN_CONTRACT``.

One JSON document rather than a dozen variables, so the trainer reads exactly the models the operator
validated. The per-node variables (node name, checkpoint dir, agent endpoint, metrics port) are separate
because the local runtime sets them per process.
"""

from __future__ import annotations

import hashlib
import json

from pydantic import BaseModel, ConfigDict, Field

from disttrain.api.spec import CheckpointSpec, DistTrainJobSpec, TrainingSpec


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
        )

    def to_env_value(self) -> str:
        return self.model_dump_json(by_alias=True, exclude_none=True)

    @classmethod
    def from_env_value(cls, value: str) -> WorkerContract:
        return cls.model_validate_json(value)


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
