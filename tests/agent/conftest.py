"""Fixtures of the job agent's tests."""

from __future__ import annotations

import datetime

import pytest
from torch.distributed import TCPStore

from disttrain.common.ports import free_port
from disttrain.trainer.agent import service as agent_mod


@pytest.fixture
def store_pair():
    """(the agent's store server, a plain TCPStore client of it) on a free port."""
    port = free_port()
    server = agent_mod.start_store(port, "127.0.0.1", timeout_s=5)
    client = TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=5))
    return server, client
