"""The commit of a save across its group, and retention: what happens once every rank wrote its part.

Every rank sends the digests of its files (or its error) to every other; with no error, rank 0 commits on the
volume (:meth:`Committer.commit`: fence check, COMPLETE.json, rename to ``step-N``, retention) and broadcasts
whether it did. With a bucket (``spec.checkpoint.uri``), each local tier's leader commits on its tier, every rank
starts its uploads and rank 0's publisher completes the save in the bucket later (:mod:`.tiered`). A failed commit
removes the temporary directory at once and is counted; too many in a row end the process with a retryable error.

The group's fence round (with the session id of its saves' nonces) is claimed here too, once, at the group's first
collective: every commit is checked against it.
"""

from __future__ import annotations

import datetime
import logging
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch.distributed as dist

from disttrain.api.manifest import CheckpointManifest, FileDigest
from disttrain.api.spec import CheckpointSpec
from disttrain.trainer.checkpoint import commit, tiered
from disttrain.trainer.checkpoint.committer import CheckpointPhase, Committer
from disttrain.trainer.checkpoint.saving import Written
from disttrain.trainer.checkpoint.tiered import BucketTier, PublishOptions
from disttrain.trainer.checkpoint.uploads import RetryPolicy

if TYPE_CHECKING:
    from disttrain.trainer.checkpoint.manager import ManagerOptions
    from disttrain.trainer.metrics import TrainerMetrics

log = logging.getLogger("disttrain.trainer")


class CheckpointFailedError(RuntimeError):
    """Saves kept failing: training on would pile up unrecoverable work."""


@dataclass
class SaveGroup:
    """The group whose saves a :class:`CheckpointManager` makes and its :class:`GroupCommit` commits, one object
    shared by both: where the saves go, under which policy, and this process's place in the group."""

    root: Path
    spec: CheckpointSpec
    rank: int
    world_size: int
    group: Optional[dist.ProcessGroup]
    """None once the group ended under the manager (an in-place reform)."""
    options: ManagerOptions


class InSaveGroup:
    """The fields of the shared :class:`SaveGroup`, read (and the process group set) as attributes of its own."""

    where: SaveGroup

    @property
    def root(self) -> Path:
        return self.where.root

    @property
    def spec(self) -> CheckpointSpec:
        return self.where.spec

    @property
    def rank(self) -> int:
        return self.where.rank

    @property
    def world_size(self) -> int:
        return self.where.world_size

    @property
    def group(self) -> Optional[dist.ProcessGroup]:
        return self.where.group

    @group.setter
    def group(self, group: Optional[dist.ProcessGroup]) -> None:
        self.where.group = group

    @property
    def options(self) -> ManagerOptions:
        return self.where.options

    @property
    def metrics(self) -> Optional[TrainerMetrics]:
        return self.where.options.metrics


