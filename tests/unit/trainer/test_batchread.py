"""Batched reads of many keys against a real TCPStore: every value in order, None for an absent key, and few round
trips when a key is absent (``multi_get`` would wait for it, ``check`` only says whether all are there)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from disttrain.trainer.store import batchread

pytestmark = [pytest.mark.unit]


class Counting:
    """A real store, counting the requests sent to it."""

    def __init__(self, store: TCPStore) -> None:
        self.store = store
        self.requests = 0

    def __getattr__(self, name: str):
        method = getattr(self.store, name)

        def call(*args, **kwargs):
            self.requests += 1
            return method(*args, **kwargs)

        return call


@pytest.fixture
def store() -> Counting:
    # port 0: the kernel's, no race with another process for a port found free
    return Counting(TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10)))


def test_all_present_is_one_check_and_one_read_per_chunk(store) -> None:
    keys = [f"k{i}" for i in range(600)]
    store.store.multi_set(keys, [f"v{i}" for i in range(600)])
    assert batchread.read_each(store, keys) == [f"v{i}".encode() for i in range(600)]
    assert store.requests == 4  # two chunks of at most 512


def test_one_absent_key_among_256_costs_few_round_trips(store) -> None:
    keys = [f"k{i}" for i in range(256)]
    store.store.multi_set([k for k in keys if k != "k100"], [f"v{i}" for i in range(256) if i != 100])
    values = batchread.read_each(store, keys)
    assert values[100] is None and values[:100] == [f"v{i}".encode() for i in range(100)]
    assert values[101:] == [f"v{i}".encode() for i in range(101, 256)]
    assert store.requests <= 32, store.requests  # key by key: 511


def test_every_key_absent_is_bounded(store) -> None:
    keys = [f"k{i}" for i in range(256)]
    assert batchread.read_each(store, keys) == [None] * 256
    assert store.requests <= 256 + 64, store.requests


def test_a_single_key(store) -> None:
    assert batchread.read_each(store, ["a"]) == [None]
    store.store.set("a", "1")
    assert batchread.read_each(store, ["a"]) == [b"1"]
