"""Who may use a job agent's TCPStore: whoever holds the job's store secret.

torch's TCPStore has no authentication, and any pod that can open a connection to the agent may ``set``, ``get``,
``delete_key`` or ``compare_set`` any key. What it cannot do is *list* keys: every command names its key. So the
secret is made part of every key: all clients (the agent, torchrun's rendezvous, the trainer's control channel)
address the store through a ``PrefixStore`` whose prefix is derived from the secret (:func:`key_prefix`). A client
without the secret can reach the server but cannot read, write, overwrite or delete any key the job uses, because
it cannot name one: the prefix carries 256 bits from ``secrets.token_hex``. Signing values (an HMAC the reader
checks) was the alternative; it stops forged values but not an attacker overwriting or deleting a signed value
(which blocks a drain as surely as forging one) nor replaying an old one, and torch's own rendezvous keys could
not be signed at all. The per-job NetworkPolicy keeps other pods off the port where the network plugin enforces
it (see docs/operator.md); this works where it does not.

What it does not protect: a client without the secret can still store junk under keys of its own (memory of the
agent: at most 8 MiB per value with the libuv server, but unbounded in count: the NetworkPolicy is the defence
there), and anyone who can sniff the pod network sees the keys in clear text (TCPStore has no TLS).
"""

from __future__ import annotations

import hashlib
import os
import secrets
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
    """The prefix every key of the job's store gets (a hash of the secret: as unguessable, and it is the prefix
    that grants access to the keys, so it must be kept as secret as the secret)."""
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
