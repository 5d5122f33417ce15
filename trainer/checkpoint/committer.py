"""Rank 0's side of a checkpoint on a volume: the fence claim, the commit, resume's choice and retention.

The collectives are in :mod:`disttrain.trainer.checkpoint.groupcommit`; this class does what only rank 0 does, on
the files of :mod:`disttrain.trainer.checkpoint.commit` under the fence of :mod:`disttrain.trainer.checkpoint
.fence`: it checks the fence, writes COMPLETE.json (with its fence round), renames the temporary directory to
``step-N`` unless a newer round committed, and applies retention. Retention reads the new checkpoint back (every
digest) before it deletes any older one; it counts only checkpoints that validate, removes invalid ``step-N``
entries and look-alike names, never deletes the newest valid one or the one the run loaded, and removes only
temporary directories of its own round or older.
"""

from __future__ import annotations

import datetime
import enum
import logging
import os
import shutil
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Optional

from disttrain.api.manifest import MANIFEST_FILE, CheckpointManifest, FileDigest
from disttrain.api.spec import CheckpointSpec
from disttrain.trainer.checkpoint import commit, fence

log = logging.getLogger("disttrain.trainer")


class CheckpointPhase(str, enum.Enum):
    """Moments of a save at which the manager calls its ``on_phase`` hook with (phase, step).

    The hook is how tests reach inside the commit protocol (kill a process at the worst moment, fail a write,
    hold a commit open) without any test code here; production passes none.
    """

    FILES_WRITTEN = "files_written"
    """Every rank, once DCP has written this rank's files and before they are synced and digested (in the
    background thread for an async save). Raising fails this rank's part of the save."""

    BEFORE_MANIFEST = "before_manifest"
    """Global rank 0, once every rank's files are written and synced, just before COMPLETE.json: a crash here
    leaves a complete-looking directory that resume must never trust. Raising fails the commit."""

    BEFORE_PUBLISH = "before_publish"
    """Global rank 0, after COMPLETE.json and the last fence check, just before the rename to ``step-N``: the
    window a stale rank 0 frozen here would publish in. Raising fails the commit."""

    PUBLISHED = "published"
    """Global rank 0, right after the rename to ``step-N`` and before retention reads the new checkpoint back:
    damage done here must keep every older checkpoint alive. With a bucket (``spec.checkpoint.uri``): the save is
    committed on the local tier and rank 0 has not started uploading it."""

    UPLOADED = "uploaded"
    """With a bucket, every rank (its upload thread), once its files of a save are in the bucket and read back,
    before it records them for the publisher: a crash here leaves objects that no COMPLETE.json lists."""

    BEFORE_BUCKET_MANIFEST = "before_bucket_manifest"
    """With a bucket, global rank 0's publisher thread, once every rank's upload record matched the manifest and
    the fence held, just before the bucket's COMPLETE.json: every object is there, the commit is not."""

    BUCKET_COMPLETE = "bucket_complete"
    """With a bucket, global rank 0's publisher thread, right after the bucket's COMPLETE.json and before the
    bucket's retention: a crash here leaves the new checkpoint and every older one the retention would delete."""


PhaseHook = Callable[[CheckpointPhase, int], None]
"""``on_phase(phase, step)``; see :class:`CheckpointPhase`."""


