"""Checkpoints in a bucket (``spec.checkpoint.uri``), tiered through the node's local disk.

A save is committed on the local tier first (every rank's files under ``<local root>/step-N`` with COMPLETE.json,
as on a volume), and training goes on. Then, in the background:

1. every rank uploads the files it wrote (:class:`~disttrain.trainer.checkpoint.uploads.Uploader`: multipart,
   retried with backoff while the bucket cannot be reached) and, once they are read back, records what it uploaded
   (sizes, digests, ETags) in ``step-N/r<R>/.uploaded/rank-<k>.json``;
2. global rank 0's :class:`Publisher` waits until every rank of the group recorded its part, checks that the
   records cover the save's manifest exactly, and writes the bucket's COMPLETE.json
   (:meth:`ObjectStoreCommitter.publish`, fenced by round), then applies the bucket's retention.

So a slow or unreachable bucket delays COMPLETE, never a training step; a save whose uploads never finish is never
published. Local copies are removed once the bucket holds a newer COMPLETE one, and at most
:data:`MAX_LOCAL_COPIES` are kept while the bucket is behind (the oldest give way and their uploads are dropped,
except a save some rank of the tier is uploading right now: ``<local root>/.upload-in-flight-rank<k>``).

Every node has a local tier of its own (an emptyDir): a tier is the set of ranks that share one directory on one
host, and its lowest rank (the tier's leader) renames, downloads and deletes there. Resume takes the newest
checkpoint the local tiers all hold complete when it is at least as new as the bucket's newest trusted one (no
download), else downloads the bucket's into every tier and loads that.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Optional

from disttrain.api.manifest import MANIFEST_FILE, CheckpointManifest, FileDigest
from disttrain.api.spec import CheckpointSpec
from disttrain.trainer.checkpoint import commit
from disttrain.trainer.checkpoint.committer import CheckpointPhase, PhaseHook
from disttrain.trainer.checkpoint.fence import FencedError
from disttrain.trainer.checkpoint.objectstore import ObjectStoreCommitter, Published, parse_uri
from disttrain.trainer.checkpoint.uploadprocess import DescribedCommitter, RemoteStore, StoreRecipe
from disttrain.trainer.checkpoint.uploads import RetryPolicy, Upload, Uploader, lower_this_threads_priority

log = logging.getLogger("disttrain.trainer")

UPLOADED = ".uploaded"
"""Folder of a save's prefix holding each rank's record of what it uploaded."""
POLL_MAX_S = 2.0
"""The publisher's longest wait between two looks for the ranks' upload records (a new save wakes it sooner)."""
FLUSH_POLL_S = 0.5
"""How often a rank other than 0 looks for the newest save's COMPLETE.json while it waits at exit."""
MAX_LOCAL_COPIES = 3
IN_FLIGHT_PREFIX = ".upload-in-flight-rank"
"""A rank's file in the local tier naming the step it is uploading now: retention keeps that step's files."""
"""Local copies a tier keeps at most while the bucket is behind: what an unreachable bucket can pile up."""


def bucket_committer(
    spec: CheckpointSpec, job_uid: str = "", node: str = "", retry: Optional[RetryPolicy] = None
) -> DescribedCommitter:
    """The committer of ``spec.uri`` with the client ``spec.s3`` describes (credentials from the environment) and
    the request timeouts of ``retry``; an upload process builds its twin from its recipe."""
    assert spec.uri is not None
    s3 = spec.s3
    retry = retry or RetryPolicy()
    recipe = StoreRecipe(
        location=parse_uri(spec.uri),
        endpoint=s3.endpoint if s3 else None,
        region=s3.region if s3 else None,
        addressing_style=s3.addressing_style.value if s3 else "auto",
        timeouts=(retry.connect_timeout_s, retry.read_timeout_s),
        job_uid=job_uid,
        node=node,
    )
    return recipe.committer()


def tier_identity(root: Path) -> str:
    """What ranks sharing one local tier have in common: the host and the directory."""
    return f"{socket.gethostname()}:{os.path.realpath(root)}"


def steps_in_flight(root: Path) -> set[int]:
    """The steps that ranks of the tier at ``root`` are uploading now."""
    steps = set()
    for marker in root.glob(f"{IN_FLIGHT_PREFIX}*"):
        try:
            steps.add(int(marker.read_text()))
        except (OSError, ValueError):
            continue  # removed meanwhile, or being written
    return steps


