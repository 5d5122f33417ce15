"""The stall rule (disttrain.trainer.agent.stalls): which ranks lag behind a step's gradient reduction, and when."""

from __future__ import annotations

import pytest
from torch.distributed import HashStore

from disttrain.api import control as keys
from disttrain.trainer.agent import stalls

pytestmark = pytest.mark.timeout(30)
GROUP = "10.0.0.1:29500"


def beacon(rank: int, step: int, *, group: str = GROUP, world: int = 3, time: float = 0.0) -> keys.StepBeacon:
    return keys.StepBeacon(
        step=step,
        rank=rank,
        world_size=world,
        group=group,
        node=f"demo-worker-{rank}",
        pod_uid=f"uid-{rank}",
        time=time,
    )


def seen(*entries: tuple[int, int, float], group: str = GROUP, world: int = 3) -> dict[int, stalls.Seen]:
    """(rank, step, first seen) per rank."""
    return {r: stalls.Seen(beacon(r, step, group=group, world=world), at) for r, step, at in entries}


def verdict(observed, *, now=100.0, median_s=1.0, factor=10.0, min_seconds=5.0, first=None, quiet=False):
    return stalls.detect(
        observed,
        median_s=median_s,
        factor=factor,
        min_seconds=min_seconds,
        now=now,
        group_first_step={GROUP: 1} if first is None else first,
        quiet=quiet,
    )


def test_the_rank_that_did_not_reach_the_reduction_is_named_once_the_peers_waited_long_enough():
    observed = seen((0, 7, 80.0), (1, 6, 70.0), (2, 7, 85.0))
    stall = verdict(observed, now=100.0)  # rank 0 waits since 80: 20 s > max(5, 10 x 1 s)
    assert stall is not None and stall.step == 7 and stall.waited_s == 20.0
    assert [(lag.rank, lag.node, lag.pod_uid) for lag in stall.laggards] == [(1, "demo-worker-1", "uid-1")]


@pytest.mark.parametrize(
    "observed, kwargs",
    [
        (seen((0, 7, 95.0), (1, 6, 70.0), (2, 7, 95.0)), {}),
        (seen((0, 7, 80.0), (1, 6, 70.0), (2, 7, 80.0)), {"min_seconds": 60.0}),
        (seen((0, 7, 80.0), (1, 6, 70.0), (2, 7, 80.0)), {"median_s": 3.0}),
        (seen((0, 7, 96.0), (1, 6, 70.0), (2, 7, 96.0)), {"median_s": None}),
        (seen((0, 7, 80.0), (1, 6, 70.0), (2, 7, 80.0)), {"factor": 0.0}),
        (seen((0, 7, 80.0), (1, 6, 70.0), (2, 7, 80.0)), {"quiet": True}),
        (seen((0, 7, 80.0), (1, 7, 70.0), (2, 7, 80.0)), {}),
        (seen((0, 7, 80.0), (1, 6, 70.0), (2, 7, 80.0)), {"first": {GROUP: 7}}),
    ],
    ids=[
        "waited-less-than-k-medians",
        "waited-less-than-the-floor",
        "slow-steps-raise-the-bar",
        "no-median-yet-and-waited-less-than-the-floor",
        "detection-off",
        "directive-in-flight",
        "every-rank-at-the-same-step-as-in-a-save",
        "the-groups-first-step",
    ],
)
def test_no_verdict(observed, kwargs):
    assert verdict(observed, **kwargs) is None


def test_a_stall_in_a_groups_first_seconds_is_named_by_the_floor_alone():
    """The agent reads beacons about once a second: a rank that stalls before it saw two of one rank's beacons
    leaves no median, and no new beacon ever comes. The floor still names it."""
    observed = seen((0, 7, 80.0), (1, 6, 70.0), (2, 7, 80.0))
    stall = verdict(observed, now=100.0, median_s=None, min_seconds=15.0)
    assert stall is not None and [lag.rank for lag in stall.laggards] == [1]


def test_a_save_in_flight_gets_one_more_threshold_to_finish():
    observed = seen((0, 7, 80.0), (1, 6, 70.0), (2, 7, 80.0))
    observed[0] = stalls.Seen(observed[0].beacon.model_copy(update={"saving": True}), 80.0)
    assert verdict(observed, now=95.0) is None, "15 s < 2 x 10 s"
    assert verdict(observed, now=101.0) is not None


def test_beacons_of_an_older_group_are_not_compared_with_the_current_one():
    observed = seen((1, 40, 10.0), group="10.0.0.1:1111")  # rank 1 of the old group was at step 40
    observed |= seen((0, 31, 90.0), (2, 32, 91.0))  # the new group resumed from 30
    stall = verdict(observed, now=105.0, first={GROUP: 31, "10.0.0.1:1111": 1})
    assert stall is not None and stall.step == 32, "the old group's step 40 is not the lead"
    assert [lag.rank for lag in stall.laggards] == [0, 1], "rank 1 has no beacon of this group: it lags too"


def test_beacons_of_many_ranks_are_read_less_often_but_within_a_tenth_of_the_shortest_stall():
    assert stalls.read_interval_s(16, min_seconds=60) == 1.0
    assert stalls.read_interval_s(2048, min_seconds=60) == 1.0
    assert stalls.read_interval_s(8192, min_seconds=60) == 4.0
    assert stalls.read_interval_s(8192, min_seconds=20) == 2.0
    assert stalls.read_interval_s(8192, min_seconds=3) == 1.0


