"""Checkpoint manager over ``torch.distributed.checkpoint``: when to save, the commit, resume and retention.

Model and optimizer go through ``get_state_dict``/``set_state_dict`` (DCP reshards them on load), the trainer
state is a Stateful with global keys (never per rank: RANK is not stable across restarts). The on-disk protocol
is in :mod:`disttrain.trainer.checkpoint.commit`; this module adds the collectives around it:

1. rank 0 picks a fresh temp dir name and broadcasts it; every rank writes its DCP files there;
2. every rank fsyncs and digests the files it wrote (in parallel), and sends the digests to rank 0;
3. rank 0 checks the fence (:mod:`disttrain.trainer.checkpoint.fence`: no newer group took over the directory), writes
   COMPLETE.json atomically (with its fence round), renames the dir to ``step-N`` unless a newer round committed
   (:func:`disttrain.trainer.checkpoint.commit.publish`), fsyncs the parent, applies retention.

Before it resumes, every new group claims the next fence round on the volume; a commit from an older round is
refused, resume picks the newest valid checkpoint in ``(fence round, step)`` order, and retention removes only
temporary directories of its own round or older. A failed save removes its own temporary directory at once (a
full disk must not stay full). Retention reads the new checkpoint back (every digest) before it deletes any
older one; it counts only checkpoints that validate, removes invalid ``step-N`` entries and look-alike names,
and never deletes the newest valid one or the one the run loaded.

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
import datetime
import enum
import errno
import json
import logging
import os
import random
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torch.distributed.checkpoint.stateful import Stateful

from disttrain.api.manifest import MANIFEST_FILE, CheckpointManifest, FileDigest
from disttrain.api.spec import CheckpointSpec
from disttrain.trainer.checkpoint import commit, fence, storage
from disttrain.trainer.metrics import TrainerMetrics

try:
    import numpy as _numpy
except ImportError:  # NumPy is optional: without it there is no NumPy RNG to save
    _numpy = None  # type: ignore[assignment]

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
    damage done here must keep every older checkpoint alive."""


PhaseHook = Callable[[CheckpointPhase, int], None]
"""``on_phase(phase, step)``; see :class:`CheckpointPhase`."""


class ModelOptimState(Stateful):
    """Model + optimizer through DCP's state-dict helpers, which unwrap DDP and initialise lazy optimizer state."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(
            self.model, self.optimizer, model_state_dict=state_dict["model"], optim_state_dict=state_dict["optim"]
        )


class SchedulerState(Stateful):
    """A user's LR scheduler as a Stateful. Only its plain values are saved: its base LRs are recomputed from the
    declared rule after every load anyway."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    def state_dict(self) -> dict[str, Any]:
        return {
            "json": json.dumps(
                {
                    k: v
                    for k, v in self.scheduler.state_dict().items()
                    if isinstance(v, (int, float, str, list, bool, type(None)))
                }
            )
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = json.loads(state_dict["json"])
        saved.pop("base_lrs", None)
        self.scheduler.__dict__.update(saved)


@dataclasses.dataclass
class TrainerState(Stateful):
    """Where training is, in global terms. RNG states (torch, Python, NumPy, CUDA) are saved once (rank 0's) and
    restored on every rank:
    randomness that must be reproducible is keyed by (seed, step, sample), never by rank or by this stream."""

    step: int = 0
    samples_consumed: int = 0
    data_cursor: int = 0
    lr_start_scale: float = -1.0
    lr_target_scale: float = -1.0
    lr_change_step: int = 0
    control_generation: int = -1

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["rng_torch"] = torch.get_rng_state()
        out["rng_python"] = random.getstate()
        if _numpy is not None:
            out["rng_numpy"] = _numpy.random.get_state()
        if torch.cuda.is_available():
            out["rng_cuda"] = torch.cuda.get_rng_state()
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, type(getattr(self, f.name))(state_dict[f.name]))
        torch.set_rng_state(state_dict["rng_torch"])
        random.setstate(state_dict["rng_python"])
        if "rng_numpy" in state_dict and _numpy is not None:
            _numpy.random.set_state(state_dict["rng_numpy"])
        if "rng_cuda" in state_dict and torch.cuda.is_available():
            torch.cuda.set_rng_state(state_dict["rng_cuda"])


