"""The checkpoint commit protocol on an S3 bucket: nothing renamed, the manifest written last, fencing by round.

Layout under ``s3://bucket/prefix/``::

    fence/round-<R>.json                  a group's claim of fence round R (with -<claim id> without conditional writes)
    step-<N>/r<R>/<file>                  DCP's files of step N as saved by the group of round R
    step-<N>/r<R>/COMPLETE.json           the manifest, written last: it lists every object with size, digest, ETag

A save is uploaded from a committed local directory (the local tier, :mod:`disttrain.trainer.checkpoint.commit`):
every object is uploaded (multipart above ``part_size``, ``max_concurrency`` parts at a time; the SDK sends a
checksum with every request, which the server checks), then read back with HEAD (size, ETag), and only then is
``COMPLETE.json`` put. Each round writes under its own prefix, so no object is ever overwritten or renamed: a
stale group that publishes late adds a checkpoint of its older round, which the ``(round, step)`` order never
puts ahead of a newer round's.

A reader trusts a manifest only when every object it lists exists with its size and ETag (HEAD, no download);
downloading verifies every byte against the manifest's crc32/sha256 before the local reader unpickles anything.

Fence: a group claims round R by creating ``fence/round-<R>.json`` with ``If-None-Match: *`` where the store
honours it (probed once: a second conditional create of the same key must fail). Where it does not, the claim is
``fence/round-<R>-<claim id>.json`` followed by a listing of round R's claims: a claimer that sees any other
claim for R moves on to R + 1. With strongly consistent listings (S3, RGW) two claimers of R cannot both see
only their own claim, since the later of the two writes is listed after the earlier one. A group may publish
or delete only while no higher round is claimed (checked before the manifest and before each deletion).
Retention deletes a checkpoint only after a newer COMPLETE one read back, the manifest first (so a reader never
trusts a half-deleted checkpoint), and removes incomplete prefixes only of its own round or older.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import posixpath
import re
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Optional

import pydantic

from disttrain.api import storageuri
from disttrain.api.manifest import MANIFEST_FILE, CheckpointManifest, FileDigest
from disttrain.trainer.checkpoint import commit
from disttrain.trainer.checkpoint.fence import FencedError

log = logging.getLogger("disttrain.trainer")

FENCE = "fence"
_URI = re.compile(r"^s3://(?P<bucket>[a-z0-9][a-z0-9.-]{1,61}[a-z0-9])(?:/(?P<prefix>.*))?$")
_ROUND_KEY = re.compile(r"^round-(?P<round>[1-9][0-9]*)(?:-(?P<claim>[0-9a-f]{32}))?\.json$")
_STEP_KEY = re.compile(r"^step-(?P<step>0|[1-9][0-9]*)/r(?P<round>0|[1-9][0-9]*)/(?P<name>[^/]+)$")


@dataclasses.dataclass(frozen=True)
class Location:
    """``s3://bucket/prefix``: the bucket and the key prefix (no leading or trailing ``/``) of a job's checkpoints."""

    bucket: str
    prefix: str

    def key(self, *parts: str) -> str:
        return posixpath.join(self.prefix, *parts) if self.prefix else posixpath.join(*parts)

    def relative(self, key: str) -> str:
        return key[len(self.prefix) + 1 :] if self.prefix else key


def parse_uri(uri: str) -> Location:
    """``s3://bucket[/prefix]`` (:mod:`disttrain.api.storageuri`); ValueError naming what is wrong otherwise."""
    problem = storageuri.uri_problem(uri)
    m = _URI.match(uri)
    if problem or m is None:
        raise ValueError(problem or f"{uri!r} is not an s3://BUCKET/PREFIX URI")
    return Location(m.group("bucket"), (m.group("prefix") or "").strip("/"))


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransferOptions:
    """How objects move: part size and parallel parts of a multipart upload or download."""

    part_size: int = 64 * 2**20
    max_concurrency: int = 8


