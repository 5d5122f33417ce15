"""The job agent's pulse on the wire: what the agent (:mod:`disttrain.trainer.agent.pulse`) sends and the operator
(:mod:`disttrain.operator.pulses`) reads, defined once.

One direction only, agent to operator::

    b"DTP1 " + <the agent pod's uid> + b"\\n"      once, when the connection is accepted
    b"."                                           every period
    b"-"                                           once, when the agent stops (then it closes)
"""

from typing import Final

MAGIC: Final = b"DTP1 "
PULSE: Final = b"."
BYE: Final = b"-"
"""The agent's last word on a clean stop (its job ended, SIGTERM): what follows is no silence to judge."""


def hello(pod_uid: str) -> bytes:
    """What a connection receives first: it names the pod, so a reader never takes another pod's pulse for it."""
    return MAGIC + pod_uid.encode() + b"\n"
