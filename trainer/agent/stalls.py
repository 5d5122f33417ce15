"""Stalled steps, seen by the job agent in the ranks' step beacons: a rank that does not reach a step's gradient
reduction while its peers wait there is named in seconds of the stall, not when the collective times out.

Every rank writes a :class:`~disttrain.api.control.StepBeacon` (step, rank, node, group, its own clock) just before
each step's last backward (:meth:`disttrain.trainer.progress.Reporter.send_beacon`). The rule (:func:`detect`): in the
current group (the group of the beacon that changed last), the ranks at the highest step N wait in N's reduction; the
ranks of the group behind N are stalled once the first of the waiting ranks has waited ``stallFactor`` times the median
step time, and at least ``stallMinSeconds``; before the agent has a median (no two beacons of one rank yet: a rank that
stalls in a group's first seconds), ``stallMinSeconds`` alone. It gives no verdict

* on the group's first step (a warm-up, a load);
* while a directive is in flight: a drain or reform stops ranks at different points on purpose;
* for a save: a synchronous one holds every rank at the step boundary, where all agree on the step (no rank is
  behind). A rank whose asynchronous save is still in flight says so in its beacon, and the wait then must be twice
  as long: the save gets one full threshold to finish. Not a veto: the flag is as old as the beacon, and a rank
  that hangs right after a save began would otherwise never be named.

Tampering (the heartbeat rule's hold, :class:`~disttrain.trainer.agent.heartbeats.SilenceTracker`): a beacon that
does not verify reads as absent, so a stranger who garbles, deletes or replays the beacon keys would leave a healthy
rank at its last valid step, behind its peers. So no verdict is given while the beacons are tampered with (the
verifying store rejected a beacon value, or a rank seen before has no valid beacon now) and for one stall threshold
after; and a verdict needs a fresh verified read of every laggard (its beacon read and verified in the read it is
judged on). Tampering delays a verdict; it never names a healthy node.

Durations come from one rank's own clock (two of its beacons); how long the peers have waited comes from the agent's
clock (when it first saw their beacon), so no two clocks are ever compared. A stall stays reported (its wait as it was
when found) until the group changes or the laggards reach the step, so the operator's eviction, which the
directive it issues would otherwise hide, is not undone. :class:`StallWatch` is the agent's side (reads the store);
:func:`detect` is pure.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
import time
from collections.abc import Mapping
from typing import Any, Optional

from disttrain.api import control as keys

MAX_DURATIONS = 64
"""Step durations the median is taken over (the most recent ones, of any rank)."""
READ_INTERVAL_S = 1.0
"""How often the agent reads the beacons (one ``check`` and one ``multi_get`` of them all when every rank has one): a
stall is never shorter than ``stallMinSeconds`` (at least 1 s), so reading more often buys nothing."""
RANKS_READ_PER_SECOND = 2048
"""Beyond this many ranks the beacons are read less often than every second (:func:`read_interval_s`)."""
READ_SHARE = 0.2
"""The most of the agent's time reading the beacons may take: a read of many ranks one by one (while a rank has no
valid beacon: about 0.5 ms each, measured on loopback on a loaded 2-core machine) spaces the next one out to
1 / this times its own length."""
DUMP_GRACE_S = 2.0
"""Seconds between asking every rank for its stacks and reporting the stall: the lagging node is evicted after its
dump, not before (the workers' watchdogs poll every 0.2 s)."""


@dataclasses.dataclass(frozen=True)
class Seen:
    """One rank's newest beacon and when the agent first saw it (agent monotonic time)."""

    beacon: keys.StepBeacon
    first_seen: float


@dataclasses.dataclass(frozen=True)
class Laggard:
    rank: int
    node: str
    pod_uid: str


@dataclasses.dataclass(frozen=True)
class Stall:
    """Ranks of ``group`` behind step ``step``'s reduction, where their peers had waited ``waited_s`` seconds."""

    group: str
    step: int
    waited_s: float
    laggards: tuple[Laggard, ...]


def read_interval_s(ranks: int, min_seconds: float) -> float:
    """Seconds between two reads of the beacons of ``ranks`` ranks: every second up to
    :data:`RANKS_READ_PER_SECOND` ranks, then in proportion (4 s at 8,192 ranks, whose read took 0.33 s on a loaded
    2-core machine), but never more than a tenth of ``stallMinSeconds``: a wait is then measured within a tenth of
    the shortest stall that counts."""
    return max(READ_INTERVAL_S, min(ranks / RANKS_READ_PER_SECOND, min_seconds / 10))


def threshold_s(median_s: float, factor: float, min_seconds: float) -> float:
    """How long the peers must wait before the laggards are stalled."""
    return max(min_seconds, factor * median_s)


def detect(
    seen: Mapping[int, Seen],
    *,
    median_s: Optional[float],
    factor: float,
    min_seconds: float,
    now: float,
    group_first_step: Mapping[str, int],
    quiet: bool = False,
) -> Optional[Stall]:
    """The stall in ``seen`` (rank -> newest beacon) at ``now``, or None (the rules of the module docstring).

    ``group_first_step`` is the first step the agent saw each group beacon; ``quiet``: a directive is in flight."""
    if quiet or factor <= 0 or not seen:
        return None
    newest = max(seen.values(), key=lambda s: (s.first_seen, s.beacon.step))
    group, world = newest.beacon.group, newest.beacon.world_size
    current = {r: s for r, s in seen.items() if s.beacon.group == group and r < world}
    if not current:
        return None
    lead = max(s.beacon.step for s in current.values())
    if lead <= group_first_step.get(group, lead):
        return None
    waiting_since = min(s.first_seen for s in current.values() if s.beacon.step == lead)
    waited = now - waiting_since
    saving = any(s.beacon.saving for s in current.values())
    if waited < threshold_s(median_s or 0.0, factor, min_seconds) * (2 if saving else 1):
        return None
    laggards = []
    for rank in range(world):
        mine = current.get(rank)
        if mine is not None and mine.beacon.step >= lead:
            continue
        known = mine or seen.get(rank)  # no beacon of this group yet: its pod is the one it had
        if known is not None and known.beacon.node:
            laggards.append(Laggard(rank, known.beacon.node, known.beacon.pod_uid))
    if not laggards:
        return None
    return Stall(group=group, step=lead, waited_s=waited, laggards=tuple(laggards))


def stalled_report(stall: Stall, directory: str) -> list[dict[str, Any]]:
    """``status.stalledNodes``: one entry per lagging node (its ranks together), sorted, in wire form."""
    by_node: dict[tuple[str, str], list[int]] = {}
    for laggard in stall.laggards:
        by_node.setdefault((laggard.node, laggard.pod_uid), []).append(laggard.rank)
    return [
        {
            "node": node,
            "podUid": uid,
            "ranks": sorted(ranks),
            "step": stall.step,
            "waitedSeconds": round(stall.waited_s, 1),
            "diagnostics": f"{directory}/{node}/{request_id(stall)}-rank*",
        }
        for (node, uid), ranks in sorted(by_node.items())
    ]


def request_id(stall: Stall) -> str:
    """What the ranks name their dump files after."""
    return f"stall-{stall.step}"


def is_resolved(stall: Stall, seen: Mapping[int, Seen]) -> bool:
    """The group changed, or every laggard reached the stalled step."""
    if not seen:
        return True
    newest = max(seen.values(), key=lambda s: (s.first_seen, s.beacon.step))
    if newest.beacon.group != stall.group:
        return True
    return all(
        (s := seen.get(lag.rank)) is not None and s.beacon.group == stall.group and s.beacon.step >= stall.step
        for lag in stall.laggards
    )


def beacon_tampering(store: Any) -> int:
    """How many beacon values the verifying store under ``store`` refused (invalid or replayed) or restored
    (``SignedStore.tamper_counts``); 0 where the store keeps no such count. Only its growth matters."""
    for _ in range(16):
        if store is None:
            return 0
        counts = getattr(store, "tamper_counts", None)
        if callable(counts):
            return sum(n for key, n in counts().items() if keys.BEACON_PREFIX in key)
        store = getattr(store, "underlying_store", None)
    return 0


def is_held(tampered_at: Optional[float], now: float, hold_s: float) -> bool:
    """Whether verdicts are held at ``now``: the beacons were tampered with less than ``hold_s`` ago."""
    return tampered_at is not None and now - tampered_at < hold_s


def verified_afresh(stall: Stall, fresh: set[int]) -> bool:
    """Whether every laggard's beacon was read and verified in the read the stall is judged on."""
    return all(laggard.rank in fresh for laggard in stall.laggards)


class StallWatch:
    """The agent's side: read the beacons every :func:`read_interval_s`, keep the step durations, hold a stall
    until it resolves. ``report`` returns what ``status.stalledNodes`` should hold and, once per stall, the
    diagnostics request to write."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.fresh: set[int] = set()
        """Ranks whose beacon the last read verified."""
        self.tampered_at: Optional[float] = None
        self._tampering = beacon_tampering(store)
        self.seen: dict[int, Seen] = {}
        self.durations: collections.deque[float] = collections.deque(maxlen=MAX_DURATIONS)
        self.group_first_step: dict[str, int] = {}
        self.stall: Optional[Stall] = None
        self.found_at = 0.0
        self._read_at: Optional[float] = None
        self._read_every = READ_INTERVAL_S
        self._report: list[dict[str, Any]] = []

    @property
    def median_s(self) -> Optional[float]:
        return statistics.median(self.durations) if self.durations else None

    def observe(self, rank: int, beacon: keys.StepBeacon, now: float) -> None:
        """Take ``rank``'s beacon as read at ``now``; a new step of the same group adds a duration."""
        before = self.seen.get(rank)
        if before is not None and before.beacon == beacon:
            return
        if before is not None and before.beacon.group == beacon.group and beacon.step > before.beacon.step:
            self.durations.append(max(0.0, beacon.time - before.beacon.time) / (beacon.step - before.beacon.step))
        first = self.group_first_step.get(beacon.group)
        self.group_first_step[beacon.group] = beacon.step if first is None else min(first, beacon.step)
        if len(self.group_first_step) > 16:  # only the newest groups matter
            del self.group_first_step[next(iter(self.group_first_step))]
        self.seen[rank] = Seen(beacon, now)

    def read(self, now: float) -> None:
        """Read every rank's beacon (rank 0's first: it says the world size); note which verified, and whether the
        beacons were tampered with (a refused value, or a rank seen before without a valid beacon now)."""
        self.fresh = set()
        first = keys.read_model(self.store, keys.beacon_key(0), keys.StepBeacon)
        missing = first is None and 0 in self.seen
        if first is not None:
            self.observe(0, first, now)
            self.fresh.add(0)
            world = max(s.beacon.world_size for s in self.seen.values() if s.beacon.group == first.group)
            names = [keys.beacon_key(rank) for rank in range(1, world)]
            batch = keys.read_models(self.store, names, keys.StepBeacon) if len(names) > 1 else None
            for rank in range(1, world):
                if batch is not None:  # every beacon there: read in two round trips, not two per rank
                    beacon = batch[rank - 1]
                else:
                    beacon = keys.read_model(self.store, keys.beacon_key(rank), keys.StepBeacon)
                if beacon is not None:
                    self.observe(rank, beacon, now)
                    self.fresh.add(rank)
                missing = missing or (beacon is None and rank in self.seen)
        tampering = beacon_tampering(self.store)
        if missing or tampering > self._tampering:
            self.tampered_at = now
        self._tampering = tampering

    def report(
        self, *, factor: float, min_seconds: float, quiet: bool, directory: str, now: float
    ) -> tuple[Optional[list[dict[str, Any]]], Optional[Stall]]:
        """(``status.stalledNodes`` or None, the stall just found when the ranks are to dump their stacks)."""
        if self._read_at is None or now - self._read_at >= self._read_every:
            self._read_at = now
            began = time.monotonic()
            self.read(now)
            self._read_every = max(
                read_interval_s(len(self.seen), min_seconds), (time.monotonic() - began) / READ_SHARE
            )
        new = None
        if self.stall is not None and is_resolved(self.stall, self.seen):
            self.stall, self._report = None, []
        hold_s = threshold_s(self.median_s or 0.0, factor, min_seconds)
        if self.stall is None and factor > 0 and not is_held(self.tampered_at, now, hold_s):
            found = detect(
                self.seen,
                median_s=self.median_s,
                factor=factor,
                min_seconds=min_seconds,
                now=now,
                group_first_step=self.group_first_step,
                quiet=quiet,
            )
            if found is not None and verified_afresh(found, self.fresh):
                self.stall, self.found_at, new = found, now, found
                self._report = stalled_report(found, directory)
        if self.stall is None or now - self.found_at < DUMP_GRACE_S:
            return None, new
        return self._report, new
