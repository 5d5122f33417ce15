"""Rank order of a rendezvous round: by each node's stable node index, not by the order nodes arrived in.

Stock c10d ranks the participants of a round by sorting their descriptors (host, pid of the torchrun agent,
a counter). After a node loss that puts a replacement anywhere in the order and shifts the survivors: before the
loss worker-0, -1, -2 held ranks 0, 1, 2; after it worker-1 held rank 0, worker-2 rank 1 and the replacement
rank 2. The operator gives every worker pod a node index (``DISTTRAIN_NODE_INDEX``) and a replacement the index
of the node it replaces, so ordering by index keeps every survivor's ranks and hands the lost node's ranks to
its replacement. Indices may have gaps (after a scale-down): ranks are the order of the indices present.

Protocol, inside one rendezvous store: when a node joins a round it publishes its index under
:func:`index_key` *before* it adds itself to the participants, so the node that completes the round finds the
index of every participant. Nodes without an index (plain torchrun, no operator) keep c10d's order, after
every indexed node; two nodes with one index (a pod that is not dead after all, and its replacement) are
ordered by c10d's order too. The result is a permutation of the participants in every case.

Used by :mod:`disttrain.trainer.launch.rendezvous`; imports torch only for the store type.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Optional, TypeVar

from torch.distributed import Store

from disttrain.api import env
from disttrain.trainer.store import batchread

Node = TypeVar("Node")


def node_index_from_env(environ: Mapping[str, str]) -> Optional[int]:
    """This node's index from ``DISTTRAIN_NODE_INDEX``; None when unset or not a non-negative integer."""
    raw = environ.get(env.NODE_INDEX, "").strip()
    return int(raw) if raw.isdigit() else None


def index_key(run_id: str, node: object) -> str:
    """Store key of a participant's index: under the rendezvous' own prefix, per node descriptor."""
    return f"torch.rendezvous.{run_id}/disttrain.node-index/{node!r}"


def publish_index(store: Store, run_id: str, node: object, index: Optional[int]) -> None:
    if index is not None:
        store.set(index_key(run_id, node), str(index))


def read_indices(store: Store, run_id: str, nodes: Collection[Node]) -> dict[Node, Optional[int]]:
    """Each node's published index, None for a node that published none (batched: :mod:`batchread`)."""
    ordered = list(nodes)
    values = batchread.read_each(store, [index_key(run_id, node) for node in ordered])
    found: dict[Node, Optional[int]] = {}
    for node, value in zip(ordered, values, strict=True):
        raw = value.decode(errors="replace") if value is not None else ""
        found[node] = int(raw) if raw.isdigit() else None
    return found


def rank_order(nodes: Collection[Node], indices: Mapping[Node, Optional[int]]) -> Sequence[Node]:
    """``nodes`` in rank order: by index; nodes without one after the rest; ties in the nodes' own (c10d) order."""

    def key(node: Node) -> tuple[bool, int, Node]:
        index = indices.get(node)
        return index is None, index if index is not None else 0, node

    return sorted(nodes, key=key)  # node descriptors are ordered dataclasses
