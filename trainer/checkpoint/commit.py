"""The on-disk commit protocol of a checkpoint, without torch: atomic writes, digests, validation, retention.

A checkpoint is the directory ``step-<N>`` holding DCP's files and ``COMPLETE.json``. It is written under a
fresh temporary name (``.tmp-step-<N>-<nonce>``); every rank fsyncs its own files; rank 0 then writes
``COMPLETE.json`` (tmp -> fsync -> rename -> directory fsync), renames the directory to ``step-<N>`` and fsyncs
the parent. A crash at any earlier moment leaves a directory resume never considers. Resume trusts a
``step-<N>`` only after the manifest parses and every listed file has its size and digest.

Digests: ``.metadata`` with sha256 (recorded as ``metadata_sha256`` too); shard files with crc32, which catches
torn and bit-flipped writes at ~4 GB/s, so validating does not double the cost of a save. Digests detect
accidents (torn writes, bit rot, a half-copied directory), not an adversary: whoever can write the volume can
rewrite a file and its digest alike (see "What the checkpoint volume is trusted with" in docs/trainer.md).

Temporary directories carry the fence round of the group that writes them
(:mod:`disttrain.trainer.checkpoint.fence`), so
retention can tell its own and older groups' leftovers from a newer group's save in flight.

Order: checkpoints are ordered by ``(fence_round, step)`` from their manifests (:meth:`CheckpointManifest.order`),
not by step alone, so a stale group's late commit can never shadow (nor, at the same step, replace) what a newer
group committed; resume picks the newest valid one in this order, retention keeps the newest ones in it.

Links: nothing in the checkpoint tree is followed. Step directories, ``COMPLETE.json``, ``.metadata`` and shard
files are opened with ``O_NOFOLLOW`` and checked with ``lstat``; a symbolic link anywhere is an invalid entry, and
deleting one removes the link itself, never what it points to. Only the checkpoint root (configured) may be a link.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import errno
import hashlib
import os
import re
import shutil
import stat
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Optional

import pydantic

from disttrain.api.manifest import MANIFEST_FILE, CheckpointManifest, FileDigest
from disttrain.trainer.checkpoint import fence

STEP_DIR = re.compile(r"^step-(0|[1-9][0-9]*)$")
"""A checkpoint's canonical name: ``step-04`` or ``step-4.bak`` only look like one (and are cleaned)."""
STEP_PREFIX = "step-"
TMP_PREFIX = ".tmp-step-"
TRASH_PREFIX = ".trash-"
MAX_MANIFEST_BYTES = 16 * 2**20
"""A COMPLETE.json larger than this is refused unread (a real one lists a few files per rank: kilobytes)."""
_ROUND_OF = re.compile(r"^(?:\.tmp-step-|\.trash-step-)\d+-r(\d+)-")
METADATA_FILE = ".metadata"
KNOWN_ALGORITHMS = frozenset({"crc32", "sha256"})
_CHUNK = 8 * 2**20


def step_dir_name(step: int) -> str:
    return f"step-{step}"


def tmp_dir_name(step: int, nonce: str, round_: int = 0) -> str:
    """``.tmp-step-<N>-r<round>-<nonce>``: the fence round tells whose leftover it is."""
    return f"{TMP_PREFIX}{step}-r{round_}-{nonce}"


def round_of(name: str) -> int:
    """Fence round of a temporary or trash directory name (0 for names written before rounds existed)."""
    m = _ROUND_OF.match(name)
    return int(m.group(1)) if m else 0


def fsync_path(path: Path, follow_symlinks: bool = False) -> None:
    """fsync a file or a directory (a rename is durable only once its directory is synced). Inside the tree a
    link is never followed (ELOOP); only the configured root is opened with ``follow_symlinks``."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | (0 if follow_symlinks else os.O_NOFOLLOW))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LinkError(OSError):
    """A path inside the checkpoint tree is a symbolic link (or not the regular file it must be)."""


def open_regular(path: Path) -> int:
    """Open a regular file for reading without following a link at its last component; the fd is the caller's.
    :class:`LinkError` names the path when it is a link or not a regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise LinkError(
                errno.ELOOP, "is a symbolic link (links in the checkpoint tree are never followed)", str(path)
            ) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise LinkError(errno.EINVAL, "is not a regular file", str(path))
    return fd


