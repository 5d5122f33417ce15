"""Per-node joins of a large rendezvous round: each node writes a record of its own, one party closes the round.

Why: torch's c10d rendezvous keeps the round in one shared state, and a node joins by a compare-and-set of all of
it (the whole participants dict, re-read and re-written by each node). N nodes write N states of size N one at a
time, and every write that lands makes every other pending one lose: 128 simulated nodes needed 853 writes (725
lost), 256 formed no round (``bench/scale_sim.py``). Here a node that finds the round open takes a slot in one of
:data:`BUCKETS` counters (a compare-and-set of a few bytes, contended by one node in :data:`BUCKETS` only), writes a
:class:`JoinRecord` under that slot (a blind ``set`` of a key of its own) and waits. Now and then (about
:data:`CLOSE_TRIES_PER_S` tries a second across the waiting nodes, each at a random moment, so a node that dies takes
no duty with it) a waiting node reads the counters and the records of the round; when the live ones reach the
round's target, it writes the complete round into torch's state in one compare-and-set, in torch's format
(participants, heartbeats, ranks), and marks the round closed under :func:`closed_key`, a key of a few bytes that
the waiting nodes poll instead of the whole state.

Keys are reused from round to round (a counter and a record name their round), so a long job does not pile them up
in the store.

Used by :class:`disttrain.trainer.launch.rendezvous._TargetAwareOpExecutor` while the job agent publishes a target
plan of more than :data:`PER_NODE_JOINS_ABOVE` nodes (rdzv-conf ``per_node_joins_above``); smaller rounds join as
torch does (there one write per node is quicker than reading the counters and records). Pure but for the
functions that take a store.
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
import zlib
from collections.abc import Callable, Collection, Hashable, Mapping, Sequence
from typing import Any, Optional, TypeVar

from disttrain.trainer.store import batchread

PER_NODE_JOINS_ABOVE = 32
"""Rounds whose target is above this many nodes join by records; smaller ones by torch's compare-and-set."""
CLOSE_TRIES_PER_S = 5.0
"""How many times a second, summed over a round's waiting nodes, one of them reads the records to close the round."""
CLOSE_TRY_MIN_S = 0.2
"""The shortest pause between two tries of one node (a small round)."""
BUCKETS = 32
"""Join counters: the nodes of a round take their slots from this many, so one node in as many contends."""
TAKE_ATTEMPTS = 64
TAKE_BACKOFF_S = 0.005
"""The first pause of a node whose take of a slot lost the race; it doubles with each loss in a row, up to
:data:`TAKE_BACKOFF_MAX_S`."""
TAKE_BACKOFF_MAX_S = 0.5

Node = TypeVar("Node", bound=Hashable)


@dataclasses.dataclass(frozen=True)
class JoinRecord:
    """A node's wish to join ``round``: its torch node descriptor's fields, its pod name and node index."""

    round: int
    addr: str
    pid: int
    local_id: int
    name: str = ""
    """DISTTRAIN_NODE_NAME ("" without the operator): checked against the target plan's ``exclude`` and ``lost``."""
    index: Optional[int] = None
    """DISTTRAIN_NODE_INDEX, for the ranks (:mod:`disttrain.trainer.launch.rank_order`)."""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, raw: bytes) -> Optional[JoinRecord]:
        """The record, or None for anything that is not one."""
        try:
            value = json.loads(raw)
            record = cls(**value)
        except (ValueError, TypeError):
            return None
        ints = (record.round, record.pid, record.local_id)
        if not all(type(number) is int for number in ints) or not isinstance(record.addr, str):
            return None
        if not isinstance(record.name, str) or not (record.index is None or type(record.index) is int):
            return None
        return record

    @property
    def node_name(self) -> str:
        """``repr`` of the node's descriptor (``addr_pid_localid``): the name of its beat and identity keys."""
        return f"{self.addr}_{self.pid}_{self.local_id}"


