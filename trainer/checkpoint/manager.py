"""Checkpoint manager over ``torch.distributed.checkpoint``: when to save, the save's collectives, resume.

What is saved is in :mod:`disttrain.trainer.checkpoint.state`; the commit across the group and retention in
:mod:`disttrain.trainer.checkpoint.groupcommit` (rank 0's part on the volume in
:mod:`disttrain.trainer.checkpoint.committer`). A save:

1. every rank writes its DCP files under a temporary directory named from a per-save nonce equal on all ranks;
2. every rank fsyncs and digests the files it wrote (in parallel), and sends the digests to rank 0;
3. rank 0 commits (:meth:`GroupCommit.commit`: fence check, COMPLETE.json, rename to ``step-N``, retention) and
   broadcasts whether it did.

Before it resumes, every new group claims the next fence round; resume picks the newest valid checkpoint in
``(fence round, step)`` order. A failed save removes its own temporary directory at once (a full disk must not
stay full).

Async saves (``dcp.async_save`` on a separate gloo group) stage the state (an in-memory copy) in a background
thread that overlaps the next forward/backward; only the next ``optimizer.step()`` waits for the copy to finish
(:meth:`CheckpointManager.before_optimizer_step`), since that is the first thing to modify saved tensors. The
DCP write runs in the background too, and step 2 in a helper thread; step 3 runs at the first step boundary at
which every rank reports its part done
(agreed by one tiny all-reduce per boundary, so no rank runs ahead of a failed save). A failed save is counted,
logged and retried synchronously at that boundary; ``max_consecutive_failures`` failures in a row end the
process with a retryable error rather than training on without a recoverable state.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from disttrain.api.manifest import CheckpointManifest
from disttrain.api.spec import CheckpointSpec
from disttrain.trainer.checkpoint import commit, storage
from disttrain.trainer.checkpoint.committer import CheckpointPhase, PhaseHook
from disttrain.trainer.checkpoint.groupcommit import CheckpointFailedError, GroupCommit, InSaveGroup, SaveGroup
from disttrain.trainer.checkpoint.objectstore import Published
from disttrain.trainer.checkpoint.saving import InFlightSave, ShardWriter, Written
from disttrain.trainer.checkpoint.state import ModelOptimState, SchedulerState, TrainerState
from disttrain.trainer.checkpoint.tiered import BucketTier
from disttrain.trainer.checkpoint.uploads import RetryPolicy
from disttrain.trainer.metrics import TrainerMetrics

__all__ = [
    "CheckpointFailedError",
    "CheckpointManager",
    "CheckpointPhase",
    "ManagerOptions",
    "ModelOptimState",
    "PhaseHook",
    "SchedulerState",
    "TrainerState",
]

log = logging.getLogger("disttrain.trainer")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ManagerOptions:
    """How a :class:`CheckpointManager` reports and retries, besides the policy of ``spec.checkpoint``."""

    metrics: Optional[TrainerMetrics] = None
    max_consecutive_failures: int = 2
    """Saves that may fail in a row before the trainer stops (a full disk, a lost volume)."""
    writer_threads: int = 2
    """DCP's writer threads per rank."""
    on_commit: Optional[Callable[[CheckpointManifest], None]] = None
    """Called on rank 0 after each commit (the trainer tells the job agent)."""
    on_phase: Optional[PhaseHook] = None
    """Called at each :class:`CheckpointPhase` of a save (tests inject faults there)."""
    job_uid: str = ""
    """The job's uid, kept in the fence (:mod:`disttrain.trainer.checkpoint.fence`)."""
    node: str = ""
    """This worker's node (pod) name, kept in the fence."""
    upload_retry: Optional[RetryPolicy] = None
    """With ``spec.uri``: the backoff of uploads and of the publication while the bucket fails."""
    upload_flush_timeout_s: float = 300.0
    """With ``spec.uri``: how long :meth:`CheckpointManager.close` waits for uploads in flight and their COMPLETE."""


