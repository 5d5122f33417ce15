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

Temporary directories carry the fence round of the group that writes them (:mod:`disttrain.trainer.fence`), so
retention can tell its own and older groups' leftovers from a newer group's save in flight.
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
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Optional

import pydantic

from disttrain.api.manifest import MANIFEST_FILE, CheckpointManifest, FileDigest

STEP_DIR = re.compile(r"^step-(\d+)$")
TMP_PREFIX = ".tmp-step-"
TRASH_PREFIX = ".trash-"
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


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a rename is durable only once its directory is synced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_digest(path: Path, algorithm: str) -> FileDigest:
    size = 0
    if algorithm == "crc32":
        crc = 0
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                crc = zlib.crc32(chunk, crc)
                size += len(chunk)
        return FileDigest(size=size, digest=f"crc32:{crc:08x}")
    h = hashlib.new(algorithm)
    with open(path, "rb") as f:
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
        if known and name in known and known[name][0] == path.stat().st_size:
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
    with open(tmp, "w") as f:
        f.write(manifest.model_dump_json(indent=1))
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, directory / MANIFEST_FILE)
    fsync_path(directory)


def publish(root: Path, tmp_dir: Path, step: int) -> Path:
    """Rename a committed temp dir to ``step-N`` and fsync the parent.

    When ``step-N`` exists already (a re-save of the same step, or one left invalid by a crash), the old
    directory stays in place until the new one is: both are swapped in one atomic ``renameat2(RENAME_EXCHANGE)``
    and only then is the old one removed. Where the file system cannot exchange, a valid old ``step-N`` is kept
    and the new copy dropped (both hold the same step), and only an invalid old one is moved aside first.
    """
    final = root / step_dir_name(step)
    try:
        os.rename(tmp_dir, final)  # replaces nothing but an empty directory
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        _replace_existing(root, tmp_dir, final)
    fsync_path(root)
    return final


def _replace_existing(root: Path, tmp_dir: Path, final: Path) -> None:
    try:
        exchange(tmp_dir, final)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV):
            raise
        if validate(final).ok:
            shutil.rmtree(tmp_dir, ignore_errors=True)
            return
        aside = root / f"{TRASH_PREFIX}{tmp_dir.name[len('.tmp-') :]}"
        os.rename(final, aside)
        os.rename(tmp_dir, final)
        shutil.rmtree(aside, ignore_errors=True)
        return
    shutil.rmtree(tmp_dir, ignore_errors=True)  # the old step-N, now under the temporary name


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


def validate(path: Path, verify_digests: bool = True) -> Validation:
    """Check that ``path`` is a complete checkpoint: manifest parses, names its step, every file matches."""
    m = STEP_DIR.match(path.name)
    step = int(m.group(1)) if m else -1
    manifest_path = path / MANIFEST_FILE
    if not manifest_path.is_file():
        return Validation(step, path, None, f"{MANIFEST_FILE} is missing (the save never committed)")
    try:
        manifest = CheckpointManifest.model_validate_json(manifest_path.read_bytes())
    except (pydantic.ValidationError, ValueError) as exc:
        return Validation(step, path, None, f"{MANIFEST_FILE} does not parse: {str(exc).splitlines()[0]}")
    if manifest.step != step:
        return Validation(step, path, manifest, f"{MANIFEST_FILE} says step {manifest.step}, directory says {step}")
    if METADATA_FILE not in manifest.files:
        return Validation(step, path, manifest, f"{MANIFEST_FILE} does not list {METADATA_FILE}")
    for name, expected in sorted(manifest.files.items()):
        file = path / name
        if not file.is_file():
            return Validation(step, path, manifest, f"file {name} is missing")
        size = file.stat().st_size
        if size != expected.size:
            return Validation(
                step, path, manifest, f"file {name} has {size} bytes, {MANIFEST_FILE} says {expected.size}"
            )
        algorithm = expected.digest.split(":", 1)[0]
        if algorithm not in KNOWN_ALGORITHMS:
            return Validation(step, path, manifest, f"file {name} has an unknown digest algorithm {algorithm!r}")
        if verify_digests:
            actual = file_digest(file, algorithm).digest
            if actual != expected.digest:
                return Validation(
                    step, path, manifest, f"file {name} is corrupt: digest {actual}, expected {expected.digest}"
                )
    if manifest.files[METADATA_FILE].digest != f"sha256:{manifest.metadata_sha256}":
        return Validation(step, path, manifest, f"{METADATA_FILE} hash disagrees with metadata_sha256")
    return Validation(step, path, manifest)


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """``step-N`` directories under root, newest first."""
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        m = STEP_DIR.match(entry.name)
        if m and entry.is_dir():
            found.append((int(m.group(1)), entry))
    return sorted(found, reverse=True)


