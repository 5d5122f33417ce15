"""Clients of the job agent's store, always inside the job's secret key namespace (:mod:`disttrain.api.storeauth`).

Every reader and writer of the store goes through :func:`scoped`: the agent (the server's own client), torchrun's
rendezvous (:mod:`disttrain.trainer.rendezvous`), the watchdog and failure reports (:mod:`disttrain.trainer.control`).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Optional

from torch.distributed import PrefixStore, Store, TCPStore

from disttrain.api import storeauth


def scoped(store: Store, secret: Optional[str] = None) -> Store:
    """``store`` seen through the job's secret namespace (the store itself when the job has no secret)."""
    prefix = storeauth.key_prefix(storeauth.secret_from_env() if secret is None else secret)
    return PrefixStore(prefix, store) if prefix else store


def connect(host: str, port: int, timeout_s: float, secret: Optional[str] = None) -> Store:
    """A client of the agent's store, scoped to the job's secret namespace."""
    client = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    return scoped(client, secret)
