"""Two connections joined once a handshake is done: what one receives is written to the other, in asyncio's
callbacks, with no task or stream buffer per message (the store front's and the relays' hot path).

Bounds: a side whose write buffer passes its high-water mark pauses reading the other side (asyncio's flow
control), and the pair is closed when it stays paused for ``stall_s``. A ``scan`` of the first side's bytes (the
front's request scanner) passes what may pass and stops the pair at a refusal; while it says a request has begun and
not ended, the pair is closed once ``half_sent_s`` pass.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Optional

from disttrain.trainer.store import wire


@dataclasses.dataclass(frozen=True)
class Timing:
    stall_s: float
    half_sent_s: Optional[float] = None


class _End(asyncio.Protocol):
    def __init__(self, pair: Pair, first: bool) -> None:
        self.pair, self.first = pair, first

    def data_received(self, data: bytes) -> None:
        self.pair.received(self.first, data)

    def eof_received(self) -> bool:
        self.pair.close("closed")
        return False

    def connection_lost(self, exc: Optional[BaseException]) -> None:
        self.pair.close("closed")

    def pause_writing(self) -> None:
        self.pair.hold(self.first, True)

    def resume_writing(self) -> None:
        self.pair.hold(self.first, False)


class Pair:
    """Joins ``first`` and ``second`` (transports whose handshakes are done); :attr:`done` resolves to why it
    ended: ``closed``, ``stalled``, ``half-sent`` or the refusal."""

    def __init__(
        self,
        first: asyncio.Transport,
        second: asyncio.Transport,
        timing: Timing,
        scan: Optional[wire.RequestScanner] = None,
    ) -> None:
        self.first, self.second, self.timing, self.scan = first, second, timing, scan
        self._loop = asyncio.get_running_loop()
        self.done: asyncio.Future[str] = self._loop.create_future()
        self._stalls: dict[bool, asyncio.TimerHandle] = {}
        self._half_sent: Optional[asyncio.TimerHandle] = None
        for transport, is_first in ((first, True), (second, False)):
            transport.set_protocol(_End(self, is_first))
            transport.resume_reading()

    def received(self, from_first: bool, data: bytes) -> None:
        if self.done.done():
            return
        if not from_first or self.scan is None:
            (self.second if from_first else self.first).write(data)
            return
        passing = self.scan.feed(data)
        if passing:
            self.second.write(data[:passing] if passing < len(data) else data)
        if self.scan.refused is not None:
            self.close(str(self.scan.refused))
            return
        self._follow_request()

    def send(self, from_first: bool, data: bytes) -> None:
        """Bytes a side sent during the handshake that belong to the stream (scanned like any of the first side's)."""
        if data:
            self.received(from_first, data)

    def _follow_request(self) -> None:
        half_sent_s = self.timing.half_sent_s
        if self.scan is None or half_sent_s is None:
            return
        if self.scan.mid_request and self._half_sent is None:
            self._half_sent = self._loop.call_later(half_sent_s, self.close, "half-sent")
        elif not self.scan.mid_request and self._half_sent is not None:
            self._half_sent.cancel()
            self._half_sent = None

    def hold(self, writer_is_first: bool, full: bool) -> None:
        """The side ``writer_is_first`` names has too much to write (``full``) or drained: pause or resume reading
        the other, and give up on the pair when it stays full for ``stall_s``."""
        source = self.second if writer_is_first else self.first
        if full:
            source.pause_reading()
            self._stalls[writer_is_first] = self._loop.call_later(self.timing.stall_s, self.close, "stalled")
        else:
            timer = self._stalls.pop(writer_is_first, None)
            if timer is not None:
                timer.cancel()
            if not source.is_closing():
                source.resume_reading()

    def close(self, why: str) -> None:
        for timer in [*self._stalls.values(), *([self._half_sent] if self._half_sent else [])]:
            timer.cancel()
        self._stalls.clear()
        self._half_sent = None
        self.first.abort()
        self.second.abort()
        if not self.done.done():
            self.done.set_result(why)


def leftover(reader: asyncio.StreamReader) -> bytes:
    """What ``reader`` buffered past the handshake (a client may send its first request before the proof came back):
    handed to the pair before its own reads. CPython's ``StreamReader`` keeps it in ``_buffer``."""
    buffer: Any = getattr(reader, "_buffer", b"")
    data = bytes(buffer)
    if isinstance(buffer, bytearray):
        buffer.clear()
    return data