def read_regular(path: Path, limit: Optional[int] = None) -> bytes:
    """The bytes of a regular file (never through a link), refused when larger than ``limit``."""
    with os.fdopen(open_regular(path), "rb") as f:
        data = f.read() if limit is None else f.read(limit + 1)
    if limit is not None and len(data) > limit:
        raise LinkError(errno.EFBIG, f"is larger than {limit} bytes", str(path))
    return data


def is_link(path: Path) -> bool:
    try:
        return stat.S_ISLNK(os.lstat(path).st_mode)
    except OSError:
        return False


def file_digest(path: Path, algorithm: str) -> FileDigest:
    size = 0
    with os.fdopen(open_regular(path), "rb") as f:
        if algorithm == "crc32":
            crc = 0
            while chunk := f.read(_CHUNK):
                crc = zlib.crc32(chunk, crc)
                size += len(chunk)
            return FileDigest(size=size, digest=f"crc32:{crc:08x}")
        h = hashlib.new(algorithm)
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return FileDigest(size=size, digest=f"{algorithm}:{h.hexdigest()}")


def algorithm_for(name: str) -> str:
    return "sha256" if name == METADATA_FILE else "crc32"


def digest_files(
    directory: Path, names: Iterable[str], fsync: bool = True, known: Optional[dict[str, tuple[int, str]]] = None
) -> dict[str, FileDigest]:
    """Flush to disk and digest the named files of ``directory`` (each rank calls it for the files it wrote).

    Files are digested in parallel threads (zlib and hashlib release the GIL on large buffers) while they are
    still in the page cache, so this adds little to a save. ``known`` digests (computed while writing) are used
    when the file on disk still has the size they were computed for.
    """

    def one(name: str) -> tuple[str, FileDigest]:
        path = directory / name
        if fsync:
            fsync_path(path)
        if known and name in known and known[name][0] == os.lstat(path).st_size:
            return name, FileDigest(size=known[name][0], digest=known[name][1])
        return name, file_digest(path, algorithm_for(name))

    ordered = sorted(names)
    if len(ordered) <= 1:
        return dict(map(one, ordered))
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(4, len(ordered))) as pool:
        return dict(pool.map(one, ordered))


def write_manifest(directory: Path, manifest: CheckpointManifest) -> None:
    """Write ``COMPLETE.json`` atomically: tmp -> fsync -> rename -> directory fsync."""
    tmp = directory / (MANIFEST_FILE + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(manifest.model_dump_json(indent=1))
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, directory / MANIFEST_FILE)
    fsync_path(directory)


def publish(root: Path, tmp_dir: Path, step: int, own_round: Optional[int] = None) -> Path:
    """Rename a committed temp dir to ``step-N`` and fsync the parent.

    With ``own_round`` (the committing group's fence round), nothing is published over or past a checkpoint that
    a newer round committed: the manifests on the volume are read just before the rename, and an existing
    ``step-N`` of a newer round is never replaced (:class:`fence.FencedError`).

    When ``step-N`` exists already (a re-save of the same step, or one left invalid by a crash), the old
    directory stays in place until the new one is: both are swapped in one atomic ``renameat2(RENAME_EXCHANGE)``
    and only then is the old one removed. Should the swapped-out one turn out to be a newer round's (it was
    published between the check and the swap), the swap is undone. Where the file system cannot exchange, a
    valid old ``step-N`` is kept and the new copy dropped (both hold the same step), and only an invalid old one
    is moved aside first.
    """
    final = root / step_dir_name(step)
    if own_round is not None:
        newest = newest_committed(root)
        if newest is not None and newest[0] > own_round:
            raise fence.FencedError(
                f"checkpoint directory {root} holds {newest[1]} committed by fence round {newest[0]}; this group "
                f"holds round {own_round} and must not publish step-{step} over or past it"
            )
    try:
        os.rename(tmp_dir, final)  # replaces nothing but an empty directory (and never through a link)
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
            raise
        _replace_existing(root, tmp_dir, final, own_round)
    fsync_path(root, follow_symlinks=True)
    return final


