"""The job loop's wait after a failed API call: doubling with equal jitter, capped, and the server's Retry-After
(delta-seconds or HTTP-date) believed on 429 and 5xx within its own cap."""

from __future__ import annotations

import email.utils

import pytest

from disttrain.operator import retry

pytestmark = pytest.mark.timeout(30)
NOW = 1_800_000_000.0


@pytest.mark.parametrize("failures", [1, 2, 3, 5, 7, 8, 20, 100])
def test_backoff_stays_between_half_and_all_of_the_capped_doubling(failures):
    ceiling = min(retry.CAP_S, retry.BASE_S * 2 ** (failures - 1))
    assert retry.backoff_delay(failures, rand=lambda: 0.0) == pytest.approx(ceiling / 2)
    assert retry.backoff_delay(failures, rand=lambda: 0.999999) == pytest.approx(ceiling, rel=1e-5)
    draws = [retry.backoff_delay(failures) for _ in range(200)]
    assert all(ceiling / 2 <= d <= ceiling for d in draws)
    assert len(set(draws)) > 100, "jitter: jobs that failed together do not retry together"


def test_backoff_doubles_then_caps():
    lows = [retry.backoff_delay(n, rand=lambda: 0.0) for n in range(1, 10)]
    assert lows[:4] == [0.25, 0.5, 1.0, 2.0]
    assert max(lows) == retry.CAP_S / 2 and retry.backoff_delay(10**6, rand=lambda: 1.0) == retry.CAP_S


def test_backoff_refuses_a_count_below_one():
    with pytest.raises(ValueError, match="failures: must be at least 1"):
        retry.backoff_delay(0)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("120", 120.0),
        (" 7 ", 7.0),
        ("0", 0.0),
        ("999999", retry.RETRY_AFTER_CAP_S),
        (email.utils.formatdate(NOW + 42, usegmt=True), 42.0),
        (email.utils.formatdate(NOW - 100, usegmt=True), 0.0),
        ("Sun, 06 Nov 1994 08:49:37 GMT", 0.0),
        (email.utils.formatdate(NOW + 86400, usegmt=True), retry.RETRY_AFTER_CAP_S),
        (None, None),
        ("", None),
        ("-5", None),
        ("1.5", None),
        ("soon", None),
        ("Sun, 06 Nov 1994 08:49:37", None),  # no zone: not an HTTP-date
    ],
)
def test_retry_after_is_read_as_seconds_or_an_http_date(value, expected):
    parsed = retry.parse_retry_after(value, NOW)
    assert parsed == (None if expected is None else pytest.approx(expected, abs=1.0))


def test_retry_after_is_honoured_on_throttling_and_server_errors_only():
    headers = {"retry-after": "20", "Content-Type": "application/json"}
    assert retry.retry_delay(1, 429, headers, NOW, rand=lambda: 0.0) == 20.0
    assert retry.retry_delay(1, 503, headers, NOW, rand=lambda: 0.0) == 20.0
    assert retry.retry_delay(1, 409, headers, NOW, rand=lambda: 0.0) == 0.25, "not a server's request to wait"
    assert retry.retry_delay(1, 429, {"Retry-After": "0"}, NOW, rand=lambda: 0.0) == 0.25, "never below backoff"
    assert retry.retry_delay(9, 429, {"Retry-After": "1"}, NOW, rand=lambda: 0.0) == retry.CAP_S / 2
    assert retry.retry_delay(1, None, None, NOW, rand=lambda: 0.0) == 0.25


def test_a_success_resets_the_backoff():
    backoff = retry.Backoff(rand=lambda: 0.0)
    assert [backoff.failed(500, None, NOW) for _ in range(3)] == [0.25, 0.5, 1.0]
    backoff.succeeded()
    assert backoff.failed(None, None, NOW) == 0.25
