"""Events at a sane rate: repeats within the window are dropped, and each job has a budget (client-go's rules)."""

from __future__ import annotations

import pytest

from disttrain.operator.eventrate import EventFilter

pytestmark = pytest.mark.timeout(30)


def key(message="m", job="j", reason="DrainTimeout"):
    return ("ns", job, "Warning", reason, message)


def test_a_repeat_within_the_window_is_dropped_and_posted_again_after_it():
    events = EventFilter(repeat_window_s=600)
    assert events.admit(key(), 0.0)
    assert not events.admit(key(), 1.0) and not events.admit(key(), 599.0)
    assert events.admit(key(), 600.0)
    assert events.dropped == 2


def test_different_messages_reasons_and_jobs_are_not_repeats():
    events = EventFilter()
    assert all(events.admit(k, 0.0) for k in (key("a"), key("b"), key(reason="Other"), key(job="k")))


def test_a_job_posting_distinct_events_is_held_to_its_budget_which_refills():
    events = EventFilter(burst=5, refill_s=10)
    posted = sum(events.admit(key(str(i)), 0.0) for i in range(20))
    assert posted == 5
    assert events.admit(key("other job", job="k"), 0.0), "one job's budget is not another's"
    assert not events.admit(key("x"), 9.0)
    assert events.admit(key("y"), 10.0)


def test_a_reconcile_loop_repeating_one_decision_posts_it_once():
    """The core repeats a few events while a state lasts (a drain timeout until its victims are gone)."""
    events = EventFilter()
    posted = [events.admit(key("no checkpoint within drainTimeoutSeconds; deleting w-3"), t * 0.5) for t in range(100)]
    assert posted.count(True) == 1


def test_the_cores_repeated_drain_timeout_reaches_the_events_api_once():
    """The gap the filter closes: the core decides DrainTimeout again on every reconcile while its victim is still
    Terminating; the adapter's filter lets the first through."""
    from tests.unit.operator.world import World, job_manifest

    world = World(job_manifest(replicas=3)).running_world(3)
    world.spec("nodes.replicas", 2).step(0)
    world.step(10)  # the debounce stood: drain
    events = EventFilter()
    posted = []
    for _ in range(5):
        world.step(60)
        for event in world.last.events:
            if events.admit(("default", "demo", event.type, event.reason, event.message), world.now):
                posted.append(event.reason)
    decided = [reason for reason, _ in world.events].count("DrainTimeout")
    assert decided >= 2, world.events
    assert posted.count("DrainTimeout") == 1
