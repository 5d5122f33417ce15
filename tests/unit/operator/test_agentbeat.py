"""The job agent's pulse and Lease renewals and the rules that find it silent (operator/agentbeat.py): pure, on a
clock."""

from __future__ import annotations

from disttrain.operator.agentbeat import GAP_FACTOR, HUNG_S, LEASE, PROBE_AFTER_S, PULSE, STALL_S, AgentBeats
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
    assert beats.newly_silent(agent_of, 1.0 + SILENT_S + 0.1) == [(KEY, LEASE)]
    assert beats.newly_silent(agent_of, 1.0 + SILENT_S + 0.6) == [], "announced already"
    renew(beats, 10.0)  # back (a gap of 9 s): silent again only after 3 x 9 s
    assert beats.newly_silent(agent_of, 10.0 + GAP_FACTOR * 9.0 - 0.1) == []
    assert beats.newly_silent(agent_of, 10.0 + GAP_FACTOR * 9.0 + 0.1) == [(KEY, LEASE)]


def test_the_least_silence_is_three_renewal_periods():
    assert AgentBeats(1.0).silent_s == 3.0 and AgentBeats(5.0).silent_s == 15.0


PULSE_S = 0.2
PULSE_SILENT_S = AgentBeats().pulse_silent_s


def pulse(beats: AgentBeats, start: float, end: float, uid: str = "uid-a") -> float:
    """Pulses every PULSE_S from ``start`` to ``end``, the adapter checking every 0.1 s; the last pulse's time."""
    at, last = start, start
    while at <= end + 1e-9:
        beats.checked(at)
        if abs((at - start) / PULSE_S - round((at - start) / PULSE_S)) < 1e-6:
            beats.pulsed(KEY, uid, at)
            last = at
        at = round(at + 0.1, 6)
    return last


def test_a_stopped_pulse_is_silent_after_a_second_before_the_lease_and_says_why():
    beats = AgentBeats()
    renew(beats, 0.0)
    renew(beats, 1.0)
    last = pulse(beats, 0.0, 2.0)
    for at in (2.1, 2.2, 2.3, 2.4, 2.5, 2.6, 2.7, 2.8, 2.9, 3.0):
        beats.checked(at)
        assert not beats.is_silent(KEY, AGENT, at), at
    beats.checked(last + PULSE_SILENT_S + 0.1)
    assert beats.silence(KEY, AGENT, last + PULSE_SILENT_S + 0.1) == PULSE
    assert beats.newly_silent(lambda key: AGENT, last + PULSE_SILENT_S + 0.1) == [(KEY, PULSE)]
    assert beats.newly_silent(lambda key: AGENT, last + PULSE_SILENT_S + 0.2) == [], "announced already"


def test_one_pulse_or_another_pods_pulse_judges_nothing_and_the_lease_still_does():
    beats = AgentBeats()
    beats.pulsed(KEY, "uid-a", 0.0)
    assert beats.silence(KEY, AGENT, 50.0) == "", "one pulse: no stream known yet"
    pulse(beats, 0.0, 1.0, uid="uid-old")  # the agent it replaced
    assert beats.silence(KEY, AGENT, 50.0) == ""
    renew(beats, 0.0)
    renew(beats, 1.0)
    assert beats.silence(KEY, AGENT, 50.0) == LEASE
    assert beats.silence(KEY, None, 50.0) == ""


def test_a_stall_of_the_operator_is_not_the_agents_silence():
    beats = AgentBeats()
    last = pulse(beats, 0.0, 1.0)
    stalled_until = last + PULSE_SILENT_S + 2.0  # the operator's loop did not run for 3 s
    beats.checked(stalled_until)
    assert stalled_until - 1.0 > STALL_S
    assert not beats.is_silent(KEY, AGENT, stalled_until), "the pulses sent meanwhile are not read yet"
    beats.pulsed(KEY, "uid-a", stalled_until + 0.01)  # ...and here they are
    assert not beats.is_silent(KEY, AGENT, stalled_until + 0.5)
    beats.checked(stalled_until + 0.1)
    assert beats.is_silent(KEY, AGENT, stalled_until + 0.01 + PULSE_SILENT_S + 0.05), "dead after the stall: found"


