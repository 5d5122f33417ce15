"""What the launcher starts before it imports torch: the handover socket and the warm worker interpreters."""

from __future__ import annotations

import os
from typing import Optional

from disttrain.api import env
from disttrain.trainer.launch.handover import Broker
from disttrain.trainer.launch.warmstart import WarmPool

WARM_POOL = WarmPool()
"""This agent's warm worker interpreters."""
HANDOVER: Optional[Broker] = None
"""Where this agent's workers wait for the next round in place (:mod:`disttrain.trainer.launch.handover`)."""


def open_handover() -> Optional[Broker]:
    """The handover socket, named in the workers' environment (``$DISTTRAIN_LAUNCHER_SOCKET``) before any starts."""
    global HANDOVER
    if HANDOVER is None:
        HANDOVER = Broker.listen()
        if HANDOVER is not None:
            os.environ[env.LAUNCHER_SOCKET] = HANDOVER.name
    return HANDOVER
