"""What a stranger who watches a local job's network sees without any secret: store values are signed, not
encrypted, so the directive and the ranks' step beacons go by as they are in the store, and the agent's pulse port is
in the open. Written as ``tests/security/outsider.py --sniffed`` reads it."""

from __future__ import annotations

import base64
import datetime
from typing import Any

from torch.distributed import TCPStore

from disttrain.api import control, storeauth
from disttrain.operator import access
from disttrain.operator.local.runtime import LocalRuntime
from disttrain.trainer.store import relay


def sniff(runtime: LocalRuntime, ranks: int) -> dict[str, Any]:
    """The job's directive (signal and target plan) and the step beacons of ``ranks`` ranks as they are now, and
    where the agent pulses. Read here with the job's secret, through a relay as a worker reads (a sniffer sees the
    same bytes on the wire); the outsider gets none of the secret."""
    namespace = storeauth.key_prefix(runtime.spawner.store_secret) + "/"
    names = [control.SIGNAL_KEY, control.TARGET_KEY, *(control.beacon_key(rank) for rank in range(ranks))]
    fronted = access.STORE_FRONT == "1"  # what the runtime tells the job's pods (a bench may serve the store bare)
    near = relay.Relay(("127.0.0.1", runtime.store_port), runtime.spawner.store_secret) if fronted else None
    address = near.address if near is not None else ("127.0.0.1", runtime.store_port)
    try:
        raw = TCPStore(*address, is_master=False, wait_for_workers=False, timeout=datetime.timedelta(seconds=10))
        values = {}
        for name in names:
            if raw.check([namespace + name]):
                values[namespace + name] = base64.b64encode(raw.get(namespace + name)).decode()
    finally:
        if near is not None:
            near.close()
    return {"values": values, "pulse": f"127.0.0.1:{runtime.pulse_port}" if runtime.pulse_port else ""}
