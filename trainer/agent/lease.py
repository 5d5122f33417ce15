"""The job agent's own heartbeat: it renews its Lease every second, where the operator reads.

Why: the workers' beats go into the store this agent hosts, so nothing of theirs says when the agent's own node
died; Kubernetes says so only at NotReady (40 s by default). The operator watches the Lease and replaces an agent
that stopped renewing it (:mod:`disttrain.operator.agentbeat` has the rule). The operator creates the Lease with
the agent and names it in ``$DISTTRAIN_AGENT_LEASE``; the agent's Role lets it patch that one Lease and create none.

Renewals start once the store serves, so a renewal also says the store is up. ``holderIdentity`` is the agent pod's
uid (downward API), so a beat is never taken for its replacement's. A Lease the agent may not patch (403: a Role of
an older operator) or that is gone (404) is logged once and tried again every :data:`REFUSED_RETRY_S`: the operator
then falls back on Kubernetes' NotReady, as before the Lease existed.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from typing import Any, Optional

from disttrain.api import constants

log = logging.getLogger("disttrain.agent")

FIELD_MANAGER = "disttrain-agent"
REQUEST_TIMEOUT_S = 5.0
"""A renewal that takes longer is abandoned; the next one starts at once."""
REFUSED_RETRY_S = 30.0
"""How long after a 403 or 404 the agent tries again."""


def micro_time(at: datetime.datetime) -> str:
    """A Kubernetes MicroTime (RFC 3339 with microseconds, UTC)."""
    return at.astimezone(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaseRenewer:
    """Renews ``namespace/name`` every ``renew_s`` on a thread of its own, as ``holder``."""

    def __init__(
        self,
        coordination: Any,
        namespace: str,
        name: str,
        holder: str,
        renew_s: float = constants.AGENT_LEASE_RENEW_SECONDS,
    ) -> None:
        self.coordination = coordination
        """A ``kubernetes.client.CoordinationV1Api``."""
        self.namespace, self.name, self.holder, self.renew_s = namespace, name, holder, renew_s
        self.renewals = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._refused: Optional[int] = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="agent-lease", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def renew_once(self) -> float:
        """One renewal; returns how long to wait before the next."""
        body = {"spec": {"holderIdentity": self.holder, "renewTime": micro_time(datetime.datetime.now())}}
        try:
            self.coordination.patch_namespaced_lease(
                self.name, self.namespace, body, field_manager=FIELD_MANAGER, _request_timeout=REQUEST_TIMEOUT_S
            )
        except Exception as exc:  # noqa: BLE001 - the API server may be away: the next renewal tries again
            status = getattr(exc, "status", None)
            if status in (403, 404):
                if self._refused != status:
                    log.warning(
                        "cannot renew Lease %s/%s (%s %s): the operator will notice this agent's loss only when "
                        "Kubernetes marks its node NotReady; trying again every %.0f s",
                        self.namespace,
                        self.name,
                        status,
                        getattr(exc, "reason", ""),
                        REFUSED_RETRY_S,
                    )
                self._refused = status
                return REFUSED_RETRY_S
            log.debug("renewing Lease %s/%s failed: %s", self.namespace, self.name, exc)
            return self.renew_s
        if self._refused is not None:
            log.info("Lease %s/%s renewed again", self.namespace, self.name)
        self._refused = None
        self.renewals += 1
        return self.renew_s

    def _run(self) -> None:
        delay = 0.0
        while not self._stop.wait(delay):
            began = time.monotonic()
            delay = max(0.0, self.renew_once() - (time.monotonic() - began))  # every renew_s, not renew_s + RTT