def _newer_round(path: Path, own_round: Optional[int]) -> Optional[int]:
    """The fence round of the checkpoint at ``path`` when it is newer than ``own_round``, else None."""
    manifest, _ = read_manifest(path)
    if own_round is None or manifest is None or (manifest.fence_round or 0) <= own_round:
        return None
    return manifest.fence_round


def _replace_existing(root: Path, tmp_dir: Path, final: Path, own_round: Optional[int]) -> None:
    newer = _newer_round(final, own_round)
    if newer is not None:
        raise fence.FencedError(
            f"{final} was committed by fence round {newer}; this group holds round {own_round} and must not replace it"
        )
    try:
        exchange(tmp_dir, final)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV):
            raise
        if validate(final).ok:
            remove_entry(tmp_dir)
            return
        aside = root / f"{TRASH_PREFIX}{tmp_dir.name[len('.tmp-') :]}"
        os.rename(final, aside)
        os.rename(tmp_dir, final)
        remove_entry(aside)
        return
    put_back_if_newer(tmp_dir, final, own_round)
    remove_entry(tmp_dir)


def put_back_if_newer(displaced: Path, final: Path, own_round: Optional[int]) -> None:
    """After a swap, ``displaced`` holds what was ``step-N``: when a newer round had published it (after the check
    before the swap), swap back and raise :class:`fence.FencedError`; the newer checkpoint was out of place for
    the duration of one ``read_manifest``."""
    newer = _newer_round(displaced, own_round)
    if newer is not None:
        exchange(displaced, final)
        raise fence.FencedError(
            f"{final} was committed by fence round {newer} while this group (round {own_round}) published the same "
            "step; the newer one was put back"
        )


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def exchange(a: Path, b: Path) -> None:
    """Swap two paths atomically (Linux ``renameat2(RENAME_EXCHANGE)``); OSError(ENOSYS) where unavailable."""
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available", str(a))
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), str(a), None, str(b))


@dataclasses.dataclass(frozen=True)
class Validation:
    step: int
    path: Path
    manifest: Optional[CheckpointManifest]
    problem: str = ""

    @property
    def ok(self) -> bool:
        return self.manifest is not None and not self.problem


