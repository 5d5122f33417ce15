"""DCP storage in DCP's own file format, written at close to the disk's speed and digested while written.

The ``.distcp`` files hold what DCP's ``FileSystemWriter`` writes, so DCP's own tools (``FileSystemReader``,
``format_utils.dcp_to_torch_save``) read every checkpoint: each tensor is one ``torch.save`` archive. What makes
it fast: the archive is written straight into the shard file (no intermediate buffer), without the zip's per-record
crc32 (the file's crc32, computed on the way by :mod:`disttrain.trainer.checkpoint.digesting`, covers the same
bytes, and ``torch.load`` does not need it), in slices whose writeback starts at once
(:mod:`disttrain.trainer.checkpoint.writeback`). DCP's planning, metadata (``.metadata``), resharding on load and
collectives are DCP's.

Reading trusts nothing on the path: every file is opened without following links (``O_NOFOLLOW``, regular files
only), and ``.metadata``, a pickle, is unpickled only after its bytes (the very bytes unpickled) match the sha256
that ``COMPLETE.json`` records for it (:meth:`CheckpointReader.read_metadata`); tensors are loaded with
``weights_only=True``. Checkpoints whose items are raw tensor bytes (an item exactly as long as its chunk's
bytes, as this project wrote them before) read as well.
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import queue
import threading
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Optional, cast

import torch
from torch.distributed.checkpoint.filesystem import (
    DEFAULT_SUFFIX,
    FileSystem,
    FileSystemReader,
    FileSystemWriter,
    _split_by_size_and_type,
    _StorageInfo,
)
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.checkpoint.utils import _create_file_view
from torch.futures import Future

from disttrain.api.manifest import MANIFEST_FILE
from disttrain.trainer.checkpoint import commit, writeback
from disttrain.trainer.checkpoint.digesting import DigestingFileSystem

WRITEBACK_SLICE = 8 * 2**20
"""Bytes written (and digested) between two writeback kicks (:mod:`disttrain.trainer.checkpoint.writeback`)."""


def _byte_view(t: torch.Tensor) -> memoryview:
    """A CPU tensor's bytes (reading a checkpoint whose items are raw bytes)."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return flat.view(torch.uint8).numpy().data


