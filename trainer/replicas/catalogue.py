"""What a group's training state is made of, item by item, and which step a new group can rebuild from memory.

An *item* is one entry of DCP's save plan: a chunk of a tensor (its fully qualified name in the flattened state
dict and the chunk's offsets) or a non-tensor value. Every rank of a group describes its own items once, at the
group's start (:class:`ItemSpec`); the union over the ranks is the group's :class:`Catalogue`, from which DCP's
``Metadata`` is built for the in-memory reader. Items with the same key on several ranks are replicas (DDP's whole
state, HSDP's replicate dimension, FSDP's unsharded scalars): any holder may serve them.

Pure: no torch process group, no I/O. Called by :mod:`disttrain.trainer.replicas.keeper` and
:mod:`disttrain.trainer.recovery`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Optional

ItemKey = tuple[str, tuple[int, ...]]
"""(fqn in the flattened state dict, chunk offsets); a non-tensor value has no offsets."""


@dataclasses.dataclass(frozen=True)
class ItemSpec:
    """One item of a rank's state: enough to rebuild DCP's metadata and to size a transfer."""

    fqn: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    """The chunk's shape (empty for a scalar tensor and for a non-tensor value)."""
    global_size: tuple[int, ...]
    dtype: str
    """``torch.float32`` as ``str(dtype)`` minus the ``torch.`` prefix; ``bytes`` for a non-tensor value."""

    @property
    def key(self) -> ItemKey:
        return (self.fqn, self.offsets)

    @property
    def is_tensor(self) -> bool:
        return self.dtype != "bytes"

    def to_json(self) -> list[Any]:
        return [self.fqn, list(self.offsets), list(self.sizes), list(self.global_size), self.dtype]

    @classmethod
    def from_json(cls, raw: Sequence[Any]) -> ItemSpec:
        fqn, offsets, sizes, global_size, dtype = raw
        return cls(
            str(fqn),
            tuple(int(x) for x in offsets),
            tuple(int(x) for x in sizes),
            tuple(int(x) for x in global_size),
            str(dtype),
        )


@dataclasses.dataclass(frozen=True)
class Member:
    """One rank of a group as the catalogue sees it: its node and its items."""

    rank: int
    node: str
    items: tuple[ItemSpec, ...]


@dataclasses.dataclass(frozen=True)
class Catalogue:
    """Every rank's items in one group (identical on every rank of that group)."""

    group_id: str
    members: tuple[Member, ...]

    @property
    def world_size(self) -> int:
        return len(self.members)

    def specs(self) -> dict[ItemKey, ItemSpec]:
        """Each distinct item once."""
        out: dict[ItemKey, ItemSpec] = {}
        for member in self.members:
            for spec in member.items:
                out.setdefault(spec.key, spec)
        return out

    def nodes_holding(self) -> dict[ItemKey, set[str]]:
        """The nodes whose ranks hold each item in their own state."""
        held: dict[ItemKey, set[str]] = {}
        for member in self.members:
            for spec in member.items:
                held.setdefault(spec.key, set()).add(member.node)
        return held

    def to_json(self) -> dict[str, Any]:
        return {
            "group": self.group_id,
            "members": [[m.rank, m.node, [s.to_json() for s in m.items]] for m in self.members],
        }

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Catalogue:
        members = tuple(
            Member(int(rank), str(node), tuple(ItemSpec.from_json(s) for s in items))
            for rank, node, items in raw["members"]
        )
        return cls(str(raw["group"]), members)


def partner_of(rank: int, nodes: Sequence[str]) -> Optional[int]:
    """The rank that keeps a copy of ``rank``'s items: the next rank (in rank order, wrapping) on another node with
    the same position within its node, so that copies form one ring over the nodes; None on a single node."""
    world = len(nodes)
    mine = nodes[rank]
    position = [r for r in range(world) if nodes[r] == mine].index(rank)
    for step in range(1, world):
        other = (rank + step) % world
        if nodes[other] == mine:
            continue
        peers = [r for r in range(world) if nodes[r] == nodes[other]]
        return peers[position % len(peers)]
    return None


def needs_copy(catalogue: Catalogue) -> dict[int, list[ItemKey]]:
    """Per rank, the tensor items of its own it must copy to its partner: those no other node holds already (HSDP's
    replicas and DDP's whole state need no copy; non-tensor values are the same on every rank)."""
    holders = catalogue.nodes_holding()
    return {m.rank: [s.key for s in m.items if s.is_tensor and len(holders[s.key]) < 2] for m in catalogue.members}


@dataclasses.dataclass(frozen=True)
class Block:
    """Items of one rank of the old group at one step, held by one member of the new group."""

    holder: int
    """The new group's rank that holds it."""
    owner: int
    """The old group's rank whose items these are."""
    step: int
    keys: frozenset[ItemKey]


def choose_step(catalogue: Catalogue, blocks: Iterable[Block]) -> Optional[int]:
    """The newest step at which the blocks held cover every item of the old group; None when no step is whole (a
    rank and its partner were lost together): the new group falls back to the newest complete checkpoint."""
    needed = set(catalogue.specs())
    by_step: dict[int, set[ItemKey]] = {}
    for block in blocks:
        by_step.setdefault(block.step, set()).update(block.keys)
    for step in sorted(by_step, reverse=True):
        if needed <= by_step[step]:
            return step
    return None


def assign(blocks: Iterable[Block], step: int, catalogue: Catalogue) -> dict[ItemKey, int]:
    """Which new rank serves each item at ``step``: the lowest-ranked holder (so the choice is the same on every
    rank). Each reader takes an item it holds itself without asking (:mod:`disttrain.trainer.replicas.reader`)."""
    chosen: dict[ItemKey, int] = {}
    for block in sorted((b for b in blocks if b.step == step), key=lambda b: b.holder):
        for key in block.keys:
            chosen.setdefault(key, block.holder)
    missing = set(catalogue.specs()) - set(chosen)
    if missing:
        raise ValueError(f"no member holds {len(missing)} items at step {step}, e.g. {sorted(missing)[:3]}")
    return chosen