class Committer:
    """Commit and retention of one group's checkpoints under ``root`` (used on global rank 0)."""

    def __init__(
        self,
        root: Path,
        spec: CheckpointSpec,
        *,
        job_uid: str = "",
        node: str = "",
        on_phase: Optional[PhaseHook] = None,
        on_commit: Optional[Callable[[CheckpointManifest], None]] = None,
    ) -> None:
        self.root = root
        self.spec = spec
        self.job_uid = job_uid
        self.node = node
        self.on_phase = on_phase
        self.on_commit = on_commit
        self.round: Optional[int] = None
        self._retention: Optional[threading.Thread] = None
        self._validity: dict[str, tuple[tuple[int, int, int], bool]] = {}  # step dir -> (manifest stat, valid)

    def claim_round(self) -> int:
        """Claim this group's fence round on the volume (once)."""
        if self.round is None:
            self.root.mkdir(parents=True, exist_ok=True)
            newest = commit.newest_committed(self.root)  # the order never goes back, even without .fence
            self.round = fence.claim(self.root, self.job_uid, self.node, floor=newest[0] if newest else 0)
            log.info("checkpoint fence: this group holds round %d of %s", self.round, self.root)
        return self.round

    def phase(self, phase: CheckpointPhase, step: int) -> None:
        if self.on_phase is not None:
            self.on_phase(phase, step)

    def commit(
        self, step: int, tmp: Path, manifest: CheckpointManifest, files: dict[str, FileDigest], protected: Iterable[int]
    ) -> CheckpointManifest:
        """Publish ``tmp`` (every rank's files written and synced) as ``step-N``, then start retention; raises
        when it cannot (fenced, disk full, a phase hook)."""
        own_round = self.claim_round()
        self.phase(CheckpointPhase.BEFORE_MANIFEST, step)
        meta = files[commit.METADATA_FILE].digest.split(":", 1)[1]
        final_manifest = manifest.model_copy(
            update={
                "files": files,
                "metadata_sha256": meta,
                "created_at": _now(),
                "job_uid": self.job_uid or None,
                "fence_round": own_round,
            }
        )
        self.join_retention()  # the previous retention never runs while a step-N is being swapped
        fence.check(self.root, own_round)
        commit.write_manifest(tmp, final_manifest)
        fence.check(self.root, own_round)  # again, as close to the rename as it gets
        self.phase(CheckpointPhase.BEFORE_PUBLISH, step)
        commit.publish(self.root, tmp, step, own_round=own_round)
        self.phase(CheckpointPhase.PUBLISHED, step)
        log.info(
            "checkpoint step-%d committed (%d files, %.1f MB)",
            step,
            len(files),
            sum(f.size for f in files.values()) / 1e6,
        )
        self.retain(step, protected)
        if self.on_commit is not None:
            self.on_commit(final_manifest)
        return final_manifest

    def retain(self, committed: int, protected: Iterable[int] = ()) -> None:
        """Temporary directories are chosen now, from one listing (so the next save's temp dir, created later, is
        never among them); checkpoints are validated and deleted in a thread, off the critical path. The
        checkpoint just committed is first read back (every file's digest): until it verifies, no older
        checkpoint is deleted (with ``keep: 1`` the previous one would otherwise go before the new one was ever
        read). Nothing is deleted once a newer group holds the fence."""
        self.join_retention()
        own_round = self.claim_round()
        temps = commit.plan_temp_cleanup(self.root, own_round)
        keep = {committed, *protected}
        new = self.root / commit.step_dir_name(committed)

        def run() -> None:
            try:
                readback = commit.validate(new)
                if not readback.ok:
                    log.error(
                        "checkpoint %s does not read back (%s): retention keeps every older checkpoint",
                        new.name,
                        readback.problem,
                    )
                    steps: list[str] = []
                else:
                    self.remember_valid(new)
                    fence.check(self.root, own_round)
                    steps = commit.plan_step_deletions(
                        self.root, self.spec.keep, self.is_valid, keep, own_round, log=log.warning
                    )
                fence.check(self.root, own_round)
                deleted = commit.delete(self.root, steps + temps)
                fence.retire_older(self.root, own_round)
            except fence.FencedError as exc:
                log.error("retention skipped: %s", exc)
                return
            if deleted:
                log.info("retention removed %s", ", ".join(deleted))

        self._retention = threading.Thread(target=run, name="disttrain-retention", daemon=True)
        self._retention.start()

    def join_retention(self) -> None:
        if self._retention is not None:
            self._retention.join()
            self._retention = None

    def find_latest(self) -> Optional[CheckpointManifest]:
        """The newest valid checkpoint (reasons for each rejected one logged)."""
        found = commit.find_latest(self.root, log=log.warning)
        if found is None:
            return None
        self.remember_valid(found.path)
        return found.manifest

    def step_path(self, step: int) -> Path:
        return self.root / commit.step_dir_name(step)

    def remove(self, tmp: Path) -> None:
        """Drop a save that will not be committed (every rank is done with it; a full disk must not stay full)."""
        commit.remove_entry(tmp)

    def is_valid(self, path: Path) -> bool:
        """Full validation, remembered per manifest (a checkpoint is read once per run, not at every commit)."""
        key = _manifest_key(path)
        if key is None:
            return False
        known = self._validity.get(path.name)
        if known is not None and known[0] == key:
            return known[1]
        v = commit.validate(path)
        ok = v.ok
        if not ok:
            log.warning("checkpoint %s does not validate (%s): retention removes it", path.name, v.problem)
        self._validity[path.name] = (key, ok)
        return ok

    def remember_valid(self, path: Path) -> None:
        key = _manifest_key(path)
        if key is not None:
            self._validity[path.name] = (key, True)

    def describe(self, step: int, error: BaseException) -> str:
        """The error a rank reports for its part of a failed save; a full disk says so, with the free space."""
        if commit.is_disk_full(error):
            try:
                usage = shutil.disk_usage(self.root)
                space = f"{usage.free / 1e6:.1f} MB free of {usage.total / 1e6:.1f} MB"
            except OSError:
                space = "free space unknown"
            return (
                f"disk full (ENOSPC) writing checkpoint step-{step} under {self.root} ({space}): the partial save "
                f"is removed and older checkpoints are kept; free space on the checkpoint volume ({error!r:.300})"
            )
        return repr(error)


def _manifest_key(path: Path) -> Optional[tuple[int, int, int]]:
    try:
        st = os.lstat(path / MANIFEST_FILE)
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat()
