"""RFC 3339 times as disttrain writes and reads them: one home for the operator, the job agent and the tests.

Status fields carry milliseconds, not Kubernetes' usual whole seconds, because the reform protocol compares a
directive's issue time with the time of the first progress report after it, and a reform can finish within a
second. core/v1 Event timestamps (``metav1.Time``) are whole seconds.
"""

from __future__ import annotations

import datetime
import time
from typing import Annotated, Any, Optional

from pydantic import BeforeValidator, PlainSerializer, WithJsonSchema


def format_time(unix: float) -> str:
    """RFC 3339 UTC with millisecond precision (``2024-05-01T12:00:00.250Z``)."""
    moment = datetime.datetime.fromtimestamp(round(unix, 3), tz=datetime.timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def format_time_seconds(unix: float) -> str:
    """RFC 3339 UTC in whole seconds (``2024-05-01T12:00:00Z``), as Kubernetes writes ``metav1.Time``."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(unix))


def parse_time(value: Optional[str]) -> Optional[float]:
    """Unix time of an RFC 3339 string (``Z`` or an offset, fractional seconds allowed); None stays None."""
    if not value:
        return None
    parsed = datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=datetime.timezone.utc)
    return parsed.timestamp()


def _from_wire(value: Any) -> Any:
    """An RFC 3339 string (the status as stored) becomes Unix time; a number stays, anything else is refused by the
    type's own check."""
    if isinstance(value, str):
        return parse_time(value)
    return value


Timestamp = Annotated[
    float,
    BeforeValidator(_from_wire),
    PlainSerializer(format_time, return_type=str),
    WithJsonSchema({"type": "string"}),
]
"""A status time: Unix seconds in memory (what the operator's clock gives, so policies compare and add without
conversions), an RFC 3339 string with milliseconds in the status as stored and in every dump of a model."""