class CheckpointFailedError(RuntimeError):
    """Saves kept failing: training on would pile up unrecoverable work."""


@dataclasses.dataclass
class _Pending:
    step: int
    tmp: Path
    manifest: CheckpointManifest
    future: Any
    started: float
    blocking_s: float
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    error: Optional[BaseException] = None
    digests: dict[str, FileDigest] = dataclasses.field(default_factory=dict)
    known: dict[str, tuple[int, str]] = dataclasses.field(default_factory=dict)


def _files_of_rank(directory: Path, rank: int) -> list[str]:
    prefix = f"__{rank}_"
    names = [p.name for p in directory.iterdir() if p.name.startswith(prefix) and p.name.endswith(".distcp")]
    if rank == 0:
        names.append(commit.METADATA_FILE)
    return names


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


class CheckpointManager:
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
        self.options = options
        self.root = Path(root)
        self.spec = spec
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.metrics = options.metrics
        self.max_consecutive_failures = options.max_consecutive_failures
        self.writer_threads = options.writer_threads
        self.consecutive_failures = 0
        self.last_save_time = time.monotonic()
        self.last_saved_step: Optional[int] = None
        self.last_committed_step: Optional[int] = None
        """The newest step this process saw committed (or loaded): what an abandoned save falls back to."""
        self.loaded_step: Optional[int] = None
        self.pending: Optional[_Pending] = None
        self.on_commit = options.on_commit
        self.on_phase = options.on_phase
        self._stager: Optional[DefaultStager] = None
        self._staging: Any = None
        self._retention: Optional[threading.Thread] = None
        self._session: Optional[str] = None
        self.job_uid = options.job_uid
        self.node = options.node
        self.fence_round: Optional[int] = None  # claimed by rank 0 of this group at its first collective
        self._validity: dict[str, tuple[tuple[int, int, int], bool]] = {}  # step dir -> (manifest stat, valid)
        self._saves = 0
        self._plan_key = f"disttrain-{uuid.uuid4().hex}"  # DCP's plan cache is per process: one key each
        self.blocked_s = 0.0  # total seconds training waited for saves (sync saves, async kick-off and staging)
        self.last_save_blocking_s: Optional[float] = None  # the newest save's blocking part (intervalSteps: auto)
        self.agreed_interval: Optional[int] = None  # intervalSteps: auto, rank 0's interval as the group agreed it
        if rank == 0:
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
        tmp = self.root / commit.tmp_dir_name(step, nonce, self._round())
        self.last_saved_step = step
        self.last_save_time = time.monotonic()
        if self.spec.async_save and not force_sync:
            if self._stager is None:
                self._stager = DefaultStager(
                    StagingOptions(
                        use_pinned_memory=torch.cuda.is_available(),
                        use_shared_memory=False,
                        use_async_staging=True,
                        use_non_blocking_copy=torch.cuda.is_available(),
                    )
                )
            writer = self._writer(tmp)
            response = dcp.async_save(
                state,
                storage_writer=writer,
                process_group=self.group,
                async_stager=self._stager,
                planner=self._planner(),
            )
            if isinstance(response, AsyncSaveResponse):
                future, self._staging = response.upload_completion, response.staging_completion
            else:
                future = response
            pending = _Pending(
                step, tmp, manifest, future, started=t0, blocking_s=time.monotonic() - t0, known=writer.digests
            )
            threading.Thread(
                target=self._finish_in_background, args=(pending,), daemon=True, name="disttrain-ckpt-finish"
            ).start()
            self.pending = pending
            self.last_save_blocking_s = time.monotonic() - t_call
            self.blocked_s += pending.blocking_s
            self._observe("blocking", pending.blocking_s)
            return
        try:
            writer = self._writer(tmp)
            dcp.save(state, storage_writer=writer, process_group=self.group, planner=self._planner())
            self._phase(CheckpointPhase.FILES_WRITTEN, step)
            digests = commit.digest_files(tmp, _files_of_rank(tmp, self.rank), known=writer.digests)
            error = None
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - reported collectively below
            # DCP raises CheckpointException (a BaseException) when a rank's write fails, e.g. on a full disk.
            digests, error = {}, exc
        self._commit_collectively(step, tmp, manifest, digests, error)
        self.last_save_blocking_s = time.monotonic() - t0
        self.blocked_s += time.monotonic() - t0
        self._observe("blocking", time.monotonic() - t0)

    def before_optimizer_step(self) -> float:
        """Wait for an async save's staging copy before tensors it copies change; returns seconds blocked."""
        if self._staging is None:
            return 0.0
        t0 = time.monotonic()
        try:
            self._staging.result()
        finally:
            self._staging = None
        blocked = time.monotonic() - t0
        self.last_save_blocking_s = (self.last_save_blocking_s or 0.0) + blocked  # staging is the save's cost too
        self.blocked_s += blocked
        self._observe("blocking", blocked)
        return blocked

    def _finish_in_background(self, pending: _Pending) -> None:
        try:
            pending.future.result()
            self._phase(CheckpointPhase.FILES_WRITTEN, pending.step)
            pending.digests = commit.digest_files(
                pending.tmp, _files_of_rank(pending.tmp, self.rank), known=pending.known
            )
        except BaseException as exc:  # noqa: BLE001
            pending.error = exc
        finally:
            pending.done.set()

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

    def _complete_pending(self, p: _Pending) -> None:
        self.pending = None
        self._commit_collectively(p.step, p.tmp, p.manifest, p.digests, p.error)
        self._observe("background", time.monotonic() - p.started)

    def _commit_collectively(
        self,
        step: int,
        tmp: Path,
        manifest: CheckpointManifest,
        digests: dict[str, FileDigest],
        error: Optional[BaseException],
    ) -> None:
        gathered: list[Any] = [None] * self.world_size
        payload = {
            "digests": {k: v.model_dump() for k, v in digests.items()},
            "error": self._describe(step, error) if error else None,
        }
        dist.all_gather_object(gathered, payload, group=self.group)
        errors = [g["error"] for g in gathered if g["error"]]
        if errors:
            self._failed(step, tmp, "; ".join(sorted(set(errors))))
            return
        committed, problem = True, ""
        if self.rank == 0:
            try:
                self._phase(CheckpointPhase.BEFORE_MANIFEST, step)
                files = {}
                for g in gathered:
                    files.update({k: FileDigest(**v) for k, v in g["digests"].items()})
                meta = files[commit.METADATA_FILE].digest.split(":", 1)[1]
                final_manifest = manifest.model_copy(
                    update={
                        "files": files,
                        "metadata_sha256": meta,
                        "created_at": _now(),
                        "job_uid": self.job_uid or None,
                        "fence_round": self._round(),
                    }
                )
                self.join_retention()  # the previous retention never runs while a step-N is being swapped
                fence.check(self.root, self._round())
                commit.write_manifest(tmp, final_manifest)
                fence.check(self.root, self._round())  # again, as close to the rename as it gets
                self._phase(CheckpointPhase.BEFORE_PUBLISH, step)
                commit.publish(self.root, tmp, step, own_round=self._round())
                self._phase(CheckpointPhase.PUBLISHED, step)
                log.info(
                    "checkpoint step-%d committed (%d files, %.1f MB)",
                    step,
                    len(files),
                    sum(f.size for f in files.values()) / 1e6,
                )
                self._retain(step)
                if self.on_commit is not None:
                    self.on_commit(final_manifest)
            except Exception as exc:  # noqa: BLE001
                log.error("checkpoint step-%d could not be committed: %s", step, exc)
                committed, problem = False, self._describe(step, exc)
        flag: list[Any] = [committed, problem]
        dist.broadcast_object_list(flag, src=0, group=self.group)
        if not flag[0]:
            self._failed(step, tmp, f"rank 0 could not commit: {flag[1]}")
            return
        self.consecutive_failures = 0
        self.last_committed_step = step
        if self.metrics is not None:
            self.metrics.last_complete_step.set(step)

    def _retain(self, committed: int) -> None:
        """Retention (rank 0): temporary directories are chosen now, from one listing (so the next save's temp
        dir, created later, is never among them); checkpoints are validated and deleted in a thread, off the
        critical path. The checkpoint just committed is first read back from the volume (every file's digest):
        until it verifies, no older checkpoint is deleted (with ``keep: 1`` the previous one would otherwise go
        before the new one was ever read). Only checkpoints that validate count towards ``keep``; invalid
        ``step-N`` entries and names that only look like one are removed; the newest valid one, the one just
        committed and the one this run loaded are always kept. Nothing is deleted once a newer group holds the
        fence."""
        self.join_retention()
        own_round = self._round()
        temps = commit.plan_temp_cleanup(self.root, own_round)
        protected = {committed} | ({self.loaded_step} if self.loaded_step is not None else set())
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
                    self._remember_valid(new)
                    fence.check(self.root, own_round)
                    steps = commit.plan_step_deletions(
                        self.root, self.spec.keep, self._is_valid, protected, own_round, log=log.warning
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

    def _is_valid(self, path: Path) -> bool:
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

    def _remember_valid(self, path: Path) -> None:
        key = _manifest_key(path)
        if key is not None:
            self._validity[path.name] = (key, True)

    def join_retention(self) -> None:
        if self._retention is not None:
            self._retention.join()
            self._retention = None

    def _failed(self, step: int, tmp: Path, reason: str) -> None:
        self.consecutive_failures += 1
        if self.metrics is not None:
            self.metrics.checkpoint_failures.inc()
        log.error("checkpoint save at step %d FAILED (%d in a row): %s", step, self.consecutive_failures, reason)
        if self.rank == 0:
            commit.remove_entry(tmp)  # every rank is done with it; a full disk must not stay full
        self.last_saved_step = None
        if self.consecutive_failures >= self.max_consecutive_failures:
            raise CheckpointFailedError(f"{self.consecutive_failures} checkpoint saves in a row failed; last: {reason}")

    @property
    def retry_due(self) -> bool:
        """A failed save is retried (synchronously) at the next boundary."""
        return 0 < self.consecutive_failures < self.max_consecutive_failures and self.last_saved_step is None

    # ---- load ---------------------------------------------------------------------------------------------
    def find_latest(self) -> Optional[CheckpointManifest]:
        """Rank 0 validates (newest first, reasons logged) and broadcasts the choice."""
        self._round()  # this group takes the fence before it decides what to resume from
        choice: list[Any] = [None]
        if self.rank == 0:
            found = commit.find_latest(self.root, log=log.warning)
            if found is not None:
                self._remember_valid(found.path)
            if found is not None and found.manifest is not None:
                choice[0] = found.manifest.model_dump_json()
        dist.broadcast_object_list(choice, src=0, group=self.group)
        return CheckpointManifest.model_validate_json(choice[0]) if choice[0] else None

    def load(self, manifest: CheckpointManifest, state: dict[str, Any]) -> None:
        """Load the checkpoint rank 0 chose (collective). Every rank reads through links never and unpickles
        ``.metadata`` only once it matches the manifest's hash."""
        path = self.root / commit.step_dir_name(manifest.step)
        if commit.is_link(path):
            raise commit.LinkError(
                errno.ELOOP, "is a symbolic link (links in the checkpoint tree are never followed)", str(path)
            )
        reader = storage.RawFileSystemReader(str(path), expected_metadata_sha256=manifest.metadata_sha256)
        dcp.load(state, storage_reader=reader, process_group=self.group)
        self.loaded_step = manifest.step
        self.last_saved_step = self.last_committed_step = manifest.step

    # ---- helpers ------------------------------------------------------------------------------------------
    def _writer(self, tmp: Path) -> storage.RawFileSystemWriter:
        # Two writer threads per rank: on the disks measured here one stream leaves ~25% of dd on the table.
        return storage.RawFileSystemWriter(str(tmp), thread_count=self.writer_threads)

    def _planner(self) -> DefaultSavePlanner:
        """DCP's planner with its plan cache on, under a key of this manager's own: from the second save on,
        an unchanged local plan is not sent, deduplicated and validated again (~8% of a 100 MB save here).
        DCP compares every new local plan with the cached one and replans when the state's layout changed."""
        planner = DefaultSavePlanner(enable_plan_caching=True)
        planner._cached_plans_key = self._plan_key
        return planner

    def _nonce(self) -> str:
        """Fresh per save and equal on all ranks: a random session id agreed once, plus a save counter (saves
        are collective, so every rank counts alike). No collective on the per-save path."""
        self._round()
        self._saves += 1
        return f"{self._session}{self._saves:04d}"

    def _round(self) -> int:
        """This group's fence round: rank 0 claims it on the volume once and broadcasts it with the session id
        (collective the first time; every rank reaches it first through :meth:`find_latest` or a save)."""
        if self.fence_round is None:
            box: list[Any] = [None]
            if self.rank == 0:
                self.root.mkdir(parents=True, exist_ok=True)
                newest = commit.newest_committed(self.root)  # the order never goes back, even without .fence
                claimed = fence.claim(self.root, self.job_uid, self.node, floor=newest[0] if newest else 0)
                log.info("checkpoint fence: this group holds round %d of %s", claimed, self.root)
                box[0] = (claimed, uuid.uuid4().hex[:8])
            dist.broadcast_object_list(box, src=0, group=self.group)
            self.fence_round, self._session = box[0]
        return self.fence_round

    def _describe(self, step: int, error: BaseException) -> str:
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

    def _barrier(self) -> None:
        dist.barrier(group=self.group)

    def _observe(self, phase: str, seconds: float) -> None:
        if self.metrics is not None:
            self.metrics.save_seconds.labels(phase=phase).observe(seconds)

    def _phase(self, phase: CheckpointPhase, step: int) -> None:
        if self.on_phase is not None:
            self.on_phase(phase, step)

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
                commit.remove_entry(pending.tmp)
            log.info("the save of step %d in flight was dropped with its group", pending.step)
        self.last_saved_step = self.last_committed_step  # a save the group did not finish is no save
        self.join_retention()

    def successor(self, rank: int, world_size: int, group: Optional[dist.ProcessGroup]) -> CheckpointManager:
        """The manager of the next group of this process (an in-place reform): the same policy and history (last
        save, what was loaded, failures in a row, the agreed automatic interval), a new rank, size and group, and
        a fence round of its own, claimed at its first collective."""
        successor = CheckpointManager(self.root, self.spec, rank, world_size, group, self.options)
        for name in (
            "consecutive_failures",
            "last_save_time",
            "last_saved_step",
            "last_committed_step",
            "loaded_step",
            "blocked_s",
            "last_save_blocking_s",
            "agreed_interval",
        ):
            setattr(successor, name, getattr(self, name))
        if self._stager is not None:
            self._stager.close()
            self._stager = None
        return successor

    def close(self) -> None:
        if self.pending is not None:
            self.wait_pending()
        self.join_retention()
        if self._stager is not None:
            self._stager.close()
            self._stager = None


def _manifest_key(path: Path) -> Optional[tuple[int, int, int]]:
    try:
        st = os.lstat(path / MANIFEST_FILE)
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat()
