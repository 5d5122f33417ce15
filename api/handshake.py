"""A challenge-response that proves, both ways, that two ends hold one key: the store front's handshake
(:mod:`disttrain.trainer.store.wire`, keyed by the job's store secret) and the agent pulse's
(:mod:`disttrain.api.pulse`, keyed by the job's pulse key). Pure, no I/O.

Every integer and nonce raw bytes; ``k`` the protocol's own key (domain-separated by its derivation)::

    server -> client   b"DTF1" | nonce_s (32)
    client -> server   b"DTF1" | nonce_c (32) | HMAC(k, "client\\0" | nonce_s | nonce_c)
    server -> client   HMAC(k, "front\\0" | nonce_c | nonce_s)

Both sides prove the key on fresh nonces of the other's, so a recorded exchange is worth nothing; the server's
answer lets the client refuse an impostor standing in for the server.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from typing import Optional

MAGIC = b"DTF1"
NONCE = 32
MAC = 32
GREETING_LEN = len(MAGIC) + NONCE
ANSWER_LEN = len(MAGIC) + NONCE + MAC
PROOF_LEN = MAC


class HandshakeFailed(ConnectionError):
    """The other side does not hold the key, or does not speak the handshake."""


def _mac(key: bytes, label: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(key, label + b"\0" + first + second, hashlib.sha256).digest()


def greeting(nonce_s: Optional[bytes] = None) -> bytes:
    """The server's first bytes: its fresh nonce."""
    return MAGIC + (nonce_s if nonce_s is not None else os.urandom(NONCE))


def answer(key: bytes, greeting_bytes: bytes, nonce_c: Optional[bytes] = None) -> bytes:
    """The client's proof for the server's ``greeting_bytes``; raises :class:`HandshakeFailed` on a bad greeting."""
    if len(greeting_bytes) != GREETING_LEN or not greeting_bytes.startswith(MAGIC):
        raise HandshakeFailed("the agent's store did not greet as a disttrain store front (wrong port or version?)")
    nonce_c = nonce_c if nonce_c is not None else os.urandom(NONCE)
    return MAGIC + nonce_c + _mac(key, b"client", greeting_bytes[len(MAGIC) :], nonce_c)


def check_answer(key: bytes, greeting_bytes: bytes, answer_bytes: bytes) -> Optional[bytes]:
    """The server's proof back to the client when ``answer_bytes`` proves the key, else None."""
    if len(answer_bytes) != ANSWER_LEN or not answer_bytes.startswith(MAGIC):
        return None
    nonce_s = greeting_bytes[len(MAGIC) :]
    nonce_c = answer_bytes[len(MAGIC) : len(MAGIC) + NONCE]
    if not hmac.compare_digest(answer_bytes[len(MAGIC) + NONCE :], _mac(key, b"client", nonce_s, nonce_c)):
        return None
    return _mac(key, b"front", nonce_c, nonce_s)


def check_proof(key: bytes, greeting_bytes: bytes, answer_bytes: bytes, proof: bytes) -> bool:
    """Whether the server's ``proof`` shows it holds the key (the client's side)."""
    nonce_s = greeting_bytes[len(MAGIC) :]
    nonce_c = answer_bytes[len(MAGIC) : len(MAGIC) + NONCE]
    return hmac.compare_digest(proof, _mac(key, b"front", nonce_c, nonce_s))
