"""Rank order by stable node index: survivors keep their ranks, a replacement takes the lost node's, gaps are
closed, nodes without an index keep c10d's order; indices travel through a real TCPStore."""

from __future__ import annotations

import dataclasses
from datetime import timedelta

import pytest
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from disttrain.api import env
from disttrain.trainer.launch import rank_order


@dataclasses.dataclass(eq=True, order=True, frozen=True)
class Node:
    """Shaped like torch's ``_NodeDesc``: c10d's own order is (addr, pid, local_id)."""

    addr: str
    pid: int
    local_id: int = 0

    def __repr__(self) -> str:
        return f"{self.addr}_{self.pid}_{self.local_id}"


def ranks_by_index(nodes: dict[Node, int | None]) -> list[int | None]:
    """The node index of rank 0, 1, ..."""
    return [nodes[n] for n in rank_order.rank_order(list(nodes), nodes)]


def test_a_replacement_takes_the_lost_nodes_ranks_though_c10d_would_put_it_last():
    # worker-0 (index 0) died; its replacement is a new agent with the highest pid.
    survivors = {Node("h", 101): 1, Node("h", 102): 2}
    replacement = {Node("h", 900): 0}
    assert ranks_by_index({**survivors, **replacement}) == [0, 1, 2]
    assert sorted({**survivors, **replacement})[0] == Node("h", 101), "c10d alone would make worker-1 rank 0"


@pytest.mark.parametrize(
    "indices, expected",
    [
        ([0, 1, 2], [0, 1, 2]),
        ([2, 0, 1], [0, 1, 2]),
        ([0, 2, 5], [0, 2, 5]),
        ([3, 1], [1, 3]),
        ([1, None, 0], [0, 1, None]),
        ([None, None], [None, None]),
    ],
    ids=["dense", "arrival-order-ignored", "gaps", "gap-at-zero", "unindexed-last", "no-index-is-c10d"],
)
def test_ranks_are_the_order_of_the_indices_present(indices, expected):
    nodes = {Node("h", 100 + i): index for i, index in enumerate(indices)}
    assert ranks_by_index(nodes) == expected


def test_nodes_without_an_index_and_ties_keep_c10d_order():
    a, b, c = Node("a", 3), Node("b", 1), Node("c", 2)
    assert rank_order.rank_order([c, b, a], {a: None, b: None, c: None}) == [a, b, c]
    assert rank_order.rank_order([c, b, a], {a: 1, b: 1, c: 0}) == [c, a, b]


@given(st.lists(st.one_of(st.none(), st.integers(0, 8)), min_size=1, max_size=8))
def test_the_order_is_always_a_permutation_of_the_participants(indices):
    nodes = {Node("h", i): index for i, index in enumerate(indices)}
    ordered = rank_order.rank_order(list(nodes), nodes)
    assert sorted(ordered) == sorted(nodes)
    known = [nodes[n] for n in ordered if nodes[n] is not None]
    assert known == sorted(known)


@pytest.mark.parametrize("raw, expected", [("3", 3), (" 0 ", 0), ("", None), ("-1", None), ("x", None)])
def test_the_node_index_comes_from_the_environment(raw, expected):
    assert rank_order.node_index_from_env({env.NODE_INDEX: raw}) == expected
    assert rank_order.node_index_from_env({}) is None


def test_indices_travel_through_the_rendezvous_store_per_run():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    a, b, c = Node("h", 1), Node("h", 2), Node("h", 3)
    rank_order.publish_index(store, "run", a, 4)
    rank_order.publish_index(store, "run", b, None)  # no index: nothing published
    rank_order.publish_index(store, "other-run", c, 0)
    assert rank_order.read_indices(store, "run", [a, b, c]) == {a: 4, b: None, c: None}