def tier_leaders(identities: list[str]) -> dict[str, int]:
    """Tier identity -> its lowest rank (``identities[rank]``)."""
    leaders: dict[str, int] = {}
    for rank, identity in enumerate(identities):
        leaders.setdefault(identity, rank)
    return leaders


def record_key(store: ObjectStoreCommitter, step: int, round_: int, rank: int) -> str:
    return store.location.key(f"step-{step}/r{round_}", UPLOADED, f"rank-{rank}.json")


class RecordingStore:
    """The store an :class:`Uploader` of rank ``rank`` uploads through: after the files of a save are uploaded and
    read back, it records them (with their ETags) for the publisher."""

    def __init__(self, store: ObjectStoreCommitter, rank: int, on_phase: Optional[PhaseHook] = None) -> None:
        self.store = store
        self.rank = rank
        self.on_phase = on_phase

    def upload_files(
        self, local_dir: Path, step: int, files: dict[str, FileDigest], round_: int
    ) -> dict[str, FileDigest]:
        uploaded = self.store.upload_files(local_dir, step, files, round_) if files else {}
        if self.on_phase is not None:
            self.on_phase(CheckpointPhase.UPLOADED, step)
        body = json.dumps({name: d.model_dump(mode="json") for name, d in uploaded.items()}).encode()
        self.store.client.put_object(
            Bucket=self.store.location.bucket, Key=record_key(self.store, step, round_, self.rank), Body=body
        )
        return uploaded


@dataclasses.dataclass(frozen=True)
class PublishOptions:
    """How a job's saves reach the bucket: shared by a rank's :class:`BucketTier` and rank 0's :class:`Publisher`."""

    keep: int
    """COMPLETE saves the bucket keeps (``spec.checkpoint.keep``)."""
    on_published: Callable[[CheckpointManifest], None]
    """Called on rank 0 with each save's manifest once its COMPLETE.json is in the bucket."""
    retry: RetryPolicy = dataclasses.field(default_factory=RetryPolicy)
    on_phase: Optional[PhaseHook] = None


@dataclasses.dataclass
class PendingPublish:
    manifest: CheckpointManifest
    """The save's manifest as committed locally (every rank's files, fence_round: the bucket round)."""


class Publisher:
    """Global rank 0's thread: publishes a save's COMPLETE.json once every rank recorded its upload, newest first
    (an older save still waiting once a newer one is complete is dropped), then applies the bucket's retention."""

    def __init__(self, store: ObjectStoreCommitter, world_size: int, options: PublishOptions) -> None:
        self.store = store
        self.world_size = world_size
        self.keep = options.keep
        self.on_published = options.on_published
        self.retry = options.retry
        self.on_phase = options.on_phase or (lambda phase, step: None)
        self.protected: set[int] = set()
        self.published_step: Optional[int] = None
        self.last_error = ""
        self._pending: list[PendingPublish] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._fenced = False
        self._thread: Optional[threading.Thread] = None

    def submit(self, manifest: CheckpointManifest) -> None:
        with self._lock:
            self._pending.append(PendingPublish(manifest))
            self._idle.clear()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="disttrain-publish", daemon=True)
                self._thread.start()
        self._wake.set()

    def waiting_steps(self) -> list[int]:
        """Steps submitted and not published yet, oldest first."""
        with self._lock:
            return [p.manifest.step for p in self._pending]

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until nothing is left to publish; False on timeout."""
        return self._idle.wait(timeout_s)

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(10)

    def _records(self, pending: PendingPublish) -> Optional[dict[str, FileDigest]]:
        """Every rank's uploaded files of a save, or None while some rank has not recorded its part."""
        m = pending.manifest
        prefix = self.store.location.key(f"step-{m.step}/r{m.fence_round}", UPLOADED) + "/"
        keys = self.store._list(prefix)
        if len(keys) < self.world_size:
            return None
        files: dict[str, FileDigest] = {}
        for key in keys:
            body = self.store.client.get_object(Bucket=self.store.location.bucket, Key=key)["Body"].read()
            files.update({name: FileDigest(**d) for name, d in json.loads(body).items()})
        return files

    def _publish(self, pending: PendingPublish, uploaded: dict[str, FileDigest]) -> None:
        m = pending.manifest
        expected = {n: (d.size, d.digest) for n, d in m.files.items()}
        if {n: (d.size, d.digest) for n, d in uploaded.items()} != expected:
            raise OSError(f"checkpoint step-{m.step}: the ranks' upload records do not match its manifest")
        final = m.model_copy(update={"files": {n: uploaded[n] for n in m.files}})
        key = self.store.publish(final, lambda: self.on_phase(CheckpointPhase.BEFORE_BUCKET_MANIFEST, m.step))
        self.published_step = m.step
        self.on_phase(CheckpointPhase.BUCKET_COMPLETE, m.step)
        log.info(
            "checkpoint step-%d complete in s3://%s/%s (%d objects, %.1f MB)",
            m.step,
            self.store.location.bucket,
            key,
            len(uploaded),
            sum(d.size for d in uploaded.values()) / 1e6,
        )
        self.on_published(final)

    def _run(self) -> None:
        lower_this_threads_priority()
        delay = self.retry.initial_s / 4
        while not self._stop.is_set():
            with self._lock:
                pending = list(self._pending)
            if not pending or self._fenced:
                self._idle.set()
                self._wake.wait(1.0)
                self._wake.clear()
                continue
            try:
                done: Optional[tuple[PendingPublish, dict[str, FileDigest]]] = None
                for item in reversed(pending):  # newest first: an older save is of no use once a newer one is in
                    records = self._records(item)
                    if records is not None:
                        done = (item, records)
                        break
                if done is not None:
                    self._publish(*done)
                    with self._lock:
                        self._pending = [p for p in self._pending if p.manifest.step > done[0].manifest.step]
                        in_flight = [f"step-{p.manifest.step}/r{p.manifest.fence_round}" for p in self._pending]
                    self.store.retain(self.keep, self.protected, in_flight)
                    self.last_error, delay = "", self.retry.initial_s / 4
                    continue
            except FencedError as exc:
                log.error("checkpoint publishing stops: %s", exc)
                self._fenced = True
                continue
            except Exception as exc:  # noqa: BLE001 - a bucket that fails delays COMPLETE, never training
                self.last_error = f"{type(exc).__name__}: {exc}"[:500]
                log.warning("publishing checkpoint step-%d waits: %s", pending[-1].manifest.step, self.last_error)
                delay = min(max(delay, self.retry.initial_s) * 2, self.retry.max_s)
            else:
                delay = min(delay * 2, POLL_MAX_S)
            self._wake.wait(delay)  # the ranks' records are polled, sooner when a new save comes
            self._wake.clear()


