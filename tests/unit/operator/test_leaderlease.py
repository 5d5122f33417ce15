"""The leader election's rules: when a standby may take the Lease, when a leader must stop, and that the leader
always stops before any standby may take over, whatever the two clocks' offset."""

from __future__ import annotations

import pytest

from disttrain.operator import leaderlease
from disttrain.operator.leaderlease import ElectionTiming, Sighting

pytestmark = pytest.mark.timeout(30)
TIMING = ElectionTiming(lease_s=3.0, renew_deadline_s=2.0, retry_s=0.5)
HELD = {
    "holderIdentity": "op-a",
    "leaseDurationSeconds": 3,
    "acquireTime": "2026-12-06T22:00:00.000000Z",
    "renewTime": "2026-12-06T22:00:05.000000Z",
    "leaseTransitions": 4,
}


@pytest.mark.parametrize(
    ("lease", "renew", "retry"), [(3, 3, 0.5), (3, 2, 2), (3, 4, 0.5), (3, 2, 0), (2, 3, 1), (3, 2, -1)]
)
def test_timings_that_would_let_two_leaders_act_are_refused_with_the_rule(lease, renew, retry):
    with pytest.raises(ValueError, match=r"retry .* < renew deadline .* < lease"):
        ElectionTiming(lease_s=lease, renew_deadline_s=renew, retry_s=retry)


def test_the_lease_runs_from_when_the_standby_first_saw_the_record_not_from_its_timestamps():
    seen = leaderlease.observe(None, HELD, now=100.0)
    # the same record read again later: the lease keeps running from the first sighting
    assert leaderlease.observe(seen, dict(HELD), now=102.0) is seen
    assert not leaderlease.may_take(seen, "op-b", now=102.9, timing=TIMING)
    assert leaderlease.may_take(seen, "op-b", now=103.0, timing=TIMING)
    # a renewal (new renewTime) restarts it, however far in the past the leader's clock dated it
    renewed = leaderlease.observe(seen, {**HELD, "renewTime": "1999-01-01T00:00:00.000000Z"}, now=102.5)
    assert renewed.seen_at == 102.5
    assert not leaderlease.may_take(renewed, "op-b", now=105.0, timing=TIMING)


@pytest.mark.parametrize("holder", ["", "op-b"])
def test_a_free_lease_or_ones_own_is_taken_at_once(holder):
    seen = leaderlease.observe(None, {**HELD, "holderIdentity": holder}, now=100.0)
    assert leaderlease.may_take(seen, "op-b", now=100.0, timing=TIMING)


def test_a_leader_acts_only_within_the_renew_deadline_of_its_last_successful_renewal():
    assert not leaderlease.leading(None, now=5.0, timing=TIMING)
    assert leaderlease.leading(10.0, now=11.99, timing=TIMING)
    assert not leaderlease.leading(10.0, now=12.0, timing=TIMING)


@pytest.mark.parametrize("offset", [-3600.0, -1.5, 0.0, 0.7, 86400.0])
@pytest.mark.parametrize("delivery", [0.0, 0.3, 1.9])
@pytest.mark.parametrize("poll_lag", [0.0, 0.49])
def test_the_former_leader_has_stopped_before_a_standby_may_take_over(offset, delivery, poll_lag):
    """The leader's last renewal is sent at 50.0 on its clock and reaches the server ``delivery`` later; the
    standby's clock is ``offset`` away and reads the record ``poll_lag`` after that."""
    sent = 50.0
    stop = next(t / 100 for t in range(5000, 10000) if not leaderlease.leading(sent, t / 100, TIMING))
    seen_at = sent + delivery + poll_lag + offset  # the standby's clock
    sighting = Sighting("op-a", leaderlease.record_of(HELD), seen_at)
    # when the leader stops (on the standby's clock), the standby may not take the Lease yet, nor any time before
    assert not leaderlease.may_take(sighting, "op-b", stop + offset, TIMING), "two leaders would act at once"
    assert leaderlease.may_take(sighting, "op-b", seen_at + TIMING.lease_s, TIMING)


def test_a_takeover_counts_a_transition_and_a_renewal_keeps_the_acquire_time():
    taken = leaderlease.claimed(HELD, "op-b", wall=1_800_000_000.25, timing=TIMING)
    assert taken["holderIdentity"] == "op-b" and taken["leaseTransitions"] == 5
    assert taken["acquireTime"] == taken["renewTime"] == "2027-01-15T08:00:00.250000Z"
    assert taken["leaseDurationSeconds"] == 3
    renewed = leaderlease.claimed(taken, "op-b", wall=1_800_000_001.5, timing=TIMING)
    assert renewed["leaseTransitions"] == 5 and renewed["acquireTime"] == taken["acquireTime"]
    assert renewed["renewTime"] == "2027-01-15T08:00:01.500000Z"
    assert leaderlease.claimed({}, "op-a", wall=0.0, timing=TIMING)["leaseTransitions"] == 0


def test_a_released_lease_has_no_holder_and_is_taken_by_the_next_look():
    free = leaderlease.released(HELD)
    assert free["holderIdentity"] == "" and free["leaseTransitions"] == HELD["leaseTransitions"]
    assert leaderlease.may_take(leaderlease.observe(None, free, now=0.0), "op-b", now=0.0, timing=TIMING)
