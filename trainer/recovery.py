"""In-place recovery of a sharded model (FSDP2, HSDP, FSDP x TP) from the members' memory.

Every group of a job that reforms in place keeps its state in memory (:class:`~disttrain.trainer.replicas.keeper.
ReplicaKeeper`: two versions of each rank's own shards, and a copy of its partner's on another node). When the group
breaks, the survivors and any newcomers form the next group and :func:`resume_from_memory` rebuilds the whole state
from what they hold: each member reports its versions, the group takes the newest step whole across them
(:func:`~disttrain.trainer.replicas.catalogue.choose_step`) and ``dcp.load`` reshards it onto the new mesh through
the in-memory reader. No process restarts and nothing is read from the checkpoint volume. Only when no step is whole
(a rank and its partner were lost together) does the group load its newest complete checkpoint instead, and says
why.

Callers: :func:`disttrain.trainer.snapshots.resume` (at every start of a group) and the loop (:func:`keep_step`
after each counted step), with the group's state (:class:`~disttrain.trainer.groupstate.GroupState`) and the
trainer's :class:`Memory`.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any, Optional

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from disttrain.trainer import gate, groupsockets
from disttrain.trainer.groupstate import GroupState
from disttrain.trainer.inplace import is_group_failure
from disttrain.trainer.replicas import capture as capture_mod
from disttrain.trainer.replicas import wire
from disttrain.trainer.replicas.catalogue import Block, Catalogue, ItemSpec, Member, assign, choose_step, needs_copy
from disttrain.trainer.replicas.keeper import ReplicaKeeper, Version
from disttrain.trainer.replicas.reader import MemoryReader

log = logging.getLogger("disttrain.trainer")


@dataclasses.dataclass
class Memory:
    """A trainer's state in memory, across its groups (a sharded model reforming in place)."""

    keeper: Optional[ReplicaKeeper] = None
    """This group's state in memory, and the partner's copy; from the end of the group's first step, when the
    state's layout is settled (the optimizer's lazy state, the LR fields)."""
    held: Optional[ReplicaKeeper] = None
    """The keeper of the group before, whose versions the next recovery reads (until this group keeps its own)."""

    def leave(self) -> None:
        """The group ended: what its keeper holds stays for the next group's recovery."""
        if self.keeper is not None:
            self.keeper.detach()
            self.held, self.keeper = self.keeper, None


@dataclasses.dataclass(frozen=True)
class Rebuilt:
    """What a group's recovery from memory did."""

    step: Optional[int]
    """The step rebuilt from memory; None: nothing whole was held (``reason`` says why)."""
    reason: str = ""
    fetched_bytes: int = 0
    seconds: float = 0.0


def start_keeping(state: GroupState, step: int, contents: dict[str, Any]) -> ReplicaKeeper:
    """Describe this group's state (every rank's items, gathered once, after the group's first step) and keep its
    version of ``step``. Collective on ``state.replica_group``."""
    group, rank = state.replica_group, state.rank
    specs, values = capture_mod.capture(capture_mod.state_dict_of(contents))
    document = {
        "node": failure_domain(state),
        "items": [s.to_json() for s in specs],
        "group": uuid.uuid4().hex if rank == 0 else None,
    }
    docs = wire.all_gather_json(document, group, state.world_size)
    members = tuple(
        Member(rank, str(doc["node"]), tuple(ItemSpec.from_json(s) for s in doc["items"]))
        for rank, doc in enumerate(docs)
    )
    keeper = ReplicaKeeper(Catalogue(str(docs[0]["group"]), members), rank, group)
    keeper.own.append(Version(step, values))
    keeper.start_replication(step, values)
    if rank == 0:
        own = sum(capture_mod.nbytes(s) for s in specs if s.is_tensor)
        log.info(
            "keeping the state in memory: %.1f MB of own shards per version on rank 0, %.1f MB of its partner's "
            "(rank %s) per version; %d versions",
            own / 1e6,
            keeper.copy_bytes() / 1e6,
            keeper.source,
            2,
        )
    return keeper


STEADY = ("app",)
"""The contents whose tensors stay the same objects from step to step (model and optimizer state)."""


def keep_step(memory: Memory, state: GroupState, step: int, contents: Callable[[], dict[str, Any]]) -> None:
    """Keep ``step``, just counted, in memory and on the partner (a sharded model reforming in place: ``state`` has a
    replica group), and agree that every copy landed before the step is reported: a rank lost after this point
    leaves its shards of this step on its partner, so the group resumes at the newest step anyone reported. A copy
    that failed raises :class:`~disttrain.trainer.gate.StepAbortedError` (a group failure): the step is not
    reported, and the next group rebuilds the newest step whole in its members' memory (this one where every copy
    landed). ``contents``: what a checkpoint of the trainer holds
    (:meth:`disttrain.trainer.snapshots.Saved.contents`)."""
    if memory.keeper is not None:
        steady, rest = split_contents(contents())
        memory.keeper.capture(step, steady, rest)
    elif state.replica_group is not None:
        memory.keeper = start_keeping(state, step, contents())
        if memory.held is not None:
            memory.held.release()
            memory.held = None
    else:
        return
    gate.agree(_replicated(memory.keeper, step), step, state.rank, what="in-memory copies")


