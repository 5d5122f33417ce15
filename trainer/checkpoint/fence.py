"""The checkpoint fence: which group of workers may still commit into a job's checkpoint directory.

Every new group (every rendezvous round that runs the training loop) claims the next *fence round* on the shared
checkpoint volume itself, before it chooses what to resume from: its rank 0 creates ``.fence/round-<N>.json``
with ``O_CREAT | O_EXCL`` (atomic on POSIX file systems, NFSv3 and later included), ``N`` one more than the
highest round present, and retries with ``N + 1`` when another claimer won. The highest round present is the
only group allowed to publish a checkpoint or delete anything.

Why the file system and not the job agent's store: the process that must be stopped is a stale rank 0 of an old
group (a partitioned node whose pod was force-deleted) that may not reach the store at all, but still reaches
the volume it is writing to. And the rendezvous round of torchrun's c10d state lives in that store, so it starts
again at 0 whenever the agent is replaced: it cannot order groups across an agent loss. The fence round can.

What it cannot do (the remaining window): POSIX has no "rename if this other file is unchanged", so the check
(:func:`check`) and the rename that publishes are two steps. A stale rank 0 that passed the check and is then
frozen can still complete its one rename after the new group claimed its round: the result is one more
complete, valid ``step-N`` (written consistently by the old group), never a deletion, because retention checks
the fence again and touches only temporary directories of its own round or older (:mod:`disttrain.trainer
.commit`). Closing the window completely would need a lease the storage enforces (object-store conditional
writes, or NFS delegations), which a plain shared volume does not offer. What narrows it further: the publish
re-reads the manifests just before its rename and never replaces a newer round's ``step-N`` (and undoes a swap
that displaced one), and resume and retention order checkpoints by ``(round, step)``, so a late stale commit never
shadows a newer round's checkpoint even at a higher step.

The rounds also survive the loss of ``.fence``: a claim starts above the highest round recorded in any
checkpoint's manifest (``floor``), so the order never goes backwards. ``.fence`` and its records are never
followed through a link.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import re
import stat
from pathlib import Path
from typing import Optional

FENCE_DIR = ".fence"
_ROUND_FILE = re.compile(r"^round-(\d+)\.json$")


class FencedError(RuntimeError):
    """A newer group claimed the checkpoint directory: this (stale) group must not publish or delete."""


@dataclasses.dataclass(frozen=True)
class FenceRecord:
    round: int
    job_uid: str
    node: str


def _fence_dir(root: Path, create: bool = False) -> Optional[Path]:
    """``root/.fence`` when it is a real directory, None when absent; a link or a file there is refused."""
    directory = root / FENCE_DIR
    if create:
        try:
            directory.mkdir(parents=False, exist_ok=False)
        except FileExistsError:
            pass
    try:
        mode = os.lstat(directory).st_mode
    except FileNotFoundError:
        return None
    if not stat.S_ISDIR(mode):
        raise FencedError(
            f"{directory} is {'a symbolic link' if stat.S_ISLNK(mode) else 'not a directory'}: the fence must be a "
            "real directory of the checkpoint volume (links are never followed); remove it"
        )
    return directory


def _rounds(root: Path) -> list[int]:
    directory = _fence_dir(root)
    if directory is None:
        return []
    return sorted(int(m.group(1)) for name in os.listdir(directory) if (m := _ROUND_FILE.match(name)))


def current_round(root: Path) -> int:
    """The highest claimed round (0 when none was ever claimed)."""
    rounds = _rounds(root)
    return rounds[-1] if rounds else 0


def read(root: Path, round_: int) -> Optional[FenceRecord]:
    path = root / FENCE_DIR / f"round-{round_}.json"
    try:
        with os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb") as f:
            data = json.loads(f.read(4096))
        return FenceRecord(round=int(data["round"]), job_uid=str(data["job_uid"]), node=str(data["node"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def claim(root: Path, job_uid: str, node: str, floor: int = 0) -> int:
    """Claim the next round for a new group (its rank 0 calls this once, before resuming); returns the round.
    ``floor``: the highest round any committed checkpoint records; the claim is above it even when ``.fence``
    was lost."""
    root.mkdir(parents=True, exist_ok=True)
    directory = _fence_dir(root, create=True)
    assert directory is not None
    candidate = max(current_round(root), floor) + 1
    while True:
        path = directory / f"round-{candidate}.json"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except FileExistsError:
            candidate = max(candidate + 1, current_round(root) + 1)
            continue
        try:
            os.write(fd, json.dumps({"round": candidate, "job_uid": job_uid, "node": node}).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        _fsync_dir(directory)
        return candidate


def check(root: Path, round_: int) -> None:
    """Raise :class:`FencedError` unless ``round_`` is still the highest claimed round."""
    newest = current_round(root)
    if newest != round_:
        holder = read(root, newest)
        by = f" (claimed by node {holder.node}, job uid {holder.job_uid or '?'})" if holder else ""
        raise FencedError(
            f"checkpoint directory {root} is fenced: this group holds round {round_}, a newer group holds round "
            f"{newest}{by}; a stale group must not publish or delete checkpoints"
        )


def retire_older(root: Path, round_: int) -> None:
    """Remove the records of rounds older than ``round_`` (the holder of the current round does this)."""
    for old in _rounds(root):
        if old < round_:
            try:
                (root / FENCE_DIR / f"round-{old}.json").unlink()
            except FileNotFoundError:
                pass


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as exc:  # some file systems refuse fsync on a directory; the O_EXCL create is what counts
        if exc.errno not in (errno.EINVAL, errno.EBADF):
            raise
    finally:
        os.close(fd)