def read_manifest(path: Path) -> tuple[Optional[CheckpointManifest], str]:
    """(manifest, "") of the step directory ``path``, or (None, why not): the directory and its ``COMPLETE.json``
    must be a real directory and a regular file, never links. Cheap (no digests): what ordering needs."""
    try:
        mode = os.lstat(path).st_mode
    except OSError as exc:
        return None, f"cannot be read ({exc.strerror})"
    if stat.S_ISLNK(mode):
        return None, "is a symbolic link (links in the checkpoint tree are never followed)"
    if not stat.S_ISDIR(mode):
        return None, "is not a directory"
    try:
        data = read_regular(path / MANIFEST_FILE, MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        return None, f"{MANIFEST_FILE} is missing (the save never committed)"
    except OSError as exc:
        return None, f"{MANIFEST_FILE} {exc.strerror}"
    try:
        return CheckpointManifest.model_validate_json(data), ""
    except (pydantic.ValidationError, ValueError) as exc:
        return None, f"{MANIFEST_FILE} does not parse: {str(exc).splitlines()[0]}"


def validate(path: Path, verify_digests: bool = True) -> Validation:
    """Check that ``path`` is a complete checkpoint: manifest parses, names its step, every file matches. Every
    file is opened without following links and must be a regular file."""
    m = STEP_DIR.match(path.name)
    step = int(m.group(1)) if m else -1
    manifest, problem = read_manifest(path)
    if manifest is None:
        return Validation(step, path, None, problem)
    if manifest.step != step:
        return Validation(step, path, manifest, f"{MANIFEST_FILE} says step {manifest.step}, directory says {step}")
    if METADATA_FILE not in manifest.files:
        return Validation(step, path, manifest, f"{MANIFEST_FILE} does not list {METADATA_FILE}")
    for name, expected in sorted(manifest.files.items()):
        file = path / name
        try:
            mode, size = (st := os.lstat(file)).st_mode, st.st_size
        except FileNotFoundError:
            return Validation(step, path, manifest, f"file {name} is missing")
        if stat.S_ISLNK(mode):
            return Validation(
                step,
                path,
                manifest,
                f"file {name} is a symbolic link (links in the checkpoint tree are never followed)",
            )
        if not stat.S_ISREG(mode):
            return Validation(step, path, manifest, f"file {name} is not a regular file")
        if size != expected.size:
            return Validation(
                step, path, manifest, f"file {name} has {size} bytes, {MANIFEST_FILE} says {expected.size}"
            )
        algorithm = expected.digest.split(":", 1)[0]
        if algorithm not in KNOWN_ALGORITHMS:
            return Validation(step, path, manifest, f"file {name} has an unknown digest algorithm {algorithm!r}")
        if verify_digests:
            try:
                actual = file_digest(file, algorithm).digest
            except OSError as exc:
                return Validation(step, path, manifest, f"file {name} {exc.strerror}")
            if actual != expected.digest:
                return Validation(
                    step, path, manifest, f"file {name} is corrupt: digest {actual}, expected {expected.digest}"
                )
    if manifest.files[METADATA_FILE].digest != f"sha256:{manifest.metadata_sha256}":
        return Validation(step, path, manifest, f"{METADATA_FILE} hash disagrees with metadata_sha256")
    return Validation(step, path, manifest)


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """Entries with a checkpoint's canonical name ``step-N`` (links included: they fail validation), highest
    step first."""
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        m = STEP_DIR.match(entry.name)
        if m:
            found.append((int(m.group(1)), entry))
    return sorted(found, reverse=True)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A ``step-N`` entry with its manifest read (not its files): enough to order it."""

    step: int
    path: Path
    manifest: Optional[CheckpointManifest]
    problem: str

    @property
    def order(self) -> tuple[int, int]:
        return self.manifest.order if self.manifest is not None else (-1, self.step)


def candidates(root: Path) -> list[Candidate]:
    """Every ``step-N`` entry, newest first in ``(fence_round, step)`` order; unreadable manifests last."""
    found = [Candidate(step, path, *read_manifest(path)) for step, path in step_dirs(root)]
    return sorted(found, key=lambda c: c.order, reverse=True)


def newest_committed(root: Path) -> Optional[tuple[int, str]]:
    """(fence round, name) of the checkpoint with the highest fence round whose manifest parses, or None.
    Manifests only, no digests: a check before each publish and the floor of the next claim."""
    best: Optional[tuple[int, str]] = None
    for c in candidates(root):
        if c.manifest is not None and (best is None or (c.manifest.fence_round or 0) > best[0]):
            best = (c.manifest.fence_round or 0, c.path.name)
    return best


def find_latest(root: Path, log: Optional[Callable[[str], object]] = None) -> Optional[Validation]:
    """Newest valid checkpoint in ``(fence_round, step)`` order; each rejected one ahead of it, and each entry
    without a readable manifest at a higher step, is reported through ``log`` with its reason."""
    found: Optional[Validation] = None
    ranked = candidates(root)
    rejected: list[Validation] = []
    for c in ranked:
        v = validate(c.path) if c.manifest is not None else Validation(c.step, c.path, None, c.problem)
        if v.ok:
            found = v
            break
        rejected.append(v)
    if found is not None:  # entries without a manifest rank last: name those that look newer anyway
        seen = {v.path.name for v in rejected}
        rejected += [
            Validation(c.step, c.path, None, c.problem)
            for c in ranked
            if c.manifest is None and c.step > found.step and c.path.name not in seen
        ]
    if log is not None:
        for v in sorted(rejected, key=lambda r: r.step, reverse=True):
            log(f"checkpoint {v.path.name} is not usable ({v.problem}); falling back to an older checkpoint")
    return found


def choose_deletions(valid: Iterable[tuple[int, int]], keep: int, protected: Iterable[int] = ()) -> list[int]:
    """Steps to delete so that ``keep`` valid checkpoints remain, newest first in ``(fence_round, step)`` order.
    Never the newest valid one, never a protected step (the one the run loaded or just committed), whatever
    ``keep`` says. Only valid checkpoints may be passed, as (fence round, step)."""
    ordered = sorted(set(valid), reverse=True)
    keep_set = {step for _, step in ordered[: max(1, keep)]} | set(protected)
    return sorted(step for _, step in ordered if step not in keep_set)


def plan_step_deletions(
    root: Path,
    keep: int,
    is_valid: Callable[[Path], bool],
    protected: Iterable[int] = (),
    own_round: Optional[int] = None,
    log: Optional[Callable[[str], object]] = None,
) -> list[str]:
    """Entries to delete: valid checkpoints beyond the newest ``keep`` valid ones ("complete" is not enough:
    after a fallback from a corrupt step-100, the corrupt one must not count towards ``keep``), invalid ``step-N``
    entries (torn, corrupt, manifest missing or unparsable, links) and names that only look like a checkpoint
    (``step-04``, ``step-4.bak``). Never a protected step and never a checkpoint of a round newer than
    ``own_round``."""
    protected = set(protected)
    valid: list[tuple[int, int]] = []
    doomed: list[str] = []
    for c in candidates(root):
        if c.manifest is not None and own_round is not None and (c.manifest.fence_round or 0) > own_round:
            continue
        if c.step in protected or (c.manifest is not None and is_valid(c.path)):
            valid.append(c.order if c.manifest is not None else (-1, c.step))
        else:
            doomed.append(c.path.name)
            if log is not None and c.problem:  # a failed full validation is reported by ``is_valid`` itself
                log(f"retention removes invalid checkpoint {c.path.name} ({c.problem})")
    lookalikes = [
        e.name
        for e in (root.iterdir() if root.is_dir() else [])
        if e.name.startswith(STEP_PREFIX) and not STEP_DIR.match(e.name)
    ]
    if log is not None:
        for name in lookalikes:
            log(f"retention removes {name}: not a checkpoint's name (step-<N>, N without leading zeros)")
    return sorted(doomed + lookalikes) + [step_dir_name(s) for s in choose_deletions(valid, keep, protected)]


def plan_temp_cleanup(root: Path, own_round: int, in_flight: Iterable[str] = ()) -> list[str]:
    """Temporary and trash directories of failed or crashed saves of round ``own_round`` or older, never one
    named in ``in_flight`` and never a newer round's (a stale group must not delete the new group's save).

    Why the round and not the age decides: only the holder of the newest round runs retention (the fence is
    checked before and after planning), so a temp dir of an older round belongs to a fenced group whose commit
    would be refused anyway, and the holder's own live save is ``in_flight``; a newer round's save, however
    young or old, is never touched. Decided from one listing, so deleting the result later (in a thread) cannot
    touch a directory created after the decision, such as the next save's temp dir."""
    keep_names = set(in_flight)
    names = []
    for entry in sorted(root.iterdir()) if root.is_dir() else []:
        leftover = entry.name.startswith((TMP_PREFIX, TRASH_PREFIX)) and entry.name not in keep_names
        if leftover and round_of(entry.name) <= own_round:
            names.append(entry.name)
    return names


def is_disk_full(exc: BaseException) -> bool:
    """Whether ENOSPC (or EDQUOT) is behind ``exc``: its causes and DCP's per-rank ``failures`` are followed."""
    seen: set[int] = set()
    todo: list[object] = [exc]
    while todo:
        e = todo.pop()
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) and f else f for f in failures.values()]
    return False


def remove_entry(path: Path) -> bool:
    """Remove one entry of the checkpoint tree without following links: a link (or any non-directory) is
    unlinked itself, a directory removed with :func:`shutil.rmtree`, which does not follow links inside it and
    refuses a directory swapped for a link under it. False when it was gone already or could not be removed."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return False
    try:
        if stat.S_ISDIR(mode):
            shutil.rmtree(path)
        else:
            os.unlink(path)
    except OSError:
        return False
    return True


def delete(root: Path, names: Iterable[str]) -> list[str]:
    """Remove the named entries under ``root`` (a planned retention), links as links; returns the names."""
    deleted = []
    for name in names:
        remove_entry(root / name)
        deleted.append(name)
    return deleted
