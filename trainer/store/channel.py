"""Clients of the job agent's store: every value sealed and verified (:mod:`disttrain.trainer.store.signedstore`).

Every reader and writer of the store goes through :func:`scoped` (or :func:`connect`): the agent (the server's own
client), torchrun's rendezvous (:mod:`disttrain.trainer.launch.rendezvous`), the watchdog and failure reports
(:mod:`disttrain.trainer.control`). What they get is a ``PrefixStore`` over a :class:`~disttrain.trainer.
signedstore.SignedStore` over the raw TCPStore client: the prefix (:func:`disttrain.api.storeauth.key_prefix`)
only keeps the job's keys apart and names them, it protects nothing (anyone can list keys); the signing does.

There is no unsigned mode: a process without the job's store secret refuses to talk to the store
(:class:`MissingSecret`). Every pod of a job gets the secret from the operator (the ``<job>-store-<uid>`` Secret, or
``$DISTTRAIN_STORE_SECRET`` in local mode).
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Optional

from torch.distributed import PrefixStore, Store, TCPStore

from disttrain.api import env, storeauth
from disttrain.trainer.store import relay
from disttrain.trainer.store.resilient import ResilientStore
from disttrain.trainer.store.signedstore import ExitSafePrefixStore, RejectHook, SignedStore


class MissingSecret(RuntimeError):
    """The job's store secret is not set: nothing may be read from or written to the store without it."""


def _secret(secret: Optional[str]) -> str:
    value = storeauth.secret_from_env() if secret is None else secret
    if not value:
        raise MissingSecret(
            f"the job's store secret is not set: ${env.STORE_SECRET_FILE} (a file holding it) or "
            f"${env.STORE_SECRET} must give it; the operator sets it in every pod of a job, and the store "
            "cannot be used unsigned"
        )
    return value


def scoped(
    store: Store,
    secret: Optional[str] = None,
    job_uid: Optional[str] = None,
    on_reject: Optional[RejectHook] = None,
) -> Store:
    """``store`` (a raw TCPStore client) seen through the signed store, under the job's key prefix.

    ``secret`` defaults to the process's (:func:`disttrain.api.storeauth.secret_from_env`), ``job_uid`` to
    ``$DISTTRAIN_JOB_UID``; both must be the same in every process of the job. Raises :class:`MissingSecret`
    without a secret."""
    key = _secret(secret)
    uid = os.environ.get(env.JOB_UID, "") if job_uid is None else job_uid
    signed = SignedStore(store, key, uid, on_reject=on_reject)
    return ExitSafePrefixStore(storeauth.key_prefix(key), signed)


def signed_of(store: Store) -> Optional[SignedStore]:
    """The :class:`SignedStore` under ``store`` (through any PrefixStores), None when there is none: where the
    agent reads the rejection counter and sets ``on_reject``."""
    current: Optional[Store] = store
    while current is not None:
        if isinstance(current, SignedStore):
            return current
        current = current.underlying_store if isinstance(current, PrefixStore) else None
    return None


def connect(host: str, port: int, timeout_s: float, secret: Optional[str] = None) -> Store:
    """A client of the agent's store, signed and under the job's key prefix (see :func:`scoped`), that reconnects to
    ``host:port`` when the agent is lost and recreated (:class:`~disttrain.trainer.store.resilient.ResilientStore`)."""
    key = _secret(secret)  # before connecting: a missing secret is a configuration error, not a network one

    def client(timeout: timedelta) -> TCPStore:
        near_host, near_port = relay.route(host, port, key)  # the process's relay to the agent's front, if on
        return TCPStore(near_host, near_port, is_master=False, timeout=timeout, wait_for_workers=False)

    return scoped(ResilientStore(client, timedelta(seconds=timeout_s), address=(host, port)), key)
