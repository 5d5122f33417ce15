"""Where in-place reform does not apply although the job asks for it, the worker says why at start."""

from __future__ import annotations

import logging
from typing import Optional

import pytest

from disttrain.trainer import inplace


@pytest.mark.parametrize(
    ("requested", "parallelism", "prewrapped", "has_launcher", "expected"),
    [
        (False, "fsdp2", False, False, None),
        (True, "ddp", False, True, None),
        (True, "fsdp2", False, True, None),
        (True, "ddp", True, True, "already a DistributedDataParallel"),
        (True, "ddp", False, False, "no channel to the disttrain launcher"),
    ],
    ids=["not-asked-for", "applies", "fsdp2", "prewrapped-ddp", "no-launcher"],
)
def test_the_fallback_reason_names_what_keeps_the_restart(
    requested: bool, parallelism: str, prewrapped: bool, has_launcher: bool, expected: Optional[str]
):
    reason = inplace.fallback_reason(requested, parallelism, prewrapped, has_launcher)
    if expected is None:
        assert reason is None
    else:
        assert reason is not None and expected in reason


def test_a_fallback_is_logged_with_its_reason(caplog: pytest.LogCaptureFixture):
    with caplog.at_level(logging.WARNING, logger="disttrain.trainer"):
        inplace.log_fallback(inplace.fallback_reason(True, "ddp", True, True))
        inplace.log_fallback(None)
    assert len(caplog.records) == 1
    assert "reformInPlace is set, but reforms restart" in caplog.records[0].getMessage()
    assert "DistributedDataParallel" in caplog.records[0].getMessage()
