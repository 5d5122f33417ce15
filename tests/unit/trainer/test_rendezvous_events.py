"""torch's rendezvous events: built only when they are recorded, recorded as stock when they are.

torch names each event with ``inspect.stack()`` before it looks whether anything records it; on a loaded machine that
cost held every state write about half a second between its read and its compare-and-set, long enough for the other
nodes' keep-alives to win every race (a round re-completed for tens of seconds)."""

from __future__ import annotations

import inspect
import logging

import pytest
from torch.distributed import TCPStore
from torch.distributed.elastic import events
from torch.distributed.elastic.events import handlers as event_handlers
from torch.distributed.elastic.rendezvous import RendezvousParameters

from disttrain.api import env
from disttrain.common.ports import free_port
from disttrain.trainer.launch import rendezvous

pytestmark = pytest.mark.timeout(60)


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def one_node_round(monkeypatch: pytest.MonkeyPatch):
    """Runs a one-node rendezvous through the disttrain handler on a real store; counts ``inspect.stack`` calls."""
    monkeypatch.setenv(env.STORE_SECRET, "events-test-" + "5" * 48)
    monkeypatch.setenv(env.JOB_UID, "events-job")
    monkeypatch.setenv(env.NODE_NAME, "events-worker-0")
    port = free_port()
    server = TCPStore("127.0.0.1", port, is_master=True, multi_tenant=True, wait_for_workers=False)
    stacks = []
    real_stack = inspect.stack

    def counting_stack(*args, **kwargs):
        stacks.append(1)
        return real_stack(*args, **kwargs)

    monkeypatch.setattr(inspect, "stack", counting_stack)

    def run() -> int:
        params = RendezvousParameters(
            "disttrain", f"127.0.0.1:{port}", "events", 1, 1, is_host="false", read_timeout=10, join_timeout=20
        )
        handler = rendezvous.create_handler(params)
        try:
            info = handler.next_rendezvous()
            assert (info.rank, info.world_size) == (0, 1)
        finally:
            handler.beat.stop()
        return len(stacks)

    yield run
    del server


def test_no_event_is_built_when_torch_records_none(one_node_round):
    assert not rendezvous.events_recorded()  # torch's default: rendezvous events go to a NullHandler
    assert one_node_round() == 0


def test_events_are_recorded_as_stock_when_a_handler_is_configured(one_node_round, monkeypatch):
    collect = _Collect()
    monkeypatch.setitem(event_handlers._log_handlers, "dynamic_rendezvous", collect)
    monkeypatch.setattr(events, "_events_loggers", {})  # torch caches the logger with the handler it first saw
    assert rendezvous.events_recorded()
    assert one_node_round() > 0
    assert any("marked round 0" in message for message in collect.messages), collect.messages
