"""The job agent's pulse on the wire: what the agent (:mod:`disttrain.trainer.agent.pulse`) sends and the operator
(:mod:`disttrain.operator.pulses`) reads, defined once.

The operator proves the job's pulse key first, with the handshake of :mod:`disttrain.api.handshake` (the agent's
greeting, the operator's answer, the agent's proof), and only then does the agent pulse to it::

    agent    -> operator   b"DTF1" | nonce_a (32)                          at once, when the connection is accepted
    operator -> agent      b"DTF1" | nonce_o (32) | HMAC(k, ...)          within HANDSHAKE_S, or the agent closes it
    agent    -> operator   HMAC(k, ...) (32) | b"DTP2 " + <the agent pod's uid> + b"\\n"
    agent    -> operator   b"."                                            every period
    agent    -> operator   b"-"                                            once, when the agent stops (then it closes)

``k`` is the job's pulse key (:func:`job_key`): the operator derives it from its own key and the job's uid, and puts
it in the job's Secret (data key :data:`SECRET_KEY`) when it creates the Secret, so the operator never reads a
Secret and one job's key says nothing of another's. A connection that has not proven the key gets no pulse and
never takes the place of one that has.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Final

MAGIC: Final = b"DTP2 "
PULSE: Final = b"."
BYE: Final = b"-"
"""The agent's last word on a clean stop (its job ended, SIGTERM): what follows is no silence to judge."""
SECRET_KEY: Final = "pulse-key"
"""The job's pulse key in the job's Secret (hex), next to its store secret."""
KEY_BYTES: Final = 32
HANDSHAKE_S: Final = 2.0
"""How long the agent waits for a connection's answer before it closes it."""
_KEY_DOMAIN: Final = b"disttrain-pulse-key-v1\0"


def hello(pod_uid: str) -> bytes:
    """What a connection receives after the proof: it names the pod, so a reader never takes another pod's pulse
    for it."""
    return MAGIC + pod_uid.encode() + b"\n"


def job_key(operator_key: bytes, job_uid: str) -> bytes:
    """The pulse key of the job ``job_uid``, from the operator's own key (one-way: it reveals neither the operator's
    key nor another job's)."""
    return hmac.new(operator_key, _KEY_DOMAIN + job_uid.encode(), hashlib.sha256).digest()


def parse_key(text: str) -> bytes:
    """A pulse key as written in a Secret or a file (hex); raises ValueError naming what is wrong."""
    cleaned = text.strip()
    try:
        key = bytes.fromhex(cleaned)
    except ValueError:
        raise ValueError(f"a pulse key must be {2 * KEY_BYTES} hex digits; got {len(cleaned)} characters") from None
    if len(key) < KEY_BYTES:
        raise ValueError(f"a pulse key must be at least {KEY_BYTES} bytes ({2 * KEY_BYTES} hex digits); got {len(key)}")
    return key
