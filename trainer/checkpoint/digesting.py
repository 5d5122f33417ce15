"""A DCP file system that digests shard files while writing them, so the commit need not re-read them.

Every byte DCP writes through :class:`DigestingFileSystem` goes through ``zlib.crc32`` on the way to the file
(zlib releases the GIL, so the writer threads keep both digesting and writing). A stream that seeks away from
its end, or is opened in another mode, is marked unknown and the commit falls back to reading the file back.
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystem


class _DigestingStream:
    def __init__(self, raw: Any) -> None:
        self._raw = raw
        self.crc = 0
        self.size = 0
        self.valid = True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.crc = zlib.crc32(view, self.crc)
        self.size += len(view)
        written: int = self._raw.write(data)
        return written

    def seek(self, *args: Any) -> int:
        pos: int = self._raw.seek(*args)
        if pos != self.size:
            self.valid = False
        return pos

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


class DigestingFileSystem(FileSystem):
    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self.digests: dict[str, tuple[int, str]] = {}
        """file name -> (size, "crc32:<hex>") for every shard fully written in order."""

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Generator[Any, None, None]:
        with super().create_stream(path, mode) as raw:
            if mode != "wb" or not str(path).endswith(".distcp"):
                yield raw
                return
            stream = _DigestingStream(raw)
            yield stream
            if stream.valid:
                with self._lock:
                    self.digests[Path(path).name] = (stream.size, f"crc32:{stream.crc:08x}")