def _host_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor as ``torch.save`` should get it: in host memory (as DCP's own writer copies it) and owning its
    storage (``torch.save`` writes a view's whole storage, so a view is cloned first, as DCP does)."""
    out = t.detach()
    if out.device.type != "cpu":
        out = out.to("cpu")
    if out.untyped_storage().size() != out.nbytes:
        out = out.clone()
    return out


class _SlicedStream:
    """Passes writes on to ``stream`` in :data:`WRITEBACK_SLICE` pieces and starts the writeback of each full
    slice, so the final fsync waits only for the tail."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.position = 0
        self._flushed = 0  # bytes whose writeback has been started

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), WRITEBACK_SLICE):
            piece = view[start : start + WRITEBACK_SLICE]
            self.stream.write(piece)
            self.position += len(piece)
            if self.position - self._flushed >= WRITEBACK_SLICE:
                self.stream.flush()
                writeback.start_writeback(self.stream.fileno(), self._flushed, self.position - self._flushed)
                self._flushed = self.position
        return len(view)

    def flush(self) -> None:
        self.stream.flush()


def write_tensor(stream: Any, tensor: torch.Tensor) -> None:
    """``torch.save(tensor, stream)`` without the zip's crc32 and without touching the process-wide
    serialization settings (the training loop may be saving something else in another thread)."""
    archive = torch._C.PyTorchFileWriter(stream, False, torch.serialization._get_storage_alignment())
    torch.serialization._save(  # type: ignore[no-untyped-call]
        tensor, archive, pickle, torch.serialization.DEFAULT_PROTOCOL, False
    )
    archive.write_end_of_file()


class CheckpointWriter(FileSystemWriter):
    """DCP's file format, each tensor written straight into its shard file and digested on the way."""

    def __init__(self, path: str, thread_count: int = 2) -> None:
        super().__init__(path, thread_count=thread_count, sync_files=True)
        self._digesting = DigestingFileSystem()
        self.fs = self._digesting

    @property
    def digests(self) -> dict[str, tuple[int, str]]:
        """file name -> (size, "crc32:<hex>") of every shard this writer wrote, computed while writing."""
        return self._digesting.digests

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        prefix = plan.storage_data.prefix
        jobs: queue.Queue[tuple[str, list[WriteItem]]] = queue.Queue()
        for i, bucket in enumerate(_split_by_size_and_type(self.thread_count, plan.items)):
            jobs.put((f"{prefix}{i}{DEFAULT_SUFFIX}", bucket))
        results: list[WriteResult] = []
        errors: list[BaseException] = []
        lock = threading.Lock()

        def work() -> None:
            try:
                while True:
                    name, items = jobs.get_nowait()
                    out = self._write_file(name, items, planner)
                    with lock:
                        results.extend(out)
            except queue.Empty:
                return
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                with lock:
                    errors.append(exc)

        threads = [threading.Thread(target=work, name="disttrain-raw-writer") for _ in range(self.thread_count - 1)]
        for t in threads:
            t.start()
        work()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _write_file(self, name: str, items: list[WriteItem], planner: SavePlanner) -> list[WriteResult]:
        out = []
        path = self.fs.concat_path(self.path, name)
        with self.fs.create_stream(path, "wb") as raw:
            stream = _SlicedStream(raw)
            for item in items:
                offset = stream.position
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    stream.write(cast(io.BytesIO, data).getbuffer())
                else:
                    write_tensor(stream, _host_tensor(cast(torch.Tensor, data)))
                length = stream.position - offset
                out.append(
                    WriteResult(index=item.index, size_in_bytes=length, storage_data=_StorageInfo(name, offset, length))
                )
            raw.flush()
            os.fsync(raw.fileno())
        return out


class MetadataMismatchError(ValueError):
    """``.metadata`` is not the one the checkpoint's manifest committed: it is never unpickled."""


class _NoFollowFileSystem(FileSystem):
    """DCP's file system for reading, with no link followed: a shard file that is a link is an error."""

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Generator[Any, None, None]:
        if mode != "rb":
            raise ValueError(f"mode {mode!r}: checkpoints are only read here ('rb')")
        with os.fdopen(commit.open_regular(Path(path)), "rb") as stream:
            yield stream


class CheckpointReader(FileSystemReader):
    """Reads checkpoints through no link and with a verified ``.metadata``: ``expected_metadata_sha256`` is its
    hash from the manifest the caller validated (without it, the directory's own ``COMPLETE.json`` is read)."""

    def __init__(self, path: str, expected_metadata_sha256: Optional[str] = None) -> None:
        super().__init__(path)
        self.fs = _NoFollowFileSystem()
        self.expected_metadata_sha256 = expected_metadata_sha256

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's metadata, unpickled only once the bytes read match the committed sha256 (hashing and unpickling
        the same bytes leaves no window for the file to change in between)."""
        path = Path(self._get_metadata_path(kwargs.get("rank")))
        data = commit.read_regular(path)
        expected = self.expected_metadata_sha256
        if expected is None:
            manifest, problem = commit.read_manifest(Path(self.path))
            if manifest is None:
                raise MetadataMismatchError(f"{path}: not unpickled, no committed hash to check it against ({problem})")
            expected = manifest.metadata_sha256
        actual = hashlib.sha256(data).hexdigest()
        if actual != expected:
            raise MetadataMismatchError(
                f"{path}: sha256 {actual}, {MANIFEST_FILE} says {expected}; a .metadata that is not the committed one "
                "is never unpickled"
            )
        metadata = pickle.loads(data)  # verified against the committed hash just above
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return cast(Metadata, metadata)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for req in plan.items:
            per_file.setdefault(self.storage_data[req.storage_index].relative_path, []).append(req)
        metadata = planner.metadata  # type: ignore[attr-defined]
        for relative_path, reqs in per_file.items():
            with self.fs.create_stream(self.fs.concat_path(self.path, relative_path), "rb") as stream:
                for req in sorted(reqs, key=lambda r: self.storage_data[r.storage_index].offset):
                    info: _StorageInfo = self.storage_data[req.storage_index]
                    stream.seek(info.offset)
                    if req.type == LoadItemType.BYTE_IO:
                        buf = io.BytesIO(stream.read(info.length))
                        planner.load_bytes(req, buf)
                        continue
                    tensor = self._read_item(
                        stream, info, metadata.state_dict_metadata[req.storage_index.fqn], req.storage_index.offset
                    )
                    for dim, (start, length) in enumerate(zip(req.storage_offsets, req.lengths, strict=True)):
                        tensor = tensor.narrow(dim, start, length)
                    target = planner.resolve_tensor(req).detach()
                    if target.size() != tensor.size():
                        raise ValueError(
                            f"checkpoint item {req.storage_index.fqn}: stored {tuple(tensor.size())}, "
                            f"expected {tuple(target.size())}"
                        )
                    target.copy_(tensor)
                    planner.commit_tensor(req, target)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @staticmethod
    def _read_item(stream: Any, info: _StorageInfo, md: TensorStorageMetadata, offsets: Any) -> torch.Tensor:
        """A ``torch.save`` archive (``weights_only``), or raw bytes when the item is exactly its chunk's size
        (an archive is always longer than the bytes it holds)."""
        chunk = next(c for c in md.chunks if tuple(c.offsets) == tuple(offsets or (0,) * len(c.offsets)))
        raw_length = chunk.sizes.numel() * md.properties.dtype.itemsize
        if info.length != raw_length:
            view = cast(IO[bytes], _create_file_view(stream, info.offset, info.length))
            return cast(torch.Tensor, torch.load(view, map_location="cpu", weights_only=True))
        tensor = torch.empty(tuple(chunk.sizes), dtype=md.properties.dtype)
        if info.length:
            got = stream.readinto(_byte_view(tensor))
            if got != info.length:
                raise ValueError(f"checkpoint item truncated: read {got} of {info.length} bytes")
        return tensor
