"""``COMPLETE.json``: the commit record of a checkpoint.

A checkpoint directory counts only when this file is present, parses, and the files it lists match it
(sizes and digests, including the hash of DCP's ``.metadata``). Rank 0 writes it last, atomically
(tmp -> fsync -> rename -> directory fsync), so a crash at any earlier moment leaves a directory that resume
ignores.
"""

from __future__ import annotations

from typing import Optional

from pydantic import BaseModel, ConfigDict, Field

MANIFEST_FILE = "COMPLETE.json"
MANIFEST_FORMAT_VERSION = 1


class DatasetFingerprint(BaseModel):
    """Identity of the sample stream; resuming with a different one is refused, naming what changed."""

    model_config = ConfigDict(extra="forbid")
    length: int = Field(ge=0)
    seed: int
    permutation_version: int = 1


class FileDigest(BaseModel):
    """Size and content digest ("<algorithm>:<hex>") of one file of the checkpoint."""

    model_config = ConfigDict(extra="forbid")
    size: int = Field(ge=0)
    digest: str


class CheckpointManifest(BaseModel):
    """Everything needed to resume exactly: where in training, in the data stream, and with which plan."""

    model_config = ConfigDict(extra="forbid")
    format_version: int = MANIFEST_FORMAT_VERSION
    step: int = Field(ge=0)
    samples_consumed: int = Field(ge=0)
    data_cursor: int = Field(ge=0)
    world_size: int = Field(ge=1)
    plan: dict[str, float | int]
    lr_scale: float
    """LR factor in effect when saved (the start of the ramp after a resume at another size)."""
    dataset: DatasetFingerprint
    metadata_sha256: str
    """sha256 of DCP's ``.metadata`` file."""
    files: dict[str, FileDigest]
    """Every file of the checkpoint (relative path -> size and digest), ``.metadata`` included."""
    created_at: str
    """RFC 3339 commit time."""
    code_version: str
    """disttrain version that wrote it."""
    config_hash: str
    """sha256 of the training contract (spec.training) that wrote it."""
    job: Optional[str] = None
    """namespace/name of the job, when known."""
    job_uid: Optional[str] = None
    """metadata.uid of the job that wrote it, when known: a job recreated under the same name resumes from it
    but does not take its saved directive generation for its own."""
