"""The job agent's Lease renewals and the rule that finds it silent (operator/agentbeat.py): pure, on a clock."""

from __future__ import annotations

from disttrain.operator.agentbeat import GAP_FACTOR, AgentBeats
from disttrain.operator.observed import PodView

KEY = ("ns", "job")
SILENT_S = AgentBeats().silent_s  # three renewals of the default second
AGENT = PodView(name="job-agent", uid="uid-a")


def renew(beats: AgentBeats, at: float, holder: str = "uid-a") -> None:
    beats.renewed(KEY, {"spec": {"holderIdentity": holder, "renewTime": f"t{at}"}}, at)


def test_an_agent_that_stops_renewing_is_silent_after_silent_s_and_not_before():
    beats = AgentBeats()
    for at in (0.0, 1.0, 2.0):
        renew(beats, at)
    assert not beats.is_silent(KEY, AGENT, 2.0 + SILENT_S - 0.1)
    assert beats.is_silent(KEY, AGENT, 2.0 + SILENT_S + 0.1)


def test_one_renewal_a_lease_never_renewed_and_another_pods_beats_say_nothing():
    beats = AgentBeats()
    renew(beats, 0.0)
    assert not beats.is_silent(KEY, AGENT, 100.0), "one renewal: no gap known yet"
    beats.renewed(KEY, {"spec": {}}, 1.0)  # the operator's fresh Lease: no holder
    assert not beats.is_silent(KEY, AGENT, 100.0)
    renew(beats, 1.0)
    assert beats.is_silent(KEY, AGENT, 100.0)
    replacement = PodView(name="job-agent", uid="uid-b")
    assert not beats.is_silent(KEY, replacement, 100.0), "the old pod's silence is not its replacement's"
    assert not beats.is_silent(KEY, None, 100.0)


def test_slow_renewals_stretch_the_verdict():
    beats = AgentBeats()
    renew(beats, 0.0)
    renew(beats, 2.5)  # the API server took 2.5 s once
    assert not beats.is_silent(KEY, AGENT, 2.5 + SILENT_S + 1)
    assert beats.is_silent(KEY, AGENT, 2.5 + GAP_FACTOR * 2.5 + 0.1)


def test_a_new_holder_starts_over_and_a_deleted_lease_is_forgotten():
    beats = AgentBeats()
    renew(beats, 0.0)
    renew(beats, 1.0)
    renew(beats, 2.0, holder="uid-b")  # the replacement's first renewal
    assert not beats.is_silent(KEY, PodView(name="job-agent", uid="uid-b"), 50.0)
    renew(beats, 3.0, holder="uid-b")
    beats.forget(KEY)
    assert not beats.is_silent(KEY, PodView(name="job-agent", uid="uid-b"), 50.0)


def test_each_silence_is_announced_once_and_again_after_a_renewal():
    beats = AgentBeats()
    renew(beats, 0.0)
    renew(beats, 1.0)

    def agent_of(key):
        return AGENT if key == KEY else None

    assert beats.newly_silent(agent_of, 2.0) == []
    assert beats.newly_silent(agent_of, 1.0 + SILENT_S + 0.1) == [KEY]
    assert beats.newly_silent(agent_of, 1.0 + SILENT_S + 0.6) == [], "announced already"
    renew(beats, 10.0)  # back (a gap of 9 s): silent again only after 3 x 9 s
    assert beats.newly_silent(agent_of, 10.0 + GAP_FACTOR * 9.0 - 0.1) == []
    assert beats.newly_silent(agent_of, 10.0 + GAP_FACTOR * 9.0 + 0.1) == [KEY]


def test_the_least_silence_is_three_renewal_periods():
    assert AgentBeats(1.0).silent_s == 3.0 and AgentBeats(5.0).silent_s == 15.0
