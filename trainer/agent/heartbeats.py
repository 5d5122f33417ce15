"""Silent nodes, seen by the job agent in the rendezvous heartbeats it hosts: a node loss in seconds, not when
Kubernetes marks the node NotReady (``node-monitor-grace-period``: 20-50 s).

Every torchrun agent writes a heartbeat time into the c10d rendezvous state (``_RendezvousState.last_heartbeats``,
pickled and base64-encoded under ``torch.rendezvous.<run id>``) every ``keepAliveIntervalSeconds``. The agent hosts
that store, so it reads the state and reports a participant of the round as silent when its heartbeat is
``silentAfterSeconds`` (1 s by default, with 0.1 s beats) older than the newest one in the state. Times are
compared with each other, never with the agent's clock: they all come from the workers, whose clocks torch's own
expiry already compares. torch's sanitizer removes an expired node from the state at its next write, so a node that
vanished from the participants with a heartbeat that old is silent too (one that leaves on its own, to re-join
or to exit, has a fresh heartbeat when it goes). A node that is missed is still caught by Kubernetes' signals;
a healthy node reported silent would be fenced for nothing, so every rule errs towards missing. Under attack
the state may be one a reader restored from a stale copy: a node is judged by the freshest heartbeat of
it seen in any state, and no verdict is given while the state was tampered with and for a hold after
(:class:`SilenceTracker`), so a stranger costs a later detection, never a fenced node.

Safety: the state is read only through a store that verifies values (:func:`read_state` refuses any other), so
the bytes unpickled were sealed with the job's secret by one of its own processes (:mod:`disttrain.api.storeauth`);
as a second layer they are decoded by :class:`RestrictedUnpickler`, which admits only the rendezvous state, node
descriptors, datetimes and the builtin containers, and builds them as inert stand-ins (no torch class is
instantiated); anything else is refused. The node's pod comes from :func:`identity_key`, which
the ``disttrain`` rendezvous handler writes before the node joins a round (:mod:`disttrain.trainer.launch.rendezvous`).

Pure but for the functions that read a store (:func:`read_state`, :func:`read_beats`, :func:`read_identities`);
no torch import.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import datetime
import io
import json
import pickle
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional

from disttrain.api import agentview, control
from disttrain.api.spec import beat_interval_seconds
from disttrain.api.timestamps import format_time
from disttrain.trainer.store import batchread

STATE_CLASS = ("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "_RendezvousState")
NODE_CLASS = ("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "_NodeDesc")
NULL_SENTINEL = b"Y2FuaW1hZGFt"
"""What the c10d backend stores before the first state (``C10dRendezvousBackend._NULL_SENTINEL``)."""
MAX_STATE_BYTES = 1 << 20
"""A larger state is refused unread: hundreds of nodes fit in a few KiB."""
MAX_BEAT_TIME = 1e11
"""A beat's time is seconds since the epoch; anything beyond the year 5000 (or not finite) is no beat."""
MIN_RETENTION_S = 30.0
"""How long a node dropped for silence stays reported at least (the operator acts on it within a reconcile)."""


class StateRefused(ValueError):
    """The bytes under the rendezvous key are not a rendezvous state this module accepts."""


class _Inert:
    """A stand-in object: attributes set by unpickling (BUILD) and nothing else; no methods run."""

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (dict, slots) form
            state = {**(state[0] or {}), **(state[1] or {})}
        if not isinstance(state, dict):
            raise StateRefused(f"{type(self).__name__}: state is {type(state).__name__}, not a dict")
        self.__dict__.update(state)


class _StateStub(_Inert):
    pass


class _NodeStub(_Inert):
    def __hash__(self) -> int:
        return hash((self.__dict__.get("addr"), self.__dict__.get("pid"), self.__dict__.get("local_id")))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _NodeStub) and self.__dict__ == other.__dict__