def make_client(
    endpoint_url: Optional[str] = None,
    region: Optional[str] = None,
    addressing_style: str = "auto",
    timeouts: tuple[float, float] = (60.0, 60.0),
) -> Any:
    """A boto3 S3 client. Credentials come from boto3's own chain: the environment (``AWS_ACCESS_KEY_ID``...),
    a web identity token (IRSA-style workload identity), the instance's role, never from an argument here.
    ``endpoint_url``, ``region`` and ``addressing_style`` ("auto", "path", "virtual") are for S3-compatible
    stores; ``timeouts``: (connect, read) seconds of one request (botocore's defaults)."""
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=endpoint_url or None,
        region_name=region or None,
        config=Config(
            s3={"addressing_style": addressing_style},
            retries={"mode": "standard"},
            connect_timeout=timeouts[0],
            read_timeout=timeouts[1],
        ),
    )


@dataclasses.dataclass(frozen=True)
class Published:
    """A checkpoint in the bucket: its manifest and where it is."""

    manifest: CheckpointManifest
    key_prefix: str
    """``step-<N>/r<R>`` relative to the location's prefix."""


def _is_precondition_failed(exc: Exception) -> bool:
    response = getattr(exc, "response", None) or {}
    code = str(response.get("Error", {}).get("Code", ""))
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return code in ("PreconditionFailed", "412") or status == 412


def _is_missing(exc: Exception) -> bool:
    response = getattr(exc, "response", None) or {}
    code = str(response.get("Error", {}).get("Code", ""))
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return code in ("404", "NoSuchKey", "NotFound") or status == 404


