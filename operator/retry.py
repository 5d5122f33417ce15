"""How long a job's loop waits after a failed API call: exponential backoff with jitter, ``Retry-After`` honoured.

Why not a fixed delay: a fixed 1 s retry from every job at once is what keeps an overloaded API server
overloaded (at 500 jobs, 500 requests a second into a server that answered 429 or 503). Doubling spreads the
load out, the jitter keeps jobs that failed together from retrying together, and the cap bounds how late a job
notices that the API server is back. A server that says when to come back (``Retry-After`` on 429 and 503, and
on any 5xx that carries it) is believed, within :data:`RETRY_AFTER_CAP_S`.
"""

from __future__ import annotations

import email.utils
import random
from collections.abc import Callable, Mapping
from typing import Optional

BASE_S = 0.5
"""The first retry's delay before jitter."""
CAP_S = 30.0
"""No backoff delay grows beyond this: a job notices a recovered API server within 30 s."""
RETRY_AFTER_CAP_S = 300.0
"""A ``Retry-After`` longer than this is read as this (a misconfigured proxy must not park a job for hours)."""
RETRY_AFTER_STATUSES = frozenset({429, 500, 502, 503, 504})
"""Answers whose ``Retry-After`` is honoured (throttling and server errors)."""


def backoff_delay(failures: int, rand: Callable[[], float] = random.random) -> float:
    """The delay after the ``failures``-th consecutive failure (1 for the first): ``BASE_S * 2**(failures-1)``
    capped at :data:`CAP_S`, then "equal jitter": uniformly in [half of it, all of it].

    Why equal jitter, not full jitter: a retry at 0 s is a retry without backoff; half the delay is the least."""
    if failures < 1:
        raise ValueError(f"failures: must be at least 1 (the count of consecutive failures), got {failures}")
    ceiling = min(CAP_S, BASE_S * 2.0 ** min(failures - 1, 32))
    return ceiling / 2.0 + rand() * ceiling / 2.0


def parse_retry_after(value: Optional[str], now: float) -> Optional[float]:
    """Seconds to wait from a ``Retry-After`` header at Unix time ``now``: delta-seconds (``"120"``) or an
    HTTP-date (``"Wed, 21 Oct 2026 07:28:00 GMT"``, RFC 9110 section 10.2.3); None when absent or unreadable.
    A date in the past is 0; any value is capped at :data:`RETRY_AFTER_CAP_S`."""
    if value is None:
        return None
    text = value.strip()
    if not text:
        return None
    if text.isdigit():
        seconds = float(int(text))
    else:
        try:
            when = email.utils.parsedate_to_datetime(text)
        except (TypeError, ValueError, IndexError):
            return None
        if when is None or when.tzinfo is None:
            return None  # RFC 9110 dates are GMT; a date without a zone is not one
        seconds = max(0.0, when.timestamp() - now)
    return min(seconds, RETRY_AFTER_CAP_S)


def header(headers: Optional[Mapping[str, str]], name: str) -> Optional[str]:
    """A header by case-insensitive name (the client hands over urllib3's headers or a plain dict)."""
    if not headers:
        return None
    wanted = name.lower()
    for key, value in headers.items():
        if key.lower() == wanted:
            return value
    return None


def retry_delay(
    failures: int,
    status: Optional[int],
    headers: Optional[Mapping[str, str]],
    now: float,
    rand: Callable[[], float] = random.random,
) -> float:
    """The wait after the ``failures``-th consecutive failure whose answer had HTTP ``status`` (None: no answer,
    or not an HTTP error): the backoff, or the server's ``Retry-After`` when that is longer (429 and 5xx)."""
    delay = backoff_delay(failures, rand)
    if status in RETRY_AFTER_STATUSES:
        asked = parse_retry_after(header(headers, "Retry-After"), now)
        if asked is not None:
            delay = max(delay, asked)
    return delay


class Backoff:
    """Consecutive failures of one job's loop; :meth:`failed` gives the next delay, :meth:`succeeded` resets."""

    def __init__(self, rand: Callable[[], float] = random.random) -> None:
        self.failures = 0
        self._rand = rand

    def failed(self, status: Optional[int], headers: Optional[Mapping[str, str]], now: float) -> float:
        self.failures += 1
        return retry_delay(self.failures, status, headers, now, self._rand)

    def succeeded(self) -> None:
        self.failures = 0