def _replicated(keeper: ReplicaKeeper, step: int) -> bool:
    """Whether this rank's copy of the last step reached its partner and its source's reached it."""
    try:
        keeper.wait_replicated()
    except Exception as exc:
        if not is_group_failure(exc):
            raise
        log.warning("the in-memory copy of step %d failed: %s", step, str(exc).splitlines()[0][:200])
        return False
    return True


def split_contents(contents: dict[str, Any]) -> tuple[Callable[[], dict[str, Any]], dict[str, Any]]:
    """``contents`` as the state dict of its steady part (model and optimizer; a call, made only when the keeper
    needs it) and the state dict of the rest."""
    steady = {k: v for k, v in contents.items() if k in STEADY}
    rest = {k: v for k, v in contents.items() if k not in STEADY}
    return (lambda: capture_mod.state_dict_of(steady)), capture_mod.state_dict_of(rest)


def failure_domain(state: GroupState) -> str:
    """What dies together with this rank: its worker pod (the node name) and its torchrun agent (the group rank), so
    a partner is never in the same one."""
    return f"{state.context.node_name}#{state.context.group_rank}"


def _summary(keeper: Optional[ReplicaKeeper]) -> dict[str, Any]:
    if keeper is None:
        return {"group": None, "blocks": []}
    own = [[keeper.rank, v.step, "own"] for v in keeper.own if v.complete]
    copies = [[keeper.source, v.step, "copy"] for v in keeper.copies if v.complete and keeper.source is not None]
    return {"group": keeper.catalogue.group_id, "blocks": own + copies}


def resume_from_memory(
    state: GroupState, keeper: Optional[ReplicaKeeper], contents: dict[str, Any], floor: Optional[int]
) -> Rebuilt:
    """Rebuild ``contents`` from the members' memory (``keeper``: this process's, of the group before) at the newest
    step whole across them, if it is at least ``floor`` (the newest complete checkpoint). Collective on
    ``state.replica_group``."""
    t0 = time.monotonic()
    group, rank, world_size = state.replica_group, state.rank, state.world_size
    summaries = wire.all_gather_json(_summary(keeper), group, world_size)
    newest: dict[str, int] = {}
    for doc in summaries:
        for _, step, _ in doc["blocks"]:
            if doc["group"] is not None:
                newest[doc["group"]] = max(newest.get(doc["group"], -1), int(step))
    if not newest:
        return Rebuilt(None, "no member holds state in memory")
    old_group = max(newest, key=lambda g: newest[g])
    teller = next(r for r, doc in enumerate(summaries) if doc["group"] == old_group)
    sent = keeper.catalogue.to_json() if rank == teller and keeper is not None else None
    catalogue = Catalogue.from_json(wire.all_gather_json(sent, group, world_size)[teller])
    copies = needs_copy(catalogue)
    own_keys = {m.rank: frozenset(s.key for s in m.items) for m in catalogue.members}
    blocks = [
        Block(holder, int(owner), int(step), own_keys[int(owner)] if kind == "own" else frozenset(copies[int(owner)]))
        for holder, doc in enumerate(summaries)
        if doc["group"] == old_group
        for owner, step, kind in doc["blocks"]
    ]
    step = choose_step(catalogue, blocks)
    if step is None:
        held = {b.owner for b in blocks}
        lost = [f"rank {m.rank} ({m.node})" for m in catalogue.members if m.rank not in held]
        return Rebuilt(
            None,
            "no step is whole in the members' memory: a rank and its partner were lost together"
            + (f" (nobody holds the shards of {', '.join(lost)})" if lost else ""),
        )
    if floor is not None and step < floor:
        return Rebuilt(None, f"the checkpoint (step {floor}) is newer than the state in memory (step {step})")
    local = keeper.values_at(step) if keeper is not None and keeper.catalogue.group_id == old_group else {}
    reader = MemoryReader(catalogue, local, assign(blocks, step, catalogue), rank, world_size, group)
    dcp.load(contents, storage_reader=reader, no_dist=True)
    return Rebuilt(step, fetched_bytes=reader.bytes_fetched, seconds=time.monotonic() - t0)


def new_replica_group(timeout_seconds: float) -> Optional[dist.ProcessGroup]:
    """The gloo group this group's replication and recovery exchanges run on (a background thread uses it, so it is
    nobody else's). Collective."""
    timeout = datetime.timedelta(seconds=timeout_seconds)
    with groupsockets.capture():
        group: Optional[dist.ProcessGroup] = dist.new_group(backend="gloo", timeout=timeout)
    return group