class CheckpointManager(InSaveGroup):
    """Owns the "when" (interval in steps or seconds, the last step, a drain) and the "how" of checkpoints."""

    def __init__(
        self,
        root: Path,
        spec: CheckpointSpec,
        rank: int,
        world_size: int,
        group: Optional[dist.ProcessGroup],
        options: Optional[ManagerOptions] = None,
    ) -> None:
        options = options or ManagerOptions()
        self.where = SaveGroup(Path(root), spec, rank, world_size, group, options)
        self.commits = GroupCommit(self.where)
        """The commit of each save across the group, retention, the fence round and, with a bucket, its tier."""
        self.tier: Optional[BucketTier] = self.commits.tier
        """With ``spec.uri``: the bucket, reached through the local tier at ``root`` (the commits' own)."""
        self.last_save_time = time.monotonic()
        self.last_saved_step: Optional[int] = None
        self.loaded_step: Optional[int] = None
        self.pending: Optional[InFlightSave] = None
        self.writer = ShardWriter(
            rank, group, options.writer_threads, lambda step: self.commits.phase(CheckpointPhase.FILES_WRITTEN, step)
        )
        self._saves = 0
        self.blocked_s = 0.0  # total seconds training waited for saves (sync saves, async kick-off and staging)
        self.last_save_blocking_s: Optional[float] = None  # the newest save's blocking part (intervalSteps: auto)
        self.agreed_interval: Optional[int] = None  # intervalSteps: auto, rank 0's interval as the group agreed it
        self._resume_from: Optional[Published] = None
        if rank == 0 or self.tier is not None:
            self.root.mkdir(parents=True, exist_ok=True)

    # ---- when ---------------------------------------------------------------------------------------------
    def should_save(self, step: int, last: bool = False) -> bool:
        """Due by step interval or because it is the last step. Every rank decides alike from the step alone;
        the seconds interval is rank 0's clock (:meth:`seconds_due`), agreed through the loop's boundary
        all-reduce."""
        if step == self.last_saved_step:
            return False
        if last:
            return True
        if self.spec.auto_interval:
            if self.agreed_interval is None:
                return False  # no agreement yet (the first boundary of a process)
            since = self.last_saved_step if self.last_saved_step is not None else (self.loaded_step or 0)
            return step - since >= self.agreed_interval
        interval = self.spec.interval_steps
        if not isinstance(interval, int) or not interval:
            return False
        return step % interval == 0

    def seconds_due(self) -> bool:
        interval = self.spec.interval_seconds
        if not interval:
            return False
        return time.monotonic() - self.last_save_time >= interval

    # ---- save ---------------------------------------------------------------------------------------------
    def save(self, step: int, state: dict[str, Any], manifest: CheckpointManifest, force_sync: bool = False) -> None:
        """Start (async) or do (sync) a save of ``state`` at ``step``. Collective: every rank calls it."""
        t_call = time.monotonic()  # waiting for the previous save is this save's cost when they come too often
        if self.pending is not None:
            self.wait_pending()
        t0 = time.monotonic()
        nonce = self._nonce()
        tmp = self.root / commit.tmp_dir_name(step, nonce, self.commits.claim_round())
        self.last_saved_step = step
        self.last_save_time = time.monotonic()
        if self.spec.async_save and not force_sync:
            self.pending = self.writer.start(step, tmp, state, manifest)
            self.last_save_blocking_s = time.monotonic() - t_call
            self.blocked_s += self.pending.blocking_s
            self._observe("blocking", self.pending.blocking_s)
            return
        self._commit(step, tmp, manifest, self.writer.write(step, tmp, state))
        self.last_save_blocking_s = time.monotonic() - t0
        self.blocked_s += time.monotonic() - t0
        self._observe("blocking", time.monotonic() - t0)

    def before_optimizer_step(self) -> float:
        """Wait for an async save's staging copy before tensors it copies change; returns seconds blocked."""
        if self.writer.staging is None:
            return 0.0
        t0 = time.monotonic()
        self.writer.wait_staging()
        blocked = time.monotonic() - t0
        self.last_save_blocking_s = (self.last_save_blocking_s or 0.0) + blocked  # staging is the save's cost too
        self.blocked_s += blocked
        self._observe("blocking", blocked)
        return blocked

    def poll(self, all_done: bool) -> None:
        """Called at a step boundary with the group's agreement that every rank finished its part."""
        if self.pending is not None and all_done:
            self._complete_pending(self.pending)

    def local_pending_state(self) -> tuple[int, int]:
        """(in flight and not done here, failed here) for the boundary all-reduce."""
        p = self.pending
        if p is None:
            return 0, 0
        return (0 if p.done.is_set() else 1), (1 if p.done.is_set() and p.error is not None else 0)

    def wait_pending(self) -> None:
        """Block until the save in flight is committed or has failed (collective)."""
        self.before_optimizer_step()
        if self.pending is not None:
            self.pending.done.wait()
            self._barrier()
            self._complete_pending(self.pending)

    def _complete_pending(self, p: InFlightSave) -> None:
        self.pending = None
        self._commit(p.step, p.tmp, p.manifest, (p.digests, p.error))
        self._observe("background", time.monotonic() - p.started)

    def _commit(self, step: int, tmp: Path, manifest: CheckpointManifest, written: Written) -> None:
        protected = {self.loaded_step} if self.loaded_step is not None else set()
        if not self.commits.commit(step, tmp, manifest, written, protected):
            self.last_saved_step = None
            self.commits.stop_if_exhausted()

    @property
    def retry_due(self) -> bool:
        """A failed save is retried (synchronously) at the next boundary."""
        failures = self.commits.consecutive_failures
        return 0 < failures < self.options.max_consecutive_failures and self.last_saved_step is None

    # ---- load ---------------------------------------------------------------------------------------------
    def find_latest(self) -> Optional[CheckpointManifest]:
        """Rank 0 validates (newest first, reasons logged) and broadcasts the choice."""
        self.commits.claim_round()  # this group takes the fence before it decides what to resume from
        if self.tier is not None:
            return self._find_latest_in_tiers()
        choice: list[Any] = [None]
        if self.rank == 0:
            found = self.commits.committer.find_latest()
            if found is not None:
                choice[0] = found.model_dump_json()
        dist.broadcast_object_list(choice, src=0, group=self.group)
        return CheckpointManifest.model_validate_json(choice[0]) if choice[0] else None

    def _find_latest_in_tiers(self) -> Optional[CheckpointManifest]:
        """With a bucket: the newest checkpoint every local tier holds complete when it is at least as new as the
        bucket's newest trusted one, else the bucket's (fetched into the tiers by :meth:`load`)."""
        assert self.tier is not None
        local = self.tier.local_latest() if self.tier.is_leader else None
        steps: list[Any] = [None] * self.world_size
        dist.all_gather_object(steps, (self.tier.is_leader, local.step if local else None), group=self.group)
        choice: list[Any] = [None]
        if self.rank == 0:
            local_steps = {step for leader, step in steps if leader}
            found = self.tier.store.find_latest()
            self.commits.note_bucket_step(found.manifest.step if found is not None else None)
            everywhere = local is not None and local_steps == {local.step}
            if local is not None and everywhere and (found is None or local.step >= found.manifest.step):
                log.info(
                    "resuming from the local tier's step-%d (the bucket's newest: %s)",
                    local.step,
                    found.manifest.step if found else "none",
                )
                choice[0] = ("local", local.model_dump_json(), "")
            elif found is not None:
                location = self.tier.store.location
                log.info("resuming from s3://%s/%s", location.bucket, location.key(found.key_prefix))
                choice[0] = ("bucket", found.manifest.model_dump_json(), found.key_prefix)
        dist.broadcast_object_list(choice, src=0, group=self.group)
        if choice[0] is None:
            return None
        source, manifest_json, key_prefix = choice[0]
        manifest = CheckpointManifest.model_validate_json(manifest_json)
        self._resume_from = Published(manifest, key_prefix) if source == "bucket" else None
        return manifest

    def _fetch_into_tiers(self, published: Published) -> None:
        """Every tier's leader downloads the bucket's checkpoint (verified byte for byte); collective."""
        assert self.tier is not None
        problem = ""
        if self.tier.is_leader:
            try:
                self.tier.download(published)
            except Exception as exc:  # noqa: BLE001
                problem = f"rank {self.rank}: {type(exc).__name__}: {exc}"
        problems: list[Any] = [None] * self.world_size
        dist.all_gather_object(problems, problem, group=self.group)
        if any(problems):
            raise OSError(
                f"checkpoint step-{published.manifest.step} could not be fetched from the bucket: "
                + "; ".join(p for p in problems if p)
            )

    def load(self, manifest: CheckpointManifest, state: dict[str, Any]) -> None:
        """Load the checkpoint rank 0 chose (collective). Every rank reads through links never and unpickles
        ``.metadata`` only once it matches the manifest's hash."""
        if self._resume_from is not None and self._resume_from.manifest.step == manifest.step:
            self._fetch_into_tiers(self._resume_from)
            self._resume_from = None
        if self.tier is not None and self.tier.publisher is not None:
            self.tier.publisher.protected = {manifest.step}  # bucket retention never deletes what the run loaded
        path = self.commits.committer.step_path(manifest.step)
        if commit.is_link(path):
            raise commit.LinkError(
                errno.ELOOP, "is a symbolic link (links in the checkpoint tree are never followed)", str(path)
            )
        reader = storage.CheckpointReader(str(path), expected_metadata_sha256=manifest.metadata_sha256)
        dcp.load(state, storage_reader=reader, process_group=self.group)
        self.loaded_step = manifest.step
        self.last_saved_step = self.commits.last_committed_step = manifest.step

    # ---- helpers ------------------------------------------------------------------------------------------
    def _nonce(self) -> str:
        """Fresh per save and equal on all ranks: a random session id agreed once, plus a save counter (saves
        are collective, so every rank counts alike). No collective on the per-save path."""
        self.commits.claim_round()
        self._saves += 1
        return f"{self.commits.session}{self._saves:04d}"

    def _barrier(self) -> None:
        dist.barrier(group=self.group)

    def _observe(self, phase: str, seconds: float) -> None:
        if self.metrics is not None:
            self.metrics.save_seconds.labels(phase=phase).observe(seconds)

    def join_retention(self) -> None:
        """Wait for the retention this group's commits started."""
        self.commits.join_retention()

    # ---- in-place reforms ---------------------------------------------------------------------------------
    def abandon(self, timeout_s: float) -> None:
        """The group of this manager ended under it (an in-place reform): let a save in flight finish its local part
        (at most ``timeout_s``: its background collectives fail once a peer is gone, or time out), then drop it. It
        can no longer be committed; rank 0 removes its temporary directory. RuntimeError when it does not finish:
        a thread would still use the old group."""
        try:
            self.before_optimizer_step()
        except Exception as exc:  # noqa: BLE001 - the staging of a save that is dropped anyway
            log.debug("staging of the dropped save failed: %s", exc)
        pending, self.pending = self.pending, None
        if pending is not None:
            if not pending.done.wait(timeout_s):
                raise RuntimeError(f"the save of step {pending.step} did not end within {timeout_s:.0f} s")
            if self.rank == 0:
                self.commits.committer.remove(pending.tmp)
            log.info("the save of step %d in flight was dropped with its group", pending.step)
        self.last_saved_step = self.commits.last_committed_step  # a save the group did not finish is no save
        self.join_retention()

    def successor(self, rank: int, world_size: int, group: Optional[dist.ProcessGroup]) -> CheckpointManager:
        """The manager of the next group of this process (an in-place reform): the same policy and history (last
        save, what was loaded, failures in a row, the agreed automatic interval), a new rank, size and group, and
        a fence round of its own, claimed at its first collective."""
        # The next group claims a round of its own: what this one did not publish yet is not its to publish, and an
        # in-place reform does not wait for the bucket.
        self.commits.close_tier(flush=False)
        successor = CheckpointManager(self.root, self.spec, rank, world_size, group, self.options)
        for name in ("last_save_time", "last_saved_step", "loaded_step", "blocked_s", "last_save_blocking_s"):
            setattr(successor, name, getattr(self, name))
        successor.agreed_interval = self.agreed_interval
        successor.commits.consecutive_failures = self.commits.consecutive_failures
        successor.commits.last_committed_step = self.commits.last_committed_step
        self.writer.close()
        return successor

    def close(self) -> None:
        if self.pending is not None:
            self.wait_pending()
        self.commits.close_tier()
        self.join_retention()
        self.writer.close()