class GroupCommit(InSaveGroup):
    """Commit and retention of one group's saves (collective): the fence round, the commit, failures in a row,
    and with a bucket the local tiers and what the bucket completed."""

    def __init__(self, where: SaveGroup) -> None:
        self.where = where
        spec, options = where.spec, where.options
        self.consecutive_failures = 0
        self.last_committed_step: Optional[int] = None
        """The newest step this process saw committed (or loaded): what an abandoned save falls back to."""
        self.last_failure = ""
        self.committer = Committer(
            where.root,
            spec,
            job_uid=options.job_uid,
            node=options.node,
            on_phase=options.on_phase,
            on_commit=options.on_commit,
        )
        self.fence_round: Optional[int] = None  # claimed by rank 0 of this group at its first collective
        self.session: Optional[str] = None  # the random part of the group's save nonces, agreed with the round
        self.bucket_round: Optional[int] = None  # with a bucket: the round rank 0 claimed there
        self.tier: Optional[BucketTier] = None
        """With ``spec.uri``: the bucket, reached through the local tier at ``root`` (:mod:`.tiered`)."""
        self._published: list[CheckpointManifest] = []
        self._bucket_step: Optional[int] = None  # rank 0: the newest step COMPLETE in the bucket that it knows of
        self._published_lock = threading.Lock()
        self._tier_closed = False
        if spec.uri is not None:
            store = tiered.bucket_committer(spec, options.job_uid, options.node, options.upload_retry)
            publishing = PublishOptions(
                spec.keep, self._on_published, options.upload_retry or RetryPolicy(), options.on_phase
            )
            self.tier = BucketTier(store, where.root, where.rank, publishing)

    # ---- the fence round ----------------------------------------------------------------------------------
    def claim_round(self) -> int:
        """This group's fence round: rank 0 claims it on the volume once and broadcasts it with the session id
        (collective the first time; every rank reaches it first through resume's choice or a save)."""
        if self.fence_round is None:
            box: list[Any] = [None]
            if self.rank == 0:
                bucket_round = self.tier.store.claim_round() if self.tier is not None else None
                box[0] = (self.committer.claim_round(), uuid.uuid4().hex[:8], bucket_round)
            dist.broadcast_object_list(box, src=0, group=self.group)
            self.fence_round, self.session, self.bucket_round = box[0]
            if self.tier is not None:
                identities: list[Any] = [None] * self.world_size
                dist.all_gather_object(identities, tiered.tier_identity(self.root), group=self.group)
                self.tier.join_group(identities, self.world_size)
                self.tier.store.round = self.bucket_round  # every rank uploads under the round rank 0 claimed
        assert self.fence_round is not None
        return self.fence_round

    # ---- the commit ---------------------------------------------------------------------------------------
    def commit(
        self,
        step: int,
        tmp: Path,
        manifest: CheckpointManifest,
        written: Written,
        protected: set[int],
    ) -> bool:
        """Commit the save in ``tmp`` (collective); False when it failed (counted, its directory removed: call
        :meth:`stop_if_exhausted` next). ``written``: this rank's part. ``protected``: steps retention keeps
        whatever ``keep`` says."""
        digests, error = written
        gathered: list[Any] = [None] * self.world_size
        payload = {
            "digests": {k: v.model_dump() for k, v in digests.items()},
            "error": self.committer.describe(step, error) if error else None,
        }
        dist.all_gather_object(gathered, payload, group=self.group)
        errors = [g["error"] for g in gathered if g["error"]]
        if errors:
            return self._failed(step, tmp, "; ".join(sorted(set(errors))))
        if self.tier is not None:
            return self._commit_on_tiers(step, tmp, manifest, gathered, digests)
        committed, problem = True, ""
        if self.rank == 0:
            try:
                self.committer.commit(step, tmp, manifest, _merged(gathered), protected)
            except Exception as exc:  # noqa: BLE001
                log.error("checkpoint step-%d could not be committed: %s", step, exc)
                committed, problem = False, self.committer.describe(step, exc)
        flag: list[Any] = [committed, problem]
        dist.broadcast_object_list(flag, src=0, group=self.group)
        if not flag[0]:
            return self._failed(step, tmp, f"rank 0 could not commit: {flag[1]}")
        self.consecutive_failures = 0
        self.last_committed_step = step
        if self.metrics is not None:
            self.metrics.last_complete_step.set(step)
        return True

    def _commit_on_tiers(
        self,
        step: int,
        tmp: Path,
        manifest: CheckpointManifest,
        gathered: list[Any],
        mine: dict[str, FileDigest],
    ) -> bool:
        """With a bucket: each tier's leader commits the save on its local tier (COMPLETE.json, the rename to
        ``step-N``), every rank then starts uploading its own files, and rank 0 its publication in the bucket."""
        assert self.tier is not None
        files = _merged(gathered)
        final = manifest.model_copy(
            update={
                "files": files,
                "metadata_sha256": files[commit.METADATA_FILE].digest.split(":", 1)[1],
                "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                "job_uid": self.options.job_uid or None,
                "fence_round": self.bucket_round,
            }
        )
        problem = ""
        if self.tier.is_leader:
            try:
                if self.rank == 0:
                    self.phase(CheckpointPhase.BEFORE_MANIFEST, step)
                commit.write_manifest(tmp, final)
                if self.rank == 0:
                    self.phase(CheckpointPhase.BEFORE_PUBLISH, step)
                commit.publish(self.root, tmp, step)
            except Exception as exc:  # noqa: BLE001
                log.error("checkpoint step-%d could not be committed on the local tier: %s", step, exc)
                problem = f"rank {self.rank}: {self.committer.describe(step, exc)}"
        problems: list[Any] = [None] * self.world_size
        dist.all_gather_object(problems, problem, group=self.group)
        if any(problems):
            return self._failed(step, tmp, "; ".join(p for p in problems if p))
        if self.rank == 0:
            self.phase(CheckpointPhase.PUBLISHED, step)
            log.info("checkpoint step-%d committed on the local tier; uploading to the bucket", step)
        self.tier.after_local_commit(final, mine, self.claim_round())
        self.consecutive_failures = 0
        self.last_committed_step = step
        if self.metrics is not None:
            self.metrics.checkpoint_uploads_pending.set(self.tier.uploads_pending())
        return True

    def _failed(self, step: int, tmp: Path, reason: str) -> bool:
        self.consecutive_failures += 1
        self.last_failure = reason
        if self.metrics is not None:
            self.metrics.checkpoint_failures.inc()
        log.error("checkpoint save at step %d FAILED (%d in a row): %s", step, self.consecutive_failures, reason)
        if self.rank == 0 or (self.tier is not None and self.tier.is_leader):
            self.committer.remove(tmp)
        return False

    def stop_if_exhausted(self) -> None:
        """CheckpointFailedError once ``max_consecutive_failures`` saves failed in a row."""
        if self.consecutive_failures >= self.options.max_consecutive_failures:
            raise CheckpointFailedError(
                f"{self.consecutive_failures} checkpoint saves in a row failed; last: {self.last_failure}"
            )

    def phase(self, phase: CheckpointPhase, step: int) -> None:
        self.committer.phase(phase, step)

    # ---- the bucket ---------------------------------------------------------------------------------------
    def _on_published(self, manifest: CheckpointManifest) -> None:
        """Rank 0's publisher thread: a save is COMPLETE in the bucket (reported from the training thread, at the
        next :meth:`report_published`: the control channel is the training thread's)."""
        if self.metrics is not None:
            self.metrics.last_complete_step.set(manifest.step)
        with self._published_lock:
            self._published.append(manifest)
            self._bucket_step = max(manifest.step, self._bucket_step or 0)

    def note_bucket_step(self, step: Optional[int]) -> None:
        """Rank 0, at resume: the newest step COMPLETE in the bucket."""
        with self._published_lock:
            self._bucket_step = step

    @property
    def durable_step(self) -> Optional[int]:
        """The newest step whose checkpoint survives losing this node, which is when its side effects may run: the
        committed one on a volume; with a bucket, the newest COMPLETE there (rank 0, whose publisher writes it and
        who alone carries out effects; the other ranks count their local commits)."""
        if self.tier is None or self.rank != 0:
            return self.last_committed_step
        with self._published_lock:
            return self._bucket_step

    def last_upload_seconds(self) -> Optional[float]:
        """With a bucket: how long this rank's newest finished upload took (intervalSteps: auto); else None."""
        return self.tier.uploader.last_seconds if self.tier is not None else None

    def upload_backlog(self) -> Optional[str]:
        """With a bucket, on rank 0: the saves committed locally and not yet COMPLETE in the bucket, and why; None
        while the bucket keeps up (one save in flight with no error is keeping up)."""
        return self.tier.backlog() if self.tier is not None else None

    def report_published(self) -> None:
        """Hand what the bucket completed since the last call to ``on_commit`` (the job agent's lastCheckpoint)."""
        if self.tier is None:
            return
        if self.metrics is not None:
            self.metrics.checkpoint_uploads_pending.set(self.tier.uploads_pending())
        with self._published_lock:
            published, self._published = self._published, []
        for manifest in published:
            if self.options.on_commit is not None:
                self.options.on_commit(manifest)

    def close_tier(self, flush: bool = True) -> None:
        """With a bucket: let this rank's uploads and rank 0's publication finish (bounded; not with ``flush``
        False), stop them, and report what the bucket completed. Once only."""
        if self.tier is None or self._tier_closed:
            return
        self._tier_closed = True
        if flush and not self.tier.flush(self.options.upload_flush_timeout_s):
            log.error(
                "checkpoint uploads did not finish within %.0f s: the saves not yet COMPLETE in the bucket stay "
                "on the local tier only",
                self.options.upload_flush_timeout_s,
            )
        self.tier.close()
        self.report_published()

    # ---- retention ----------------------------------------------------------------------------------------
    def join_retention(self) -> None:
        """Wait for the retention threads (the volume's, the local tier's) this group started."""
        self.committer.join_retention()
        if self.tier is not None:
            self.tier.join_retention()


def _merged(gathered: list[Any]) -> dict[str, FileDigest]:
    """Every rank's digests, as one mapping of file name to digest."""
    files: dict[str, FileDigest] = {}
    for g in gathered:
        files.update({k: FileDigest(**v) for k, v in g["digests"].items()})
    return files