class ObjectStoreCommitter:
    """One group's view of a job's checkpoints in a bucket (used by global rank 0)."""

    def __init__(
        self,
        client: Any,
        location: Location,
        *,
        transfer: Optional[TransferOptions] = None,
        job_uid: str = "",
        node: str = "",
        conditional_writes: Optional[bool] = None,
    ) -> None:
        self.client = client
        self.location = location
        self.transfer = transfer or TransferOptions()
        self.job_uid = job_uid
        self.node = node
        self._conditional = conditional_writes
        self.round: Optional[int] = None

    # ---- fence --------------------------------------------------------------------------------------------
    @property
    def conditional_writes(self) -> bool:
        """Whether the store refuses a second ``PUT If-None-Match: *`` of a key (probed once)."""
        if self._conditional is None:
            probe = self.location.key(FENCE, f".probe-{uuid.uuid4().hex}")
            self._put(probe, b"probe", if_none_match=True)
            try:
                self._put(probe, b"probe", if_none_match=True)
                self._conditional = False
            except Exception as exc:
                if not _is_precondition_failed(exc):
                    raise
                self._conditional = True
            finally:
                self.client.delete_object(Bucket=self.location.bucket, Key=probe)
            log.info("checkpoint bucket: conditional writes %s", "honoured" if self._conditional else "ignored")
        return self._conditional

    def claims(self) -> dict[int, list[str]]:
        """Round -> claim ids (``""`` for a conditional claim) present under ``fence/``."""
        out: dict[int, list[str]] = {}
        for key in self._list(self.location.key(FENCE) + "/"):
            m = _ROUND_KEY.match(posixpath.basename(key))
            if m:
                out.setdefault(int(m.group("round")), []).append(m.group("claim") or "")
        return out

    def current_round(self) -> int:
        return max(self.claims(), default=0)

    def claim_round(self) -> int:
        """Claim the next fence round (once): above every claim and every round a manifest records."""
        if self.round is not None:
            return self.round
        floor = max((p.manifest.fence_round or 0 for p in self.published()), default=0)
        candidate = max(self.current_round(), floor) + 1
        record = {"job_uid": self.job_uid, "node": self.node}
        while True:
            if self.conditional_writes:
                key = self.location.key(FENCE, f"round-{candidate}.json")
                try:
                    self._put(key, json.dumps({"round": candidate, **record}).encode(), if_none_match=True)
                except Exception as exc:
                    if not _is_precondition_failed(exc):
                        raise
                    candidate = max(candidate, self.current_round()) + 1
                    continue
            else:
                claim = uuid.uuid4().hex
                key = self.location.key(FENCE, f"round-{candidate}-{claim}.json")
                self._put(key, json.dumps({"round": candidate, "claim": claim, **record}).encode())
                if self.claims().get(candidate, []) != [claim]:
                    candidate = max(candidate, self.current_round()) + 1
                    continue
            self.round = candidate
            log.info("checkpoint fence: this group holds round %d of s3://%s", candidate, self.location.bucket)
            return candidate

    def check(self) -> None:
        """Raise :class:`FencedError` unless this group's round is still the highest claimed."""
        own = self.claim_round()
        newest = self.current_round()
        if newest != own:
            raise FencedError(
                f"checkpoint bucket s3://{self.location.bucket}/{self.location.prefix} is fenced: this group holds "
                f"round {own}, a newer group holds round {newest}; a stale group must not publish or delete"
            )

    def retire_older(self) -> None:
        """Remove the claims of older rounds (the holder of the newest round does this)."""
        own = self.claim_round()
        old = [
            self.location.key(FENCE, f"round-{r}-{c}.json" if c else f"round-{r}.json")
            for r, ids in self.claims().items()
            if r < own
            for c in ids
        ]
        self._delete(old)

    # ---- publish ------------------------------------------------------------------------------------------
    def step_prefix(self, step: int) -> str:
        return f"step-{step}/r{self.claim_round()}"

    def _transfers(self) -> Any:
        """s3transfer's manager: every file of a checkpoint at once, ``max_concurrency`` requests (whole small
        files or parts of large ones) in flight in all."""
        from boto3.s3.transfer import TransferConfig, create_transfer_manager

        config = TransferConfig(
            multipart_threshold=self.transfer.part_size,
            multipart_chunksize=self.transfer.part_size,
            max_concurrency=self.transfer.max_concurrency,
        )
        return create_transfer_manager(self.client, config)

    def upload_files(
        self, local_dir: Path, step: int, files: dict[str, FileDigest], round_: int
    ) -> dict[str, FileDigest]:
        """Upload files of step ``step`` under round ``round_``'s prefix and read each back (size and ETag); returns
        their digests with the ETags. Any rank uploads the files it wrote (``round_`` agreed by the group);
        global rank 0 merges every rank's result into the manifest it publishes."""
        prefix = f"step-{step}/r{round_}"
        names = sorted(files)
        with self._transfers() as transfers:
            pending = [
                transfers.upload(str(local_dir / name), self.location.bucket, self.location.key(prefix, name))
                for name in names
            ]
            for future in pending:
                future.result()
        heads = self._heads([self.location.key(prefix, name) for name in names])
        out: dict[str, FileDigest] = {}
        for name, head in zip(names, heads, strict=True):
            digest = files[name]
            key = self.location.key(prefix, name)
            if head is None:
                raise OSError(f"s3://{self.location.bucket}/{key}: missing right after its upload")
            if head["ContentLength"] != digest.size:
                raise OSError(
                    f"s3://{self.location.bucket}/{key}: {head['ContentLength']} bytes, expected {digest.size}"
                )
            out[name] = digest.model_copy(update={"etag": head["ETag"].strip('"')})
        return out

    def upload(self, local_dir: Path, manifest: CheckpointManifest) -> CheckpointManifest:
        """Upload every file of a checkpoint committed in ``local_dir`` under this group's round; returns the
        manifest with the ETags, ready to publish. Nothing is published."""
        own = self.claim_round()
        files = self.upload_files(local_dir, manifest.step, manifest.files, own)
        return manifest.model_copy(update={"files": files, "fence_round": own})

    def publish(self, manifest: CheckpointManifest, on_before_manifest: Optional[Callable[[], None]] = None) -> str:
        """Write COMPLETE.json of an uploaded save (its ETags recorded) once the fence still holds; returns its key.
        Every object it lists must exist already: the manifest is the commit."""
        if any(d.etag is None for d in manifest.files.values()):
            raise ValueError("the manifest of an object-store checkpoint records every object's ETag (upload first)")
        self.check()
        if on_before_manifest is not None:
            on_before_manifest()
        key = self.location.key(self.step_prefix(manifest.step), MANIFEST_FILE)
        self._put(key, manifest.model_dump_json().encode(), if_none_match=self.conditional_writes)
        return key

    # ---- read ---------------------------------------------------------------------------------------------
    def published(self) -> list[Published]:
        """Every parseable COMPLETE.json, newest first in ``(fence round, step)`` order (objects not checked)."""
        found = []
        for key in self._list(self.location.key("step-") if self.location.prefix else "step-"):
            m = _STEP_KEY.match(self.location.relative(key))
            if not m or m.group("name") != MANIFEST_FILE:
                continue
            manifest, problem = self._read_manifest(key)
            if manifest is None:
                log.warning("s3://%s/%s: %s", self.location.bucket, key, problem)
                continue
            if manifest.step != int(m.group("step")) or (manifest.fence_round or 0) != int(m.group("round")):
                log.warning("s3://%s/%s: names another step or round than its key", self.location.bucket, key)
                continue
            found.append(Published(manifest, posixpath.dirname(self.location.relative(key))))
        return sorted(found, key=lambda p: p.manifest.order, reverse=True)

    def problem(self, published: Published) -> str:
        """Why a published checkpoint cannot be trusted ("" when every object exists with its size and ETag)."""
        manifest = published.manifest
        if commit.METADATA_FILE not in manifest.files:
            return f"{MANIFEST_FILE} does not list {commit.METADATA_FILE}"
        names = sorted(manifest.files)
        heads = self._heads([self.location.key(published.key_prefix, name) for name in names])
        for name, head in zip(names, heads, strict=True):
            digest = manifest.files[name]
            if head is None:
                return f"object {name} is missing"
            if head["ContentLength"] != digest.size:
                return f"object {name} has {head['ContentLength']} bytes, {MANIFEST_FILE} says {digest.size}"
            if digest.etag is None or head["ETag"].strip('"') != digest.etag:
                return f"object {name} has ETag {head['ETag']}, {MANIFEST_FILE} says {digest.etag}"
        return ""

    def find_latest(self) -> Optional[Published]:
        """The newest published checkpoint whose objects all exist with their sizes and ETags."""
        for p in self.published():
            why = self.problem(p)
            if not why:
                return p
            log.warning("checkpoint s3://%s/%s rejected: %s", self.location.bucket, p.key_prefix, why)
        return None

    def download(self, published: Published, root: Path) -> Path:
        """Fetch a published checkpoint into ``root/step-N`` and verify every byte against its manifest (crc32 and
        sha256, :func:`disttrain.trainer.checkpoint.commit.validate`); returns the directory."""
        step = published.manifest.step
        tmp = root / commit.tmp_dir_name(step, uuid.uuid4().hex[:12], published.manifest.fence_round or 0)
        tmp.mkdir(parents=True)
        try:
            with self._transfers() as transfers:
                pending = [
                    transfers.download(
                        self.location.bucket, self.location.key(published.key_prefix, name), str(tmp / name)
                    )
                    for name in published.manifest.files
                ]
                for future in pending:
                    future.result()
            for name, expected in sorted(published.manifest.files.items()):
                actual = commit.file_digest(tmp / name, expected.digest.split(":", 1)[0])
                if (actual.size, actual.digest) != (expected.size, expected.digest):
                    raise OSError(
                        f"checkpoint step-{step} from s3://{self.location.bucket}/{published.key_prefix}: object "
                        f"{name} is {actual.size} bytes {actual.digest}, its manifest says {expected.size} bytes "
                        f"{expected.digest}"
                    )
            commit.write_manifest(tmp, published.manifest)
            return commit.publish(root, tmp, step)
        finally:
            commit.remove_entry(tmp)

    # ---- retention ----------------------------------------------------------------------------------------
    def retain(self, keep: int, protected: Iterable[int] = (), in_flight: Iterable[str] = ()) -> list[str]:
        """Delete all but the ``keep`` newest trusted checkpoints (never one of ``protected`` steps, never the
        newest), and incomplete prefixes of this round or older not ``in_flight`` whose step is older than the newest
        trusted one; returns the prefixes removed. Only while this group holds the newest round, and only once the
        newest published checkpoint verifies.

        An incomplete save of a newer step is kept whatever ``in_flight`` says: the other ranks upload their objects
        as soon as the save is committed locally, which can be before global rank 0's publisher hears of it."""
        self.check()
        published = self.published()
        trusted = [p for p in published if not self.problem(p)]
        if not trusted:
            return []
        keep_prefixes = {p.key_prefix for p in trusted[: max(1, keep)]}
        keep_prefixes |= {p.key_prefix for p in trusted if p.manifest.step in set(protected)}
        doomed = [p.key_prefix for p in published if p.key_prefix not in keep_prefixes]
        complete = {p.key_prefix for p in published}
        own = self.claim_round()
        skip = set(in_flight) | keep_prefixes
        newest_step = trusted[0].manifest.step
        for prefix in self._prefixes():
            m = re.match(r"^step-(\d+)/r(\d+)$", prefix)
            if (
                m
                and prefix not in complete
                and prefix not in skip
                and int(m.group(2)) <= own
                and int(m.group(1)) < newest_step
            ):
                doomed.append(prefix)
        removed = []
        for prefix in doomed:
            self.check()
            manifest = self.location.key(prefix, MANIFEST_FILE)
            self._delete([manifest])  # first: a reader never trusts a half-deleted checkpoint
            self._delete([k for k in self._list(self.location.key(prefix) + "/") if k != manifest])
            removed.append(prefix)
        if removed:
            log.info("bucket retention removed %s", ", ".join(removed))
        return removed

    # ---- S3 calls -----------------------------------------------------------------------------------------
    def _put(self, key: str, body: bytes, if_none_match: bool = False) -> None:
        extra = {"IfNoneMatch": "*"} if if_none_match else {}
        self.client.put_object(Bucket=self.location.bucket, Key=key, Body=body, **extra)

    def _heads(self, keys: list[str]) -> list[Optional[dict[str, Any]]]:
        """HEAD of every key (None for a missing one), ``max_concurrency`` at a time: a checkpoint of a large job
        has thousands of objects."""

        def head(key: str) -> Optional[dict[str, Any]]:
            try:
                out: dict[str, Any] = self.client.head_object(Bucket=self.location.bucket, Key=key)
                return out
            except Exception as exc:
                if _is_missing(exc):
                    return None
                raise

        with concurrent.futures.ThreadPoolExecutor(max(1, self.transfer.max_concurrency)) as pool:
            return list(pool.map(head, keys))

    def _list(self, prefix: str) -> list[str]:
        keys = []
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.location.bucket, Prefix=prefix):
            keys += [o["Key"] for o in page.get("Contents", [])]
        return keys

    def _prefixes(self) -> set[str]:
        """Every ``step-N/rR`` prefix with at least one object."""
        out = set()
        for key in self._list(self.location.key("step-") if self.location.prefix else "step-"):
            m = _STEP_KEY.match(self.location.relative(key))
            if m:
                out.add(f"step-{m.group('step')}/r{m.group('round')}")
        return out

    def _delete(self, keys: list[str]) -> None:
        for start in range(0, len(keys), 1000):
            batch = [{"Key": k} for k in keys[start : start + 1000]]
            if batch:
                self.client.delete_objects(Bucket=self.location.bucket, Delete={"Objects": batch, "Quiet": True})

    def _read_manifest(self, key: str) -> tuple[Optional[CheckpointManifest], str]:
        try:
            body = self.client.get_object(Bucket=self.location.bucket, Key=key)["Body"]
            data = body.read(commit.MAX_MANIFEST_BYTES + 1)
        except Exception as exc:
            if _is_missing(exc):
                return None, "vanished while listed"
            raise
        if len(data) > commit.MAX_MANIFEST_BYTES:
            return None, f"larger than {commit.MAX_MANIFEST_BYTES} bytes"
        try:
            return CheckpointManifest.model_validate_json(data), ""
        except (pydantic.ValidationError, ValueError) as exc:
            return None, f"does not parse: {str(exc).splitlines()[0]}"
