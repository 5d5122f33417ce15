"""kopf logs every successful event handler at INFO: the operator keeps its log for what matters."""

from __future__ import annotations

import logging

import kopf
import pytest

from disttrain.operator.handlers import WATCH_SINKS, OperatorHandlers, configure, register
from disttrain.operator.metrics import OperatorMetrics


def test_a_watch_sinks_success_is_not_logged_and_its_failure_and_other_handlers_are(
    caplog: pytest.LogCaptureFixture,
) -> None:
    configure(kopf.OperatorSettings())
    configure(kopf.OperatorSettings())  # once per operator start: the filter is not stacked
    objects = logging.getLogger("kopf.objects")
    assert len(objects.filters) == 1
    with caplog.at_level(logging.INFO, logger="kopf.objects"):
        for sink in ("job_changed", "pod_changed", "node_changed"):
            objects.info(f"Handler 'register.<locals>.{sink}' succeeded.")  # kopf's own words (execution.py)
        objects.error("Handler 'register.<locals>.pod_changed' failed temporarily: boom")
        objects.info("Handler 'register.<locals>.job_loop' succeeded.")
        objects.info("Daemon 'register.<locals>.job_loop' has exited on its own. Stopping it.")
    assert [r.getMessage() for r in caplog.records] == [
        "Handler 'register.<locals>.pod_changed' failed temporarily: boom",
        "Handler 'register.<locals>.job_loop' succeeded.",
        "Daemon 'register.<locals>.job_loop' has exited on its own. Stopping it.",
    ]


def test_the_quieted_names_are_the_handlers_that_feed_the_caches() -> None:
    """A renamed handler would make the filter match nothing: the names must be registered event handlers."""
    from prometheus_client import CollectorRegistry

    registry = kopf.OperatorRegistry()
    register(registry, OperatorHandlers(lambda: None, OperatorMetrics(CollectorRegistry())))  # type: ignore[arg-type, return-value]
    handler_ids = {str(h.id) for h in registry._watching.get_all_handlers()}
    for sink in WATCH_SINKS:
        assert any(i.endswith(f".{sink}") for i in handler_ids), (sink, handler_ids)
