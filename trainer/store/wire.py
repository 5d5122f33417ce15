"""The store front's pure parts: the handshake that proves a client holds the job's secret, and a streaming scanner
of torch's TCPStore requests that refuses the commands a job never sends.

Handshake (:mod:`disttrain.api.handshake`; every integer and nonce raw bytes; ``k = HMAC-SHA256(secret,
"disttrain-store-front-key-v1")``)::

    front  -> client   b"DTF1" | nonce_f (32)
    client -> front    b"DTF1" | nonce_c (32) | HMAC(k, "client\\0" | nonce_f | nonce_c)
    front  -> client   HMAC(k, "front\\0" | nonce_c | nonce_f)

Both sides prove the key on fresh nonces of the other's, so a recorded exchange is worth nothing; a wrong or late
answer closes the connection before a byte of it reaches torch's server. The front's answer lets the client's relay
refuse an impostor standing in for the agent.

Requests (torch's ``QueryType``, little-endian as torch writes them): a command byte, then fixed fields, strings
(``u64`` length + bytes, at most :data:`MAX_KEY` for a key, which must be UTF-8) and payloads (``u64`` length + bytes,
at most :data:`MAX_PAYLOAD`). The scanner keeps no payload: it checks lengths, counts the bytes still owed and lets
them pass, so one connection costs at most one key name of state whatever the values' size.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Generator
from typing import Optional

from disttrain.api import handshake

MAGIC, NONCE, MAC = handshake.MAGIC, handshake.NONCE, handshake.MAC
GREETING_LEN, ANSWER_LEN, PROOF_LEN = handshake.GREETING_LEN, handshake.ANSWER_LEN, handshake.PROOF_LEN
greeting, answer, check_answer, check_proof = (
    handshake.greeting,
    handshake.answer,
    handshake.check_answer,
    handshake.check_proof,
)
HandshakeFailed = handshake.HandshakeFailed

MAX_KEY = 8 * 1024
"""torch's libuv server's own limit on a key name."""
MAX_PAYLOAD = 8 * 1024 * 1024
"""torch's libuv server's own limit on a value."""
MAX_KEY_COUNT = 1024
"""Keys in one ``check``/``wait``/``multi_get``/``multi_set``: the job's clients name a handful."""

VALIDATE, SET, COMPARE_SET, GET, ADD, CHECK, WAIT, GETNUMKEYS, DELETE_KEY, APPEND = range(10)
MULTI_GET, MULTI_SET, CANCEL_WAIT, PING, QUEUE_PUSH, QUEUE_POP, QUEUE_LEN, LIST_KEYS = range(10, 18)

REFUSED = {APPEND: "append", QUEUE_PUSH: "queue_push", QUEUE_POP: "queue_pop", QUEUE_LEN: "queue_len"}
"""Commands no process of a job sends (disttrain and torchrun's rendezvous use neither), refused at the front: a
queue entry is invisible to ``list_keys`` and an ``append`` grows a value past :data:`MAX_PAYLOAD`."""


def front_key(secret: str) -> bytes:
    """The handshake's MAC key, domain-separated from the value-sealing key of :mod:`disttrain.api.storeauth`."""
    return hmac.new(secret.encode(), b"disttrain-store-front-key-v1", hashlib.sha256).digest()


class Refused(ValueError):
    """A request the front does not pass to torch's server (the connection is closed)."""


# The scanner: a generator asks for ("take", n) bytes it needs to read, or ("pass", n) bytes it lets through
# unread; the driver (RequestScanner.feed) answers "take" with the bytes.
_Ask = tuple[str, int]
_Steps = Generator[_Ask, bytes, None]


def _u64(data: bytes) -> int:
    return int(struct.unpack("<Q", data)[0])


def _sized(limit: int, what: str) -> _Steps:
    size = _u64((yield ("take", 8)))
    if size > limit:
        raise Refused(f"{what} of {size} bytes; at most {limit} pass the front")
    if size:
        yield ("pass", size)


def _key() -> _Steps:
    """A key name: torch's clients read keys back as text (``list_keys`` decodes UTF-8), so one key that is not
    UTF-8 would make every listing fail, and the agent's guardian could sweep nothing any more."""
    size = _u64((yield ("take", 8)))
    if size > MAX_KEY:
        raise Refused(f"a key of {size} bytes; at most {MAX_KEY} pass the front")
    if size:
        name = yield ("take", size)
        try:
            name.decode("utf-8")
        except UnicodeDecodeError:
            raise Refused("a key that is not UTF-8 (torch's clients could not list the store's keys)") from None


def _count() -> Generator[_Ask, bytes, int]:
    count = _u64((yield ("take", 8)))
    if count > MAX_KEY_COUNT:
        raise Refused(f"{count} keys in one request; at most {MAX_KEY_COUNT} pass the front")
    return count


def _request(command: int) -> _Steps:
    if command in REFUSED:
        raise Refused(f"command {REFUSED[command]} is refused at the front")
    if command in (VALIDATE, PING):
        yield ("pass", 4)
    elif command in (SET, COMPARE_SET):
        yield from _key()
        yield from _sized(MAX_PAYLOAD, "a value")
        if command == COMPARE_SET:
            yield from _sized(MAX_PAYLOAD, "a value")
    elif command in (GET, DELETE_KEY):
        yield from _key()
    elif command == ADD:
        yield from _key()
        yield ("pass", 8)
    elif command in (CHECK, WAIT, MULTI_GET, MULTI_SET):
        for _ in range((yield from _count())):
            yield from _key()
            if command == MULTI_SET:
                yield from _sized(MAX_PAYLOAD, "a value")
    elif command not in (GETNUMKEYS, CANCEL_WAIT, LIST_KEYS):
        raise Refused(f"unknown command {command}")


class RequestScanner:
    """Follows a client's request stream byte by byte (see the module docstring): :meth:`feed` stops at the first
    byte of a request that must not pass, before any of it is forwarded; :attr:`mid_request` says whether a request
    has begun and not ended (the front's half-sent timeout)."""

    def __init__(self) -> None:
        self._steps = self._all()
        self._ask: _Ask = next(self._steps)
        self._taken = bytearray()
        self.refused: Optional[Refused] = None
        self.mid_request = False

    def _all(self) -> _Steps:
        while True:
            self.mid_request = False
            command = (yield ("take", 1))[0]
            self.mid_request = True
            yield from _request(command)

    def feed(self, data: bytes) -> int:
        """Scan ``data`` (the next bytes of the stream) and return how many of them may pass: all of them, or the
        bytes before the request that is refused, which is then in :attr:`refused` (and stays: nothing passes
        after it)."""
        if self.refused is not None:
            return 0
        view, at, request_at = memoryview(data), 0, 0
        try:
            while at < len(view):
                if not self.mid_request:
                    request_at = at
                at = self._step(view, at)
        except Refused as exc:
            self.refused = exc
            return request_at
        return len(view)

    def _step(self, view: memoryview, at: int) -> int:
        kind, size = self._ask
        if kind == "pass":
            step = min(size, len(view) - at)
            self._ask = (kind, size - step) if step < size else self._steps.send(b"")
            return at + step
        step = min(size - len(self._taken), len(view) - at)
        self._taken += view[at : at + step]
        if len(self._taken) == size:
            taken, self._taken = bytes(self._taken), bytearray()
            self._ask = self._steps.send(taken)
        return at + step
