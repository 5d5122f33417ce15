"""Fixtures shared by the trainer's unit tests."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from disttrain.common.ports import free_port


@pytest.fixture
def one_process_group():
    """A real one-rank gloo process group, for code that needs collectives without other processes."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
