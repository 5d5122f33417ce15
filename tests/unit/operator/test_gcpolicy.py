"""The operator's garbage-collector policy: long-lived objects frozen out of the scans, and a full collection
now and then so that cycles which became garbage after a freeze are still reclaimed."""

from __future__ import annotations

import gc
import weakref

from disttrain.operator import gcpolicy


class Node:
    def __init__(self) -> None:
        self.partner: object = None


def test_the_schedule_freezes_every_interval_and_collects_everything_every_hour():
    schedule = gcpolicy.FreezeSchedule(freeze_every_s=30, collect_every_s=3600)  # explicit: not the defaults
    assert schedule.due(0.0) == "freeze"  # at once: the objects of the start (imports, first listings)
    assert schedule.due(29.0) is None
    assert schedule.due(30.0) == "freeze"
    actions = [schedule.due(float(t)) for t in range(31, 3601)]
    assert actions.count("freeze") == 118 and actions[-1] == "collect"
    assert schedule.due(3601.0) is None  # the collection froze too


def test_a_frozen_cycle_is_left_alone_until_the_full_collection_reclaims_it():
    gc.collect()
    try:
        a, b = Node(), Node()
        a.partner, b.partner = b, a  # a reference cycle: only the cyclic collector can free it
        alive = weakref.ref(a)
        plain = Node()  # no cycle
        plain_ref = weakref.ref(plain)
        gcpolicy.act("freeze")
        assert gc.get_freeze_count() > 0
        del a, b
        gc.collect()
        assert alive() is not None, "frozen: no collection looks at it"
        del plain
        assert plain_ref() is None, "reference counting still frees a frozen object without a cycle"
        pause = gcpolicy.act("collect")
        assert alive() is None and pause >= 0
        assert gc.get_freeze_count() > 0, "frozen again after the collection"
    finally:
        gc.unfreeze()
