"""This rank's part of a save: DCP writes the rank's files (at once, or asynchronously with staging) and they are
fsynced and digested for the commit (:mod:`disttrain.trainer.checkpoint.committer`)."""

from __future__ import annotations

import dataclasses
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
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from disttrain.api.manifest import CheckpointManifest, FileDigest
from disttrain.trainer.checkpoint import commit, storage


@dataclasses.dataclass
class InFlightSave:
    """An async save whose files are being written here; ``done`` once they are digested (or it failed)."""

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


Written = tuple[dict[str, FileDigest], Optional[BaseException]]
"""This rank's digests of a save, or the error that failed its part."""


def files_of_rank(directory: Path, rank: int) -> list[str]:
    prefix = f"__{rank}_"
    names = [p.name for p in directory.iterdir() if p.name.startswith(prefix) and p.name.endswith(".distcp")]
    if rank == 0:
        names.append(commit.METADATA_FILE)
    return names


class ShardWriter:
    """Writes this rank's DCP files of each save; ``on_files_written(step)`` runs once they are written, before
    they are synced and digested (raising fails this rank's part)."""

    def __init__(
        self,
        rank: int,
        group: Optional[dist.ProcessGroup],
        writer_threads: int,
        on_files_written: Callable[[int], None],
    ) -> None:
        self.rank = rank
        self.group = group
        self.writer_threads = writer_threads
        self.on_files_written = on_files_written
        self._stager: Optional[DefaultStager] = None
        self.staging: Any = None
        """The staging copy of the async save in flight, until :meth:`wait_staging`."""
        self._plan_key = f"disttrain-{uuid.uuid4().hex}"  # DCP's plan cache is per process: one key each

    def write(
        self, step: int, tmp: Path, state: dict[str, Any]
    ) -> tuple[dict[str, FileDigest], Optional[BaseException]]:
        """A synchronous save's part: this rank's digests, or the error (reported collectively by the caller)."""
        try:
            writer = self._writer(tmp)
            dcp.save(state, storage_writer=writer, process_group=self.group, planner=self._planner())
            self.on_files_written(step)
            return commit.digest_files(tmp, files_of_rank(tmp, self.rank), known=writer.digests), None
        except (Exception, CheckpointException) as exc:  # noqa: BLE001
            # DCP raises CheckpointException (a BaseException) when a rank's write fails, e.g. on a full disk.
            return {}, exc

    def start(self, step: int, tmp: Path, state: dict[str, Any], manifest: CheckpointManifest) -> InFlightSave:
        """Start an async save: staging and writing go on in the background; the digests in a helper thread."""
        t0 = time.monotonic()
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
            future, self.staging = response.upload_completion, response.staging_completion
        else:
            future = response
        save = InFlightSave(
            step, tmp, manifest, future, started=t0, blocking_s=time.monotonic() - t0, known=writer.digests
        )
        threading.Thread(target=self._finish, args=(save,), daemon=True, name="disttrain-ckpt-finish").start()
        return save

    def wait_staging(self) -> None:
        if self.staging is None:
            return
        try:
            self.staging.result()
        finally:
            self.staging = None

    def close(self) -> None:
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    def _finish(self, save: InFlightSave) -> None:
        try:
            save.future.result()
            self.on_files_written(save.step)
            save.digests = commit.digest_files(save.tmp, files_of_rank(save.tmp, self.rank), known=save.known)
        except BaseException as exc:  # noqa: BLE001
            save.error = exc
        finally:
            save.done.set()

    def _writer(self, tmp: Path) -> storage.CheckpointWriter:
        # Two writer threads per rank: on the disks measured here one stream leaves ~25% of dd on the table.
        return storage.CheckpointWriter(str(tmp), thread_count=self.writer_threads)

    def _planner(self) -> DefaultSavePlanner:
        """DCP's planner with its plan cache on, under a key of this writer's own: from the second save on,
        an unchanged local plan is not sent, deduplicated and validated again (~8% of a 100 MB save here).
        DCP compares every new local plan with the cached one and replans when the state's layout changed."""
        planner = DefaultSavePlanner(enable_plan_caching=True)
        planner._cached_plans_key = self._plan_key
        return planner