def test_the_report_puts_a_nodes_ranks_together_and_says_where_the_dumps_are():
    stall = stalls.Stall(
        group=GROUP,
        step=7,
        waited_s=12.34,
        laggards=(stalls.Laggard(3, "demo-worker-1", "u1"), stalls.Laggard(2, "demo-worker-1", "u1")),
    )
    assert stalls.stalled_report(stall, "/ckpt/diagnostics") == [
        {
            "node": "demo-worker-1",
            "podUid": "u1",
            "ranks": [2, 3],
            "step": 7,
            "waitedSeconds": 12.3,
            "diagnostics": "/ckpt/diagnostics/demo-worker-1/stall-7-rank*",
        }
    ]


class BeaconStore(HashStore):
    """torch's in-memory store in place of the job's, with the ranks' beacons put as the trainers write them."""

    def put(self, b: keys.StepBeacon) -> None:
        self.set(keys.beacon_key(b.rank), b.model_dump_json())


def test_the_watch_learns_the_step_time_reports_after_the_dump_grace_and_holds_the_stall_until_it_resolves():
    store = BeaconStore()
    watch = stalls.StallWatch(store)
    settings: dict = {"factor": 3.0, "min_seconds": 2.0, "quiet": False, "directory": "/d"}
    for step in range(1, 5):  # 0.5 s steps on every rank's own clock
        for rank in range(3):
            store.put(beacon(rank, step, time=step * 0.5))
        assert watch.report(now=float(step), **settings) == (None, None)
    assert watch.median_s == 0.5
    store.put(beacon(0, 5, time=2.5))
    store.put(beacon(2, 5, time=2.5))  # rank 1 never reaches step 5
    watch.report(now=5.0, **settings)
    report, found = watch.report(now=7.0, **settings)  # waited 2 s: the floor
    assert report is None and found is not None and found.step == 5, "found: the ranks dump first"
    report, found = watch.report(now=7.5, **settings)
    assert found is None and report is None, "within the dump grace"
    report, _ = watch.report(now=9.0, **settings)
    assert report is not None and [(e["node"], e["ranks"], e["waitedSeconds"]) for e in report] == [
        ("demo-worker-1", [1], 2.0)
    ]
    report, _ = watch.report(now=12.0, **{**settings, "quiet": True})
    assert report is not None, "held while the operator's directive is in flight"
    store.put(beacon(0, 6, group="10.0.0.2:4242", world=2, time=20.0))  # the group re-formed without it
    assert watch.report(now=13.0, **settings) == (None, None)


class TamperedStore(BeaconStore):
    """As the signed store behaves: a garbled beacon reads as absent, and each refusal is counted."""

    def __init__(self) -> None:
        super().__init__()
        self.garbled: set[str] = set()
        self.refused = 0

    def check(self, keys_: list[str]) -> bool:
        if any(k in self.garbled for k in keys_):
            self.refused += 1
            return False
        return super().check(keys_)

    def tamper_counts(self) -> dict[str, int]:
        return {"s-prefix/" + keys.BEACON_PREFIX + "1": self.refused}


SETTINGS = {"factor": 3.0, "min_seconds": 1.0, "quiet": False, "directory": "/ckpt/diagnostics"}
"""Median step 0.5 s: a stall threshold of max(1, 3 x 0.5) = 1.5 s."""


def _trained(store: TamperedStore, watch: stalls.StallWatch, steps: int = 4) -> float:
    """Every rank through ``steps`` steps of 0.5 s, read as they go; returns the time after."""
    now = 0.0
    for step in range(1, steps + 1):
        for rank in range(3):
            store.put(beacon(rank, step, time=step * 0.5))
        now += 1.0
        watch.report(now=now, **SETTINGS)
    return now


def test_garbled_beacons_of_a_healthy_rank_never_name_it_stalled():
    store = TamperedStore()
    watch = stalls.StallWatch(store)
    now = _trained(store, watch)
    for rank in range(3):
        store.put(beacon(rank, 5, time=2.5))  # every rank reaches step 5: nobody lags
    store.garbled.add(keys.beacon_key(1))  # but rank 1's beacon is garbled: it reads as if still at step 4
    for _ in range(20):
        now += 1.0
        assert watch.report(now=now, **SETTINGS) == (None, None), f"a verdict at {now} while tampered with"
    store.garbled.clear()
    for _ in range(5):
        now += 1.0
        assert watch.report(now=now, **SETTINGS) == (None, None), "rank 1 reached step 5: no stall"


def test_a_real_laggard_is_named_only_after_the_tampering_stops_and_the_hold_passes():
    store = TamperedStore()
    watch = stalls.StallWatch(store)
    now = _trained(store, watch)
    store.put(beacon(0, 5, time=2.5))
    store.put(beacon(2, 5, time=2.5))  # rank 1 really hangs at step 4
    store.garbled.add(keys.beacon_key(1))
    for _ in range(6):
        now += 1.0
        assert watch.report(now=now, **SETTINGS)[1] is None, "no verdict without a verified read of the laggard"
    store.garbled.clear()
    now += 1.0
    assert watch.report(now=now, **SETTINGS)[1] is None, "held for one threshold after the last tampering"
    found = None
    for _ in range(4):
        now += 1.0
        found = found or watch.report(now=now, **SETTINGS)[1]
    assert found is not None and [lag.rank for lag in found.laggards] == [1]