def bucket_of(record: JoinRecord) -> int:
    """The counter a node takes its slot from: by node index (consecutive indices spread evenly), else by name."""
    if record.index is not None:
        return record.index % BUCKETS
    return zlib.crc32(record.node_name.encode()) % BUCKETS


def count_key(run_id: str, bucket: int) -> str:
    return f"torch.rendezvous.{run_id}/disttrain.join-count/{bucket}"


def slot_key(run_id: str, bucket: int, slot: int) -> str:
    """Store key of the join record in ``slot`` (1, 2, ...) of ``bucket``."""
    return f"torch.rendezvous.{run_id}/disttrain.join/{bucket}/{slot}"


def closed_key(run_id: str, round_: int) -> str:
    """Store key set once round ``round_`` was written complete into the state."""
    return f"torch.rendezvous.{run_id}/disttrain.join-closed/{round_}"


def counter_value(round_: int, taken: int, taker: str) -> str:
    """A bucket's counter: its round, the slots taken in it, and who took the last (so that a node can tell its own
    compare-and-set from another node's that wrote the same count)."""
    return f"{round_}:{taken}:{taker}"


def parse_counter(raw: Optional[bytes]) -> Optional[tuple[int, int]]:
    """(round, slots taken) of a counter's value; None for an absent or garbled one."""
    if raw is None:
        return None
    parts = raw.decode(errors="replace").split(":", 2)
    if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit():
        return None
    return int(parts[0]), int(parts[1])


def slots_taken(counter: Optional[tuple[int, int]], round_: int) -> int:
    """How many slots of a bucket whose counter holds ``counter`` were taken in ``round_`` (a counter of an earlier
    round counts none: the next node starts it over)."""
    if counter is None or counter[0] != round_:
        return 0
    return counter[1]


CLOSING_HOLD_S = 5.0
"""How long one waiting node's claim to close a round holds the others' tries off (:func:`claim_closing`)."""


def closing_key(run_id: str) -> str:
    return f"torch.rendezvous.{run_id}/disttrain.join-closing"


def _claim(raw: Optional[bytes]) -> Optional[tuple[int, str, float]]:
    try:
        round_, name, at = json.loads(raw) if raw else (None, None, None)
    except (ValueError, TypeError):
        return None
    if type(round_) is not int or not isinstance(name, str) or not isinstance(at, (int, float)):
        return None
    return round_, name, float(at)


def claim_closing(store: Any, run_id: str, round_: int, node: str, now: Optional[float] = None) -> bool:
    """Whether ``node`` may try to close ``round_`` now: none other claimed it in the last :data:`CLOSING_HOLD_S`,
    and this node's claim (a compare-and-set of a few bytes) landed.

    Why: a try reads every record and every beat of the round. With every waiting node trying at its own moment, a
    try of a 256-node round took seconds on a loaded machine, dozens ran at once, and the one that closed the round
    (or rank 0, which the others then wait for) waited its turn behind them. A claim whose node died expires."""
    key = closing_key(run_id)
    found = batchread.read_each(store, [key])[0]
    now = time.time() if now is None else now
    held = _claim(found)
    if held is not None and held[0] == round_ and held[1] != node and abs(now - held[2]) < CLOSING_HOLD_S:
        return False
    desired = json.dumps([round_, node, round(now, 3)])
    return bytes(store.compare_set(key, b"" if found is None else found, desired)) == desired.encode()


def release_closing(store: Any, run_id: str, node: str) -> None:
    """Give up ``node``'s claim (its try found the round not ready): the next node's try need not wait it out."""
    key = closing_key(run_id)
    found = batchread.read_each(store, [key])[0]
    if found is not None and (held := _claim(found)) is not None and held[1] == node:
        store.compare_set(key, found, "[]")


def close_try_period(wanted: int) -> float:
    """The pause between two tries of one waiting node to close a round of ``wanted`` nodes."""
    return max(CLOSE_TRY_MIN_S, wanted / CLOSE_TRIES_PER_S)


