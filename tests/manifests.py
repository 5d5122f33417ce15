"""A checkpoint manifest for tests that need one without a real save: the manager fills in digests and times."""

from __future__ import annotations

from typing import Any

from disttrain.api.manifest import CheckpointManifest, DatasetFingerprint


def bare_manifest(step: int, **fields: Any) -> CheckpointManifest:
    """The manifest of ``step`` of a one-rank run over a 9-sample dataset; ``fields`` override any field."""
    values: dict[str, Any] = {
        "step": step,
        "samples_consumed": step,
        "data_cursor": step,
        "world_size": 1,
        "plan": {},
        "lr_scale": 1.0,
        "dataset": DatasetFingerprint(length=9, seed=0),
        "metadata_sha256": "pending",
        "files": {},
        "created_at": "pending",
        "code_version": "t",
        "config_hash": "h",
    }
    return CheckpointManifest(**{**values, **fields})
