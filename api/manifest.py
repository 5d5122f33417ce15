"""``COMPLETE.json``: the commit record of a checkpoint.

A checkpoint directory counts only when this file is present, parses, and the files it lists match it
(sizes and digests, including the hash of DCP's ``.metadata``). Rank 0 writes it last, atomically
(tmp -> fsync -> rename -> directory fsync), so a crash at any earlier moment leaves a directory that resume
ignores.

File names are plain names inside the checkpoint directory (DCP writes no subdirectories): a ``/``, ``..``, a
backslash or NUL is refused when the manifest is parsed, so validating or loading a checkpoint never opens a
file outside it (and links are never followed, see disttrain.trainer.checkpoint.commit). The manifest is no
signature: see
"What the checkpoint volume is trusted with" in docs/trainer.md.

Order: checkpoints are ordered by ``(fence_round, step)`` (:attr:`CheckpointManifest.order`), so a stale group of
an older round never shadows what a newer round committed, even at a higher or the same step.
"""

from __future__ import annotations

import posixpath
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator

MANIFEST_FILE = "COMPLETE.json"
MANIFEST_FORMAT_VERSION = 1
EFFECT_NAME_PATTERN = r"^[a-z0-9][a-z0-9_.-]{0,62}$"
"""An effect's name: lower-case letters, digits, ``_``, ``.``, ``-`` (it names a confirmation file too)."""
MAX_EFFECTS = 4096
"""Most effects one checkpoint records: effects are for rare events (an upload, an evaluation), not every step."""


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
    etag: Optional[str] = Field(None, exclude_if=lambda v: v is None)
    """The object's ETag, for a checkpoint in a bucket: what a reader checks with HEAD before trusting it."""


class EffectRecord(BaseModel):
    """A side effect declared during ``step`` and recorded with the checkpoint that covers it: carried out after
    that commit, with ``key``, until confirmed (see disttrain.trainer.effects)."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=EFFECT_NAME_PATTERN)
    """The handler the script registered under this name."""
    step: int = Field(ge=1)
    """The global step during which it was declared."""
    key: str = Field(min_length=1, max_length=400)
    """``<run id>/<step>/<name>`` of the run that declared it: the same at every attempt to carry it out."""
    payload: dict[str, Any]
    """The JSON the script declared with it (bounded when declared)."""


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
    """metadata.uid of the job that wrote it, when known: a job recreated under the same name has another, resumes
    from it but does not take its saved directive generation for its own."""
    fence_round: Optional[int] = Field(None, ge=1)
    """Fence round of the group that committed it (see disttrain.trainer.checkpoint.fence); None before rounds
    existed."""
    effects: list[EffectRecord] = Field(default_factory=list, max_length=MAX_EFFECTS, exclude_if=lambda v: not v)
    """Side effects of the steps it covers that were not confirmed carried out when it was saved: a run that
    resumes from it carries out those still unconfirmed."""

    @property
    def order(self) -> tuple[int, int]:
        """(fence round, step): the newer of two checkpoints is the one with the higher round, then step. A
        manifest written before rounds existed counts as round 0."""
        return (self.fence_round or 0, self.step)

    @field_validator("files")
    @classmethod
    def _relative_names(cls, files: dict[str, FileDigest]) -> dict[str, FileDigest]:
        for name in files:
            check_file_name(name)
        return files


def check_file_name(name: str) -> None:
    """Refuse a manifest file name that is not a plain name inside the checkpoint directory (DCP's files are
    flat: ``.metadata``, ``__<rank>_<n>.distcp``), so no path component can lead out of it."""
    if not name or name.startswith("/") or posixpath.isabs(name):
        raise ValueError(f"files: {name!r} is not a relative file name inside the checkpoint directory")
    if "/" in name or "\\" in name or "\x00" in name or name in (".", ".."):
        raise ValueError(
            f"files: {name!r} must be a plain file name: no '/', '..', '.', backslashes or NUL are allowed"
        )
