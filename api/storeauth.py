"""Who may use a job agent's TCPStore: whoever holds the job's store secret, by signing every value.

torch's TCPStore has no authentication, and since torch 2.10 it lists its keys (``list_keys``): any client that
can open a connection may read, write, overwrite, delete and replay any key. A key name is therefore not a secret,
and neither is the secret-derived prefix (:func:`key_prefix`) the job's keys still live under: it only keeps jobs
that share nothing apart and names keys; it protects nothing.

What protects the job is that every value is *sealed*: :func:`seal` wraps it in an envelope carrying an
HMAC-SHA256 (key derived from the secret, domain-separated) over a versioned header, the job UID, the full key name
as the server sees it, a sequence number and the value; :func:`unseal` checks it in constant time and returns
``None`` for anything that is not a valid envelope for that key of that job. Readers (the signed store,
:mod:`disttrain.trainer.store.signedstore`) treat such a value as absent, keep a per-key high-water mark of ``seq`` to
refuse replays of older values, and never unpickle or otherwise act on bytes that did not verify.

Envelope (all integers big-endian)::

    b"DTS1" | seq: u64 | mac: 32 bytes | value

    mac = HMAC-SHA256(mac_key, b"disttrain-store-seal-v1\0" | u32 len(job_uid) | job_uid
                                | u32 len(key) | key | seq: u64 | value)
    mac_key = HMAC-SHA256(secret, b"disttrain-store-mac-key-v1")

What it does not protect: a stranger can still delete or garble values (readers treat them as absent and the
job's own processes restore them: a delay, not a failure), store junk under keys of its own (the agent's
sweeper and the NetworkPolicy bound that), and anyone who can sniff the pod network reads values in clear text
(TCPStore has no TLS; sealing authenticates, it does not encrypt).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import os
import secrets
import struct
from collections.abc import Mapping
from typing import Optional

from disttrain.api import env

SECRET_BYTES = 32
SECRET_KEY = "secret"
"""The data key of the per-job Secret that holds the store secret."""


def new_secret() -> str:
    """A fresh store secret (64 hex characters)."""
    return secrets.token_hex(SECRET_BYTES)


def key_prefix(secret: str) -> str:
    """The prefix every key of the job's store gets (a hash of the secret). It is *not* a protection: any client
    can list the keys (torch >= 2.10). It keeps one job's keys apart from another's on a shared server; the
    protection is :func:`seal`."""
    if not secret:
        return ""
    return "s-" + hashlib.sha256(b"disttrain-store-v1\0" + secret.encode()).hexdigest()


def secret_from_env(environ: Optional[Mapping[str, str]] = None) -> str:
    """The store secret of this process: from ``$DISTTRAIN_STORE_SECRET_FILE`` (the mounted Secret), else
    ``$DISTTRAIN_STORE_SECRET``; "" when neither is set (a store without a secret: tests, old jobs).

    A named file that cannot be read is an error: silently going without the secret would make the worker talk
    to a namespace nobody else uses."""
    environ = os.environ if environ is None else environ
    path = environ.get(env.STORE_SECRET_FILE)
    if path:
        try:
            with open(path, encoding="utf-8") as handle:
                secret = handle.read().strip()
        except OSError as error:
            raise RuntimeError(f"${env.STORE_SECRET_FILE}={path!r} cannot be read: {error}") from error
        if not secret:
            raise RuntimeError(f"${env.STORE_SECRET_FILE}={path!r} is empty")
        return secret
    return environ.get(env.STORE_SECRET, "").strip()


MAGIC = b"DTS1"
"""Version tag of the envelope; a new format gets a new tag (and a new MAC domain)."""
_MAC_DOMAIN = b"disttrain-store-seal-v1\0"
_KEY_DOMAIN = b"disttrain-store-mac-key-v1"
_SEQ = struct.Struct(">Q")
_LEN = struct.Struct(">I")
MAC_BYTES = 32
HEADER_BYTES = len(MAGIC) + _SEQ.size + MAC_BYTES
"""Bytes an envelope adds to a value."""
SEQ_MAX = 2**64 - 1


@dataclasses.dataclass(frozen=True)
class Sealed:
    """A value that verified: its plain bytes and its sequence number (monotonic per key)."""

    value: bytes
    seq: int


def mac_key(secret: str) -> bytes:
    """The HMAC key of the store, derived from the secret with its own domain (the secret itself keys nothing
    else directly, and the prefix is a different hash of it)."""
    if not secret:
        raise ValueError("store secret is empty: a store value cannot be sealed without the job's secret")
    return hmac.new(secret.encode(), _KEY_DOMAIN, hashlib.sha256).digest()


def _mac(key: bytes, job_uid: str, name: str, seq: int, value: bytes) -> bytes:
    uid, kname = job_uid.encode(), name.encode()
    msg = hmac.new(key, _MAC_DOMAIN, hashlib.sha256)
    msg.update(_LEN.pack(len(uid)) + uid + _LEN.pack(len(kname)) + kname + _SEQ.pack(seq))
    msg.update(value)
    return msg.digest()


def seal_with(key: bytes, job_uid: str, name: str, value: bytes, seq: int) -> bytes:
    """:func:`seal` with a key from :func:`mac_key` (hot paths derive it once)."""
    if not 0 <= seq <= SEQ_MAX:
        raise ValueError(f"seq={seq} is out of range: it must be in [0, 2**64)")
    return MAGIC + _SEQ.pack(seq) + _mac(key, job_uid, name, seq, bytes(value)) + bytes(value)


def unseal_with(key: bytes, job_uid: str, name: str, raw: bytes) -> Optional[Sealed]:
    """:func:`unseal` with a key from :func:`mac_key`."""
    raw = bytes(raw)
    if len(raw) < HEADER_BYTES or raw[: len(MAGIC)] != MAGIC:
        return None
    (seq,) = _SEQ.unpack_from(raw, len(MAGIC))
    mac = raw[len(MAGIC) + _SEQ.size : HEADER_BYTES]
    value = raw[HEADER_BYTES:]
    if not hmac.compare_digest(mac, _mac(key, job_uid, name, seq, value)):
        return None
    return Sealed(value=value, seq=seq)


def seal(secret: str, job_uid: str, key: str, value: bytes, seq: int) -> bytes:
    """``value`` in an envelope that only holders of ``secret`` can make, bound to this job UID, this full key
    name (as the server sees it, prefix included) and ``seq`` (the writer's sequence number for the key)."""
    return seal_with(mac_key(secret), job_uid, key, value, seq)


def unseal(secret: str, job_uid: str, key: str, raw: bytes) -> Optional[Sealed]:
    """The value and seq inside ``raw`` when it is a valid envelope for ``key`` of job ``job_uid`` sealed with
    ``secret``; ``None`` otherwise (forged, garbled, truncated, another key's or another job's value). Replay of
    an older valid value is the reader's to refuse (it knows the highest seq it has seen)."""
    return unseal_with(mac_key(secret), job_uid, key, raw)