class BucketTier:
    """One rank's side of a job's checkpoints in a bucket: its uploads, its tier's local copies and, on global
    rank 0, the publisher."""

    def __init__(self, store: ObjectStoreCommitter, root: Path, rank: int, options: PublishOptions) -> None:
        self.store = store
        self.root = root
        self.rank = rank
        self.options = options
        remote = (
            RemoteStore(dataclasses.replace(store.recipe, record_rank=rank), options.on_phase)
            if isinstance(store, DescribedCommitter)
            else None
        )  # the uploads in a process of their own, where the store can be built there
        self.uploader = Uploader(
            RecordingStore(store, rank, options.on_phase), options.retry, remote, root / f"{IN_FLIGHT_PREFIX}{rank}"
        )
        self.uploader.start()
        self.publisher: Optional[Publisher] = None
        self.is_leader = False
        self.world_size = 1
        self._retention: Optional[threading.Thread] = None
        self._newest: Optional[CheckpointManifest] = None

    def join_group(self, identities: list[str], world_size: int) -> None:
        """The group's tiers (``identities[rank]``, from an all-gather): who leads this tier."""
        self.world_size = world_size
        self.is_leader = tier_leaders(identities)[identities[self.rank]] == self.rank
        if self.rank == 0 and self.publisher is None:
            self.publisher = Publisher(self.store, world_size, self.options)

    def local_latest(self) -> Optional[CheckpointManifest]:
        found = commit.find_latest(self.root, log=log.warning)
        return found.manifest if found is not None else None

    def after_local_commit(self, manifest: CheckpointManifest, mine: dict[str, FileDigest], local_round: int) -> Upload:
        """Start this rank's upload of a save committed locally (and on rank 0 its publication); returns at once."""
        behind = self.uploader.pending()
        if behind:
            oldest = behind[0]
            log.warning(
                "checkpoint bucket behind: %d earlier save(s) of this rank not uploaded yet (oldest step-%d, %d "
                "attempts, last error: %s); training goes on, local copies are kept",
                len(behind),
                oldest.step,
                oldest.attempts,
                oldest.last_error or "none",
            )
        self._newest = manifest
        local_dir = self.root / commit.step_dir_name(manifest.step)
        assert manifest.fence_round is not None
        upload = self.uploader.submit(manifest.step, local_dir, mine, manifest.fence_round)
        if self.publisher is not None:
            self.publisher.submit(manifest)
        if self.is_leader:
            self._retain_locally(manifest.step, local_round)
        return upload

    def backlog(self) -> Optional[str]:
        """Rank 0's account of the saves not yet COMPLETE in the bucket (for ``status.checkpointUpload``)."""
        if self.publisher is None:
            return None
        waiting = self.publisher.waiting_steps()
        behind = self.uploader.pending()
        error = self.publisher.last_error or next((u.last_error for u in behind if u.last_error), "")
        if not waiting or (len(waiting) == 1 and not error):
            return None
        text = f"{len(waiting)} save(s) not yet COMPLETE in the bucket (oldest step-{waiting[0]})"
        return (f"{text}: {error}" if error else text)[:512]

    def uploads_pending(self) -> int:
        return len(self.uploader.pending())

    def _retain_locally(self, newest: int, local_round: int) -> None:
        """In a thread: delete local copies older than the bucket's newest COMPLETE one, and the oldest beyond
        :data:`MAX_LOCAL_COPIES` (never ``newest`` or a newer one, never one that a rank of the tier is uploading);
        and the temporary directories of failed saves of this group or older ones, chosen now (the next save's is
        created later)."""
        self.join_retention()
        temps = commit.plan_temp_cleanup(self.root, local_round)

        def run() -> None:
            commit.delete(self.root, temps)
            published = self._published_step()
            uploading = steps_in_flight(self.root)
            steps = sorted(s for s, _ in commit.step_dirs(self.root))
            doomed = [s for s in steps if published is not None and s < published and s not in (newest, *uploading)]
            kept = [s for s in steps if s not in doomed]
            removable = [s for s in kept if s < newest and s not in uploading]
            doomed += removable[: max(0, len(kept) - MAX_LOCAL_COPIES)]
            removed = commit.delete(self.root, [commit.step_dir_name(s) for s in sorted(set(doomed))])
            if removed:
                log.info("local tier: removed %s", ", ".join(removed))

        self._retention = threading.Thread(target=run, name="disttrain-local-retention", daemon=True)
        self._retention.start()

    def _published_step(self) -> Optional[int]:
        if self.publisher is not None:
            return self.publisher.published_step
        try:
            found = self.store.published()
        except Exception as exc:  # noqa: BLE001 - an unreachable bucket: only the bound applies
            log.debug("local tier retention cannot read the bucket: %s", exc)
            return None
        own = [p.manifest.step for p in found if p.manifest.fence_round == self.store.round]
        return max(own, default=None)

    def join_retention(self) -> None:
        if self._retention is not None:
            self._retention.join()
            self._retention = None

    def download(self, published: Published) -> Path:
        """The bucket's checkpoint in this tier: the leader fetches it unless a valid copy of it is here (a node that
        kept its local copy reads it from its disk while the nodes without one download it)."""
        path = self.root / commit.step_dir_name(published.manifest.step)
        local, _ = commit.read_manifest(path)
        if (
            local is not None
            and local.metadata_sha256 == published.manifest.metadata_sha256
            and commit.validate(path).ok
        ):
            log.info("checkpoint step-%d: this tier holds it already (every digest checked), no download", local.step)
            return path
        log.info("checkpoint step-%d: downloading it into this tier", published.manifest.step)
        return self.store.download(published, self.root)

    def flush(self, timeout_s: float) -> bool:
        """Wait (at most ``timeout_s``) for this rank's uploads and the publication of the newest save: rank 0 for
        its publisher, the other ranks until its COMPLETE.json is in the bucket, so that every rank leaves about
        together (a collective follows). False when time ran out (what is not in the bucket then is not a
        checkpoint there)."""
        deadline = time.monotonic() + timeout_s
        for upload in self.uploader.pending():
            if not upload.done.wait(max(0.0, deadline - time.monotonic())):
                return False
        if self.publisher is not None:
            return self.publisher.wait_idle(max(0.0, deadline - time.monotonic()))
        if self._newest is None:
            return True
        key = self.store.location.key(f"step-{self._newest.step}/r{self._newest.fence_round}", MANIFEST_FILE)
        while time.monotonic() < deadline:
            try:
                self.store.client.head_object(Bucket=self.store.location.bucket, Key=key)
                return True
            except Exception as exc:  # noqa: BLE001 - not there yet, or the bucket is away: look again
                log.debug("waiting for %s: %s", key, exc)
            time.sleep(FLUSH_POLL_S)
        return False

    def close(self) -> None:
        self.uploader.close()
        if self.publisher is not None:
            self.publisher.close()
        self.join_retention()
