"""The on-disk commit protocol of a checkpoint, without torch: atomic writes, digests, validation, retention.

A checkpoint is the directory ``step-<N>`` holding DCP's files and ``COMPLETE.json``. It is written under a
fresh temporary name (``.tmp-step-<N>-<nonce>``); every rank fsyncs its own files; rank 0 then writes
``COMPLETE.json`` (tmp -> fsync -> rename -> directory fsync), renames the directory to ``step-<N>`` and fsyncs
the parent. A crash at any earlier moment leaves a directory resume never considers. Resume trusts a
``step-<N>`` only after the manifest parses and every listed file has its size and digest.

Digests: ``.metadata`` with sha256 (recorded as ``metadata_sha256`` too); shard files with crc32, which catches
torn and bit-flipped writes at ~4 GB/s, so validating does not double the cost of a save.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
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
METADATA_FILE = ".metadata"
_CHUNK = 8 * 2**20


def step_dir_name(step: int) -> str:
    return f"step-{step}"


def tmp_dir_name(step: int, nonce: str) -> str:
    return f"{TMP_PREFIX}{step}-{nonce}"


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
    """Rename a committed temp dir to ``step-N`` and fsync the parent. An existing ``step-N`` (left invalid by a
    crash and skipped at resume) is moved aside first, since rename cannot replace a non-empty directory."""
    final = root / step_dir_name(step)
    if final.exists():
        aside = root / f".trash-{final.name}-{os.getpid()}"
        os.rename(final, aside)
        shutil.rmtree(aside, ignore_errors=True)
    os.rename(tmp_dir, final)
    fsync_path(root)
    return final


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
        if verify_digests:
            algorithm = expected.digest.split(":", 1)[0]
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


def choose_deletions(complete_steps: list[int], keep: int, protected: Iterable[int] = ()) -> list[int]:
    """Steps to delete so that ``keep`` complete checkpoints remain. Never the newest complete one, never a
    protected step (the one just loaded or a save in flight), whatever ``keep`` says."""
    ordered = sorted(set(complete_steps), reverse=True)
    keep_set = set(ordered[: max(1, keep)]) | set(protected)
    return sorted(s for s in ordered if s not in keep_set)


def plan_retention(root: Path, keep: int, in_flight: Iterable[str] = ()) -> list[str]:
    """Names to delete: complete checkpoints beyond ``keep`` (never the newest) and temp dirs of crashed saves
    (never one named in ``in_flight``). Decided from one listing, so deleting the result later (in a thread)
    cannot touch a directory created after the decision, such as the next save's temp dir."""
    dirs = step_dirs(root)
    complete = [s for s, p in dirs if (p / MANIFEST_FILE).is_file()]
    names = [step_dir_name(step) for step in choose_deletions(complete, keep)]
    keep_names = set(in_flight)
    for entry in sorted(root.iterdir()) if root.is_dir() else []:
        if entry.name.startswith((TMP_PREFIX, ".trash-")) and entry.name not in keep_names:
            names.append(entry.name)
    return names


def delete(root: Path, names: Iterable[str]) -> list[str]:
    """Remove the named directories under ``root`` (a planned retention); returns the names."""
    deleted = []
    for name in names:
        shutil.rmtree(root / name, ignore_errors=True)
        deleted.append(name)
    return deleted