def find_latest(root: Path, log: Optional[Callable[[str], object]] = None) -> Optional[Validation]:
    """Newest valid checkpoint; each rejected newer one is reported through ``log`` with its reason."""
    for _, path in step_dirs(root):
        v = validate(path)
        if v.ok:
            return v
        if log is not None:
            log(f"checkpoint {path.name} is not usable ({v.problem}); falling back to an older checkpoint")
    return None


def choose_deletions(valid_steps: list[int], keep: int, protected: Iterable[int] = ()) -> list[int]:
    """Steps to delete so that ``keep`` valid checkpoints remain. Never the newest valid one, never a protected
    step (the one the run loaded), whatever ``keep`` says. Only valid steps may be passed: a step that did not
    validate neither counts towards ``keep`` nor is deleted here."""
    ordered = sorted(set(valid_steps), reverse=True)
    keep_set = set(ordered[: max(1, keep)]) | set(protected)
    return sorted(s for s in ordered if s not in keep_set)


def plan_step_deletions(
    root: Path, keep: int, is_valid: Callable[[Path], bool], protected: Iterable[int] = ()
) -> list[str]:
    """``step-N`` names to delete: valid checkpoints beyond the newest ``keep`` valid ones. "Complete" is not
    enough: after a fallback from a corrupt step-100, the corrupt one must not count towards ``keep``."""
    protected = set(protected)
    valid = [step for step, path in step_dirs(root) if step in protected or is_valid(path)]
    return [step_dir_name(step) for step in choose_deletions(valid, keep, protected)]


def plan_temp_cleanup(root: Path, own_round: int, in_flight: Iterable[str] = ()) -> list[str]:
    """Temporary and trash directories of failed or crashed saves of round ``own_round`` or older, never one
    named in ``in_flight`` and never a newer round's (a stale group must not delete the new group's save).
    Decided from one listing, so deleting the result later (in a thread) cannot touch a directory created after
    the decision, such as the next save's temp dir."""
    keep_names = set(in_flight)
    names = []
    for entry in sorted(root.iterdir()) if root.is_dir() else []:
        leftover = entry.name.startswith((TMP_PREFIX, TRASH_PREFIX)) and entry.name not in keep_names
        if leftover and round_of(entry.name) <= own_round:
            names.append(entry.name)
    return names


def plan_retention(
    root: Path,
    keep: int,
    own_round: int = 0,
    in_flight: Iterable[str] = (),
    protected: Iterable[int] = (),
    is_valid: Optional[Callable[[Path], bool]] = None,
) -> list[str]:
    """Both plans at once (full validation of every checkpoint unless ``is_valid`` says otherwise)."""
    check = is_valid if is_valid is not None else (lambda path: validate(path).ok)
    return plan_step_deletions(root, keep, check, protected) + plan_temp_cleanup(root, own_round, in_flight)


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


def delete(root: Path, names: Iterable[str]) -> list[str]:
    """Remove the named directories under ``root`` (a planned retention); returns the names."""
    deleted = []
    for name in names:
        shutil.rmtree(root / name, ignore_errors=True)
        deleted.append(name)
    return deleted