def test_a_pulse_that_comes_back_is_announced_again_and_a_deleted_job_is_forgotten():
    beats = AgentBeats()
    last = pulse(beats, 0.0, 1.0)
    assert beats.newly_silent(lambda key: AGENT, last + PULSE_SILENT_S + 0.05) == [(KEY, PULSE)]
    last = pulse(beats, 5.0, 6.0)
    assert beats.newly_silent(lambda key: AGENT, last + PULSE_SILENT_S - 0.05) == []
    assert beats.newly_silent(lambda key: AGENT, last + PULSE_SILENT_S + 0.05) == [(KEY, PULSE)]
    beats.forget_job(KEY)
    assert beats.silence(KEY, AGENT, 100.0) == ""


def test_an_agent_that_said_it_stops_is_not_silent_until_it_pulses_again():
    beats = AgentBeats()
    last = pulse(beats, 0.0, 1.0)
    beats.ended(KEY, "uid-other")  # another pod's word counts for nothing
    beats.ended(KEY, "uid-a")
    assert beats.silence(KEY, AGENT, last + 10) == ""
    last = pulse(beats, 20.0, 21.0)
    assert beats.silence(KEY, AGENT, last + PULSE_SILENT_S + 0.05) == PULSE


def test_a_silent_pulse_whose_node_answers_a_probe_is_starved_not_lost_until_it_is_hung():
    beats = AgentBeats()
    last = pulse(beats, 0.0, 1.0)
    assert beats.to_probe(last + PROBE_AFTER_S - 0.05) == []
    assert beats.to_probe(last + PROBE_AFTER_S + 0.05) == [(KEY, "uid-a")]
    assert beats.to_probe(last + PROBE_AFTER_S + 0.15) == [], "one probe at a time"
    beats.probed(KEY, "uid-a", last + PROBE_AFTER_S + 0.05, answered=True)
    began = last + PROBE_AFTER_S + 0.05
    assert not beats.is_silent(KEY, AGENT, last + PULSE_SILENT_S + 0.1), "its node answered: starved, alive"
    # Each answer counts as a sign of life from when its probe began; one that is not answered does not.
    assert beats.to_probe(began + PROBE_AFTER_S + 0.05) == [(KEY, "uid-a")]
    beats.probed(KEY, "uid-a", began + PROBE_AFTER_S + 0.05, answered=False)
    assert not beats.is_silent(KEY, AGENT, began + PULSE_SILENT_S - 0.05)
    assert beats.silence(KEY, AGENT, began + PULSE_SILENT_S + 0.05) == PULSE


def test_an_agent_whose_node_answers_but_that_never_pulses_again_is_hung_and_silent():
    beats = AgentBeats()
    last = pulse(beats, 0.0, 1.0)
    at = last
    while at < last + HUNG_S - 0.2:
        at = round(at + 0.1, 6)
        for key, uid in beats.to_probe(at):
            beats.probed(key, uid, at, answered=True)
        assert not beats.is_silent(KEY, AGENT, at), at
    assert beats.is_silent(KEY, AGENT, last + HUNG_S + 0.05)


def test_probes_of_another_pod_or_of_an_agent_that_said_it_stops_count_for_nothing():
    beats = AgentBeats()
    last = pulse(beats, 0.0, 1.0)
    beats.probed(KEY, "uid-old", last + 0.6, answered=True)
    assert beats.is_silent(KEY, AGENT, last + PULSE_SILENT_S + 0.05)
    beats.ended(KEY, "uid-a")
    assert beats.to_probe(last + 5.0) == []