_ALLOWED: Mapping[tuple[str, str], Any] = {
    STATE_CLASS: _StateStub,
    NODE_CLASS: _NodeStub,
    ("datetime", "datetime"): datetime.datetime,
    ("datetime", "timezone"): datetime.timezone,
    ("datetime", "timedelta"): datetime.timedelta,
}


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickles a ``_RendezvousState`` and refuses every other global (the pickle docs' "restricting globals")."""

    def find_class(self, module: str, name: str) -> Any:
        found = _ALLOWED.get((module, name))
        if found is None:
            raise StateRefused(f"the rendezvous state names {module}.{name}, which is not allowed")
        return found


@dataclasses.dataclass(frozen=True)
class RendezvousView:
    """What the silence rule needs from one rendezvous state; nodes are named by ``repr(_NodeDesc)``."""

    round: int
    complete: bool
    closed: bool
    participants: frozenset[str]
    heartbeats: Mapping[str, datetime.datetime]


def node_name(node: Any) -> str:
    """``repr`` of a torch ``_NodeDesc`` (``addr_pid_localid``), from a stand-in or the real thing."""
    fields = node.__dict__ if isinstance(node, _NodeStub) else vars(node)
    return f"{fields.get('addr')}_{fields.get('pid')}_{fields.get('local_id')}"


def decode_state(raw: bytes) -> Optional[RendezvousView]:
    """The state as stored by ``C10dRendezvousBackend`` (base64 of a pickle); None before the first round.

    Raises :class:`StateRefused` for anything but a rendezvous state of the expected shape."""
    if raw == NULL_SENTINEL:
        return None
    if len(raw) > MAX_STATE_BYTES:
        raise StateRefused(f"the rendezvous state is {len(raw)} bytes, over {MAX_STATE_BYTES}")
    try:
        bits = base64.b64decode(raw, validate=True)
        state = RestrictedUnpickler(io.BytesIO(bits)).load()
    except StateRefused:
        raise
    except (binascii.Error, pickle.UnpicklingError, EOFError, TypeError, ValueError, AttributeError) as error:
        raise StateRefused(f"the rendezvous state cannot be decoded: {error!r}") from error
    if not isinstance(state, _StateStub):
        raise StateRefused(f"the rendezvous state is a {type(state).__name__}, not a _RendezvousState")
    fields = state.__dict__
    participants, beats = fields.get("participants"), fields.get("last_heartbeats")
    if not isinstance(participants, dict) or not isinstance(beats, dict):
        raise StateRefused("the rendezvous state has no participants / last_heartbeats dicts")
    heartbeats: dict[str, datetime.datetime] = {}
    for node, when in beats.items():
        if not isinstance(node, _NodeStub) or not isinstance(when, datetime.datetime) or when.tzinfo is None:
            raise StateRefused("a heartbeat is not (node, aware datetime)")
        heartbeats[node_name(node)] = when
    if not all(isinstance(node, _NodeStub) for node in participants):
        raise StateRefused("a participant is not a node descriptor")
    return RendezvousView(
        round=int(fields.get("round", 0)),
        complete=bool(fields.get("complete", False)),
        closed=bool(fields.get("closed", False)),
        participants=frozenset(node_name(node) for node in participants),
        heartbeats=heartbeats,
    )


def state_key(run_id: str) -> str:
    """The c10d backend's key of the rendezvous state (``C10dRendezvousBackend._key``)."""
    return "torch.rendezvous." + run_id


def encode_beat(at: float, *, leaving: bool = False) -> str:
    """The value of a beat: the node's wall-clock time (compared only with other nodes' times, as torch's are).
    ``leaving``: the launcher's last beat, written as it shuts down (its workers finished or failed): the node's
    silence from then on is its way out, which its pod's exit will say (:func:`parse_beat`)."""
    return json.dumps({"at": round(at, 3), "leaving": True} if leaving else {"at": round(at, 3)})


def parse_beat(raw: bytes) -> Optional[tuple[float, bool]]:
    """A beat's time and whether it is its launcher's last; None for anything that is not a beat."""
    try:
        value = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    at = value.get("at") if isinstance(value, dict) else None
    if not isinstance(at, (int, float)) or isinstance(at, bool) or not 0 < at < MAX_BEAT_TIME:
        return None
    return float(at), value.get("leaving") is True


def beat_key(run_id: str, node: object) -> str:
    """Store key of a node's liveness beat, which its launcher writes (``disttrain.trainer.launch.beat``)."""
    return f"torch.rendezvous.{run_id}/disttrain.beat/{node}"  # str(_NodeDesc) is its repr


SUMMARY_EVERY_S = 0.5
"""How often the agent publishes its :class:`BeatSummary`."""
SUMMARY_ABOVE_NODES = 32
"""The summary is published, and read, for rounds of more nodes than this (smaller ones read the beats)."""


def beat_summary_key(run_id: str) -> str:
    """Store key of the agent's :class:`BeatSummary` of ``run_id``."""
    return f"torch.rendezvous.{run_id}/disttrain.beats"


BEAT_SUMMARY_MAX_BYTES = 1024 * 1024
"""Largest summary written or parsed (about 30 bytes a node)."""


@dataclasses.dataclass(frozen=True)
class BeatSummary:
    """The last beat of each node the agent judges, as it read them (launchers' last beats left out): one value
    that a node of a large round reads instead of one beat key per node.

    Why: torch's sanitizer, in every node, spares the nodes whose beat is fresh; read key by key, a reform of N
    nodes cost N x N signed reads, all at once (128 simulated nodes: seconds per node)."""

    time: float
    """When the agent read the beats (Unix seconds)."""
    beats: Mapping[str, float]
    """Node (its descriptor's name) -> its last beat (Unix seconds)."""

    def encode(self) -> str:
        ages = {node: round((self.time - at) * 1000) for node, at in self.beats.items()}
        return json.dumps({"time": self.time, "ages_ms": ages}, separators=(",", ":"))

    @classmethod
    def decode(cls, raw: bytes) -> Optional[BeatSummary]:
        """The summary, or None for anything that is not one."""
        if len(raw) > BEAT_SUMMARY_MAX_BYTES:
            return None
        try:
            value = json.loads(raw)
            at, ages = value["time"], value["ages_ms"]
        except (ValueError, TypeError, KeyError):
            return None
        if type(at) not in (int, float) or not isinstance(ages, dict):
            return None
        if not all(isinstance(node, str) and type(age) is int for node, age in ages.items()):
            return None
        return cls(float(at), {node: at - age / 1000 for node, age in ages.items()})


def write_beat_summary(store: Any, run_id: str, summary: BeatSummary) -> None:
    encoded = summary.encode()
    if len(encoded) <= BEAT_SUMMARY_MAX_BYTES:
        store.set(beat_summary_key(run_id), encoded)


def read_beat_summary(store: Any, run_id: str) -> Optional[BeatSummary]:
    found = batchread.read_each(store, [beat_summary_key(run_id)])[0]
    return BeatSummary.decode(found) if found is not None else None


def identity_key(run_id: str, node: object) -> str:
    """Store key of a participant's pod (name and uid), beside the node index of :mod:`rank_order`."""
    return f"torch.rendezvous.{run_id}/disttrain.node-identity/{node}"  # str(_NodeDesc) is its repr


@dataclasses.dataclass(frozen=True)
class NodeIdentity:
    name: str
    """DISTTRAIN_NODE_NAME (the pod name)."""
    uid: str = ""
    """The pod's uid (DISTTRAIN_POD_UID), so the operator never takes a replacement of that name for it."""

    def to_json(self) -> str:
        return json.dumps({"name": self.name, "uid": self.uid})

    @classmethod
    def from_json(cls, raw: bytes) -> Optional[NodeIdentity]:
        try:
            value = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            return None
        if not isinstance(value, dict):
            return None
        name, uid = value.get("name"), value.get("uid", "")
        if not isinstance(name, str) or not isinstance(uid, str) or not 0 < len(name) <= 253 or len(uid) > 64:
            return None
        return cls(name, uid)


@dataclasses.dataclass
class _Silent:
    heartbeat: datetime.datetime
    round: int
    dropped_at: Optional[float] = None
    """Agent monotonic time it vanished from the state (None: still there)."""


class SilenceTracker:
    """The silence rule over successive states (see the module docstring). ``observe`` returns the silent nodes
    with their last heartbeat; ``now`` (the agent's monotonic clock) bounds how long a dropped node stays reported
    and how long heartbeats stay distrusted after the state was tampered with.

    Under attack the state a reader finds may have been put back by a restore (a reader of the signed
    store, or the agent's guardian, writes back the last valid value it saw after an outsider deleted or garbled
    the key): its heartbeats may be older than ones already written, and a node's keep-alive writes may be lost or
    late meanwhile. So the rule holds against restores in two ways:

    * a node is judged by the freshest heartbeat of it the agent has seen in any valid state, against the freshest
      heartbeat of anyone seen (both only move forward), never by the timestamps of one state alone;
    * while the state was tampered with (``tampered``: the caller saw the store reject or restore the state, or
      this tracker saw a node's heartbeat go back, which no genuine write does: torch writes by compare-and-set
      over the newest state) and for :attr:`hold_s` after, no new verdict is given. A node that vanished meanwhile
      is never judged (torch's sanitizer may have dropped it on a restored heartbeat); a participant still behind
      when the hold ends is. A real dead node is then reported :attr:`hold_s` later at most, or caught first by
      torch's own expiry, a collective error or its pod's status: a stranger costs a delay, never a restart.
    """

    def __init__(
        self, interval_s: float, max_attempts: int, *, silence_s: Optional[float] = None, hold_first: bool = False
    ) -> None:
        self.torch_expiry = datetime.timedelta(seconds=interval_s * max_attempts)
        self.expiry = self.torch_expiry if silence_s is None else datetime.timedelta(seconds=silence_s)
        """Silence after which a participant of a calm round is reported (``spec.rendezvous.silentAfterSeconds``);
        torch's own expiry (interval x attempts) when not given."""
        self.settle_s = self.torch_expiry.total_seconds()
        """How long a complete round must stay as it is (same round, no node joining, no new verdict) before
        :attr:`expiry` applies; until then, and in a round still forming, a participant is judged at torch's
        expiry, the longer of the two. A node inside ``next_rendezvous`` has torch's heartbeat timer stopped and
        heartbeats only between the join's reads; nodes that just joined start their workers; on a loaded machine
        both silenced live nodes for over a second."""
        self._calm_key: Optional[tuple[int, bool, frozenset[str]]] = None
        self._calm_since = 0.0
        self._reported: set[str] = set()
        self._calm_before_verdict: Optional[tuple[float, tuple[int, bool, frozenset[str]]]] = None
        """The calm (its start, the round as it was) that new verdicts ended, until they are all withdrawn (each
        named node beat again, the round unchanged, no directive): then the round is as calm as it was."""
        self._directive_round: Optional[int] = None
        """The round a directive (drain, reform) was published in, until a later complete round is seen: nodes leave
        that round at their own pace (a drained node exits without leaving it; survivors stop torch's timer to
        re-join), so it is never calm again."""
        self._round = -1
        # A node torch dropped was expired when dropped; the write that dropped it may carry a heartbeat of the
        # dropper up to one interval old. One that left on its own had a heartbeat within about one interval.
        self.vanish = datetime.timedelta(seconds=max(interval_s * (max_attempts - 1), 1.5 * interval_s))
        self.hold_s = interval_s * (max_attempts + 1)
        """Seconds without tampering before heartbeats are trusted again: every live node has written a fresh
        heartbeat by then (one interval, plus torch's expiry for keep-alive writes the attack delayed)."""
        self._last: dict[str, tuple[datetime.datetime, int]] = {}
        """Participants of the last state: the freshest heartbeat seen of each, and the round."""
        self._newest: Optional[datetime.datetime] = None
        """The freshest heartbeat of anyone seen since the rendezvous (re)started."""
        self._tampered_at: Optional[float] = None
        self._dropped: dict[str, _Silent] = {}
        self._first_state = hold_first
        """Hold the first complete state as a restore is (:attr:`hold_s`): an agent that starts beside a running
        group (its predecessor was lost) finds the state the survivors put back, with heartbeats as old as the
        outage, until each survivor has reconnected and brought its own forward."""

    def directive_published(self) -> None:
        """A drain or reform directive went to the nodes: the current round is judged at torch's expiry from now on."""
        self._directive_round = self._round
        self._calm_before_verdict = None

    def trusted(self, now: float) -> bool:
        """Whether heartbeats may be judged at ``now``: no tampering seen within :attr:`hold_s`."""
        return self._tampered_at is None or now - self._tampered_at >= self.hold_s

    def observe(
        self,
        view: Optional[RendezvousView],
        now: float,
        tampered: bool = False,
        leaving: frozenset[str] = frozenset(),
    ) -> dict[str, datetime.datetime]:
        """``leaving``: the nodes whose launchers said they are shutting down (their last beat): judged at torch's
        expiry, never at :attr:`expiry`, so that the exit of their pods, not their silence, names what happened (a
        crash is ``PodFailed``; a launcher still exiting on a loaded machine took over a second)."""
        if view is None or view.closed:
            if view is None and self._last:
                self._tampered_at = now  # torch never deletes the state: it was taken away, or put back stale
            self._last.clear()
            self._dropped.clear()
            self._newest = None
            return {}
        current = {n: view.heartbeats[n] for n in view.participants if n in view.heartbeats}
        went_back = any(beat < self._last[n][0] for n, beat in current.items() if n in self._last)
        restored = self._first_state and view.complete
        self._first_state = self._first_state and not view.complete
        if tampered or went_back or restored:
            self._tampered_at = now
        trusted = self.trusted(now)
        freshest = {n: max(beat, self._last[n][0]) if n in self._last else beat for n, beat in current.items()}
        newest = max([*view.heartbeats.values(), *([self._newest] if self._newest else [])], default=None)
        self._newest = newest
        for node, (beat, round_) in self._last.items():
            if node in current or newest is None or not trusted:
                continue  # under tampering a vanished node is never judged (see the class docstring)
            if newest - beat >= self.vanish:
                self._dropped.setdefault(node, _Silent(beat, round_, now))
        self._last = {node: (beat, view.round) for node, beat in freshest.items()}
        for node, silent in list(self._dropped.items()):
            newer_round = view.round > silent.round and view.complete
            if node in current or (newer_round and now - (silent.dropped_at or now) >= MIN_RETENTION_S):
                del self._dropped[node]
        found = {node: s.heartbeat for node, s in self._dropped.items()}
        calm_key = (view.round, view.complete, view.participants)
        if self._calm_key is None or calm_key[:2] != self._calm_key[:2] or view.participants - self._calm_key[2]:
            self._calm_since = now  # a new round, its completion or a node joining; one leaving changes no one's pace
            self._calm_before_verdict = None
        self._calm_key = calm_key
        self._round = view.round
        if self._directive_round is not None and view.complete and view.round > self._directive_round:
            self._directive_round = None
        calm = view.complete and self._directive_round is None and now - self._calm_since >= self.settle_s
        if newest is not None and trusted:
            for node, beat in freshest.items():
                # A node once reported stays reported while as silent (no verdict flaps off with the calm).
                fast = node in self._reported or (calm and node not in leaving)
                if newest - beat >= (self.expiry if fast else max(self.expiry, self.torch_expiry)):
                    found[node] = beat
        self._calm_after_verdicts(set(found), calm_key, now)
        self._reported = set(found)
        return found

    def _calm_after_verdicts(self, found: set[str], calm_key: tuple[int, bool, frozenset[str]], now: float) -> None:
        """A new verdict starts a reform (the other nodes are about to leave the round): the calm ends. When every
        node named beat again before any directive and no node left, no reform started: a real loss now is judged
        as in the calm round it is, not at torch's expiry."""
        if found - self._reported:
            if self._calm_before_verdict is None:
                self._calm_before_verdict = (self._calm_since, calm_key)
            self._calm_since = now
        elif not found and self._calm_before_verdict is not None:
            since, key = self._calm_before_verdict
            self._calm_before_verdict = None
            if key == calm_key and self._directive_round is None:
                self._calm_since = since


def silent_report(
    silent: Mapping[str, datetime.datetime], identities: Mapping[str, Optional[NodeIdentity]]
) -> list[dict[str, str]]:
    """``status.silentNodes``: one entry per silent node whose pod is known, sorted, in wire form."""
    entries = []
    for node, beat in silent.items():
        who = identities.get(node)
        if who is not None:
            entries.append({"node": who.name, "podUid": who.uid, "lastHeartbeat": format_time(beat.timestamp())})
    return sorted(entries, key=lambda e: (e["node"], e["podUid"]))


def is_verifying(store: Any) -> bool:
    """Whether ``store`` (through any PrefixStores) hands out only verified values: a ``SignedStore`` of
    :mod:`disttrain.trainer.store.signedstore` marks itself with ``verifies_values`` (checked by name: no torch
    here)."""
    for _ in range(16):
        if store is None:
            return False
        if getattr(store, "verifies_values", False) is True:
            return True
        store = getattr(store, "underlying_store", None)
    return False


def read_state(store: Any, run_id: str) -> Optional[RendezvousView]:
    """The rendezvous state in ``store`` (``check`` first: ``get`` blocks on a missing key).

    ``store`` must verify values (:func:`is_verifying`): the state is a pickle, and unverified bytes are never
    unpickled, not even by the restricted unpickler."""
    if not is_verifying(store):
        raise StateRefused("the rendezvous state is read only through a signed store (disttrain.trainer.store.channel)")
    key = state_key(run_id)
    if not store.check([key]):
        return None
    return decode_state(bytes(store.get(key)))


def tamper_count(store: Any, run_id: str) -> int:
    """How often the verifying store under ``store`` found the rendezvous state invalid, replayed or deleted and
    wrote it back (``SignedStore.tamper_counts``, by full key name, the namespace prefix before the state key); 0
    where the store keeps no such count. Only its growth matters: the state was tampered with meanwhile."""
    key = state_key(run_id)
    for _ in range(16):
        if store is None:
            return 0
        counts = getattr(store, "tamper_counts", None)
        if callable(counts):
            return sum(n for k, n in counts().items() if k == key or k.endswith("/" + key))
        store = getattr(store, "underlying_store", None)
    return 0


@dataclasses.dataclass(frozen=True)
class Beats:
    times: dict[str, datetime.datetime]
    """The last beat of each node that has one."""
    leaving: frozenset[str]
    """The nodes whose last beat is their launcher's last (:func:`parse_beat`)."""


def read_beats(store: Any, run_id: str, nodes: frozenset[str]) -> Beats:
    """The last beat of each of ``nodes`` that has one (a signed timestamp; anything else is no beat)."""
    found, leaving = {}, set()
    ordered = sorted(nodes)
    # Every node beating (the usual case): one check and one multi_get per chunk, not two round trips per node.
    values = batchread.read_each(store, [beat_key(run_id, node) for node in ordered])
    for node, raw in zip(ordered, values, strict=True):
        if raw is not None:
            parsed = parse_beat(raw)
            if parsed is not None:
                found[node] = datetime.datetime.fromtimestamp(parsed[0], datetime.timezone.utc)
                if parsed[1]:
                    leaving.add(node)
    return Beats(found, frozenset(leaving))


def beating_nodes(view: RendezvousView) -> frozenset[str]:
    """The nodes whose beats count: the participants and every node with a heartbeat in the state (the nodes
    waiting for the next round, whose beats keep the newest time fresh while the participants are judged)."""
    return view.participants | frozenset(view.heartbeats)


def with_beats(view: RendezvousView, beats: Mapping[str, datetime.datetime]) -> RendezvousView:
    """``view`` with the heartbeat of each of :func:`beating_nodes` raised to its last beat when that is fresher."""
    merged = dict(view.heartbeats)
    counted = beating_nodes(view)
    for node, at in beats.items():
        if node in counted and (node not in merged or at > merged[node]):
            merged[node] = at
    return dataclasses.replace(view, heartbeats=merged)


def read_identities(store: Any, run_id: str, nodes: Sequence[str]) -> dict[str, Optional[NodeIdentity]]:
    """Each node's identity, None where it published none (batched: :mod:`disttrain.trainer.store.batchread`)."""
    values = batchread.read_each(store, [identity_key(run_id, node) for node in nodes])
    return {
        node: NodeIdentity.from_json(value) if value is not None else None
        for node, value in zip(nodes, values, strict=True)
    }


READ_EARLY_S = 0.05
"""How much earlier than a beat period the next read may come (the agent's rounds come every 0.1 s)."""


def read_due(read_at: float, now: float, nodes: int, silence_s: float) -> bool:
    """Whether the agent reads the state and the beats again at ``now``: once per beat period of a job of
    ``nodes`` nodes (:func:`~disttrain.api.spec.beat_interval_seconds`), as reading more often than the nodes beat
    finds nothing new. Each read verifies one signed beat per node: 10,000 a second at 1,024 nodes every 0.1 s."""
    return now - read_at >= beat_interval_seconds(nodes, silence_s) - READ_EARLY_S


class HeartbeatWatch:
    """The agent's side: read the state each round, keep the tracker, remember identities (a node's key may be
    gone by the time it is reported). ``report`` is what ``status.silentNodes`` should hold."""

    def __init__(self, store: Any, tampering: Optional[Callable[[], int]] = None) -> None:
        self.store = store
        self.tampering = tampering
        """A count that grows whenever someone else saw the rendezvous keys tampered with (the agent's guardian:
        deleted, garbled, replayed values it swept); None: only the agent's own store is asked."""
        self._evidence: Optional[int] = None
        self._tracker: Optional[SilenceTracker] = None
        self._settings: Optional[tuple[str, float, int, float]] = None
        self._identities: dict[str, Optional[NodeIdentity]] = {}
        self._summary_at = float("-inf")
        self._read_at = float("-inf")
        self._nodes_seen = 0
        self._last_report: Optional[list[dict[str, str]]] = None
        self.members: Optional[list[str]] = None
        """Pod names of the last completed round seen (``status.roundMembers``); None before one is known."""
        self._round_run_id: Optional[str] = None
        self.last_complete_round = control.NO_ROUND
        """The newest complete rendezvous round seen (of this run id): the round a directive published now is issued
        for. It only rises: the agent's signed store refuses an older state (a replay) once it saw a newer one."""
        self.beside_running_group = False
        """The agent started while its job's group was running (its predecessor was lost): the silence rule holds
        its first verdicts (:class:`SilenceTracker`, ``hold_first``)."""

    def _publish_beats(self, run_id: str, beats: Beats) -> None:
        """The beats just read, as one :class:`BeatSummary` for the launchers of a round of more than
        :data:`SUMMARY_ABOVE_NODES` nodes, at most every :data:`SUMMARY_EVERY_S`."""
        now = time.time()
        if len(beats.times) <= SUMMARY_ABOVE_NODES or now - self._summary_at < SUMMARY_EVERY_S:
            return
        self._summary_at = now
        alive = {node: at.timestamp() for node, at in beats.times.items() if node not in beats.leaving}
        write_beat_summary(self.store, run_id, BeatSummary(now, alive))

    def read_round(self, run_id: str) -> int:
        """:attr:`last_complete_round`, from a fresh read of ``run_id``'s state (a directive is about to go out)."""
        self._note_round(run_id, read_state(self.store, run_id))
        return self.last_complete_round

    def _note_round(self, run_id: str, view: Optional[RendezvousView]) -> None:
        if run_id != self._round_run_id:
            self._round_run_id, self.last_complete_round = run_id, control.NO_ROUND
        if view is not None and not view.closed:
            complete = control.last_complete_round(view.round, view.complete)
            self.last_complete_round = max(self.last_complete_round, complete)

    def directive_published(self) -> None:
        """See :meth:`SilenceTracker.directive_published`."""
        if self._tracker is not None:
            self._tracker.directive_published()

    def report(self, job: agentview.AgentJob, now: float) -> list[dict[str, str]]:
        """Silent nodes of ``job``'s rendezvous at ``now`` (agent monotonic time), judged by its ``spec.rendezvous``
        heartbeat settings (``silentAfterSeconds``); a change of any (or of the run id) starts the rule afresh."""
        run_id, rdzv = job.run_id, job.spec.rendezvous
        settings = (
            run_id,
            float(rdzv.keep_alive_interval_seconds),
            rdzv.keep_alive_max_attempts,
            rdzv.silent_after_seconds,
        )
        if self._tracker is None or settings != self._settings:
            tracker = SilenceTracker(
                settings[1], settings[2], silence_s=settings[3], hold_first=self.beside_running_group
            )
            self._tracker, self._settings, self._identities = tracker, settings, {}
            self._last_report = None
        elif self._last_report is not None and not read_due(self._read_at, now, self._nodes_seen, settings[3]):
            return self._last_report
        self._read_at = now
        view = read_state(self.store, run_id)
        self._note_round(run_id, view)
        leaving: frozenset[str] = frozenset()
        if view is not None and not view.closed:
            beats = read_beats(self.store, run_id, beating_nodes(view))
            view, leaving = with_beats(view, beats.times), beats.leaving
            self._publish_beats(run_id, beats)
        evidence = tamper_count(self.store, run_id) + (self.tampering() if self.tampering is not None else 0)
        tampered = self._evidence is not None and evidence != self._evidence
        self._evidence = evidence
        if view is not None:
            unknown = [node for node in view.participants if self._identities.get(node) is None]
            self._identities.update(read_identities(self.store, run_id, unknown))
        silent = self._tracker.observe(view, now, tampered, leaving)
        if view is None:
            self.members = None
        elif view.complete and not view.closed:
            found = [self._identities.get(node) for node in view.participants]
            # A participant without a known pod makes the report unusable (never a partial list).
            self.members = sorted(who.name for who in found if who is not None) if all(found) else None
        self._identities = {
            n: i for n, i in self._identities.items() if view is None or n in view.participants or n in silent
        }
        self._nodes_seen = 0 if view is None else len(beating_nodes(view))
        self._last_report = silent_report(silent, self._identities)
        return self._last_report