def choose(
    in_state: Sequence[Node],
    joined: Mapping[Node, JoinRecord],
    wanted: int,
    refused: Collection[str],
    alive: Callable[[Node], bool],
) -> Optional[list[Node]]:
    """The participants of a round closed on ``wanted`` nodes, or None while fewer can be had.

    ``in_state`` are the participants already in torch's state (nodes that joined as torch does), kept first;
    then the nodes that ``joined`` by a record, by node index (nodes without one after, ties in descriptor order),
    less those whose pod name is ``refused`` (the target plan's ``exclude`` and ``lost``) and those not ``alive``
    (their beat fell silent after they wrote their record). Nodes beyond ``wanted`` wait for the next round, as
    torch's late joiners do."""
    chosen = list(in_state)
    seen = set(chosen)

    def order(node: Node) -> tuple[bool, int, str]:
        index = joined[node].index
        return index is None, index if index is not None else 0, joined[node].node_name

    for node in sorted(joined, key=order):
        if len(chosen) >= wanted:
            break
        if node in seen or joined[node].name in refused or not alive(node):
            continue
        chosen.append(node)
        seen.add(node)
    return chosen if len(chosen) >= wanted else None


def take_slot(store: Any, run_id: str, bucket: int, record: JoinRecord) -> int:
    """A slot of ``bucket`` in ``record.round`` that no other node holds: a compare-and-set of the bucket's counter,
    after a short random pause when another node's landed first (one node in :data:`BUCKETS` contends)."""
    key = count_key(run_id, bucket)
    found: Optional[bytes] = None
    for attempt in range(TAKE_ATTEMPTS):
        slot = slots_taken(parse_counter(found), record.round) + 1
        desired = counter_value(record.round, slot, record.node_name)
        answer = bytes(store.compare_set(key, b"" if found is None else found, desired))
        if answer == desired.encode():
            return slot
        found = answer
        if attempt:
            time.sleep(random.random() * min(TAKE_BACKOFF_MAX_S, TAKE_BACKOFF_S * 2**attempt))
    raise RuntimeError(f"join counter {key!r} kept changing: no slot after {TAKE_ATTEMPTS} tries")


def write_record(store: Any, run_id: str, bucket: int, slot: int, record: JoinRecord) -> None:
    store.set(slot_key(run_id, bucket, slot), record.to_json())


def read_counters(store: Any, run_id: str) -> list[Optional[bytes]]:
    """The raw values of the :data:`BUCKETS` join counters (None for an absent one)."""
    return batchread.read_each(store, [count_key(run_id, bucket) for bucket in range(BUCKETS)])


def joined_count(counters: Sequence[Optional[bytes]], round_: int) -> int:
    """How many nodes took a slot in ``round_``, by the ``counters``: a round that cannot close yet is seen without
    reading a record."""
    return sum(slots_taken(parse_counter(raw), round_) for raw in counters)


def read_records(
    store: Any, run_id: str, round_: int, counters: Optional[Sequence[Optional[bytes]]] = None
) -> dict[str, JoinRecord]:
    """The join records of round ``round_``, by node name (``repr`` of the descriptor); ``counters`` as
    :func:`read_counters` read them (read here when not given)."""
    counters = read_counters(store, run_id) if counters is None else counters
    keys = [
        slot_key(run_id, bucket, slot)
        for bucket, raw in enumerate(counters)
        for slot in range(1, slots_taken(parse_counter(raw), round_) + 1)
    ]
    found: dict[str, JoinRecord] = {}
    for value in batchread.read_each(store, keys):
        record = JoinRecord.from_json(value) if value is not None else None
        if record is not None and record.round == round_:
            found[record.node_name] = record
    return found


def mark_closed(store: Any, run_id: str, round_: int) -> None:
    store.set(closed_key(run_id, round_), "1")


def is_closed(store: Any, run_id: str, round_: int) -> bool:
    return bool(store.check([closed_key(run_id, round_)]))
