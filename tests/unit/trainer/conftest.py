"""Fixtures and helpers shared by the trainer's unit tests."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import pytest
import torch.distributed as dist

from disttrain.common.ports import free_port
from disttrain.trainer.checkpoint import commit


def plan_retention(
    root: Path, keep: int, own_round: int = 0, in_flight: Iterable[str] = (), protected: Iterable[int] = ()
) -> list[str]:
    """Both of the committer's retention plans at once, every checkpoint fully validated: the steps to delete
    (:func:`~disttrain.trainer.checkpoint.commit.plan_step_deletions`), then the temporary directories."""
    valid = lambda path: commit.validate(path).ok  # noqa: E731
    return commit.plan_step_deletions(root, keep, valid, protected, own_round or None) + commit.plan_temp_cleanup(
        root, own_round, in_flight
    )


@pytest.fixture
def one_process_group():
    """A real one-rank gloo process group, for code that needs collectives without other processes."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
