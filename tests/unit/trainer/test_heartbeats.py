"""The job agent's silence detection: the restricted decoder of torch's rendezvous state and the silence rule."""

from __future__ import annotations

import base64
import dataclasses
import os
import pickle
from datetime import datetime, timedelta, timezone

import pytest
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dyn

from disttrain.api.spec import RendezvousSpec
from disttrain.trainer.agent import heartbeats as hb

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def encoded(state: object) -> bytes:
    """As C10dRendezvousBackend stores it: base64 of the pickle."""
    return base64.b64encode(pickle.dumps(state))


def torch_state(
    round_: int = 1, beats: dict[dyn._NodeDesc, float] | None = None, **extra: object
) -> dyn._RendezvousState:
    state = dyn._RendezvousState()
    state.round, state.complete = round_, True
    for rank, (node, seconds) in enumerate((beats or {}).items()):
        state.participants[node] = rank
        state.last_heartbeats[node] = T0 + timedelta(seconds=seconds)
    state.wait_list.add(dyn._NodeDesc("waiting", 9, 0))
    for key, value in extra.items():
        setattr(state, key, value)
    return state


A, B, C = dyn._NodeDesc("a", 1, 0), dyn._NodeDesc("b", 2, 0), dyn._NodeDesc("c", 3, 0)


def test_decodes_torchs_own_state() -> None:
    view = hb.decode_state(encoded(torch_state(4, {A: 0.0, B: 1.5})))
    assert view is not None
    assert view.round == 4 and view.complete and not view.closed
    assert view.participants == {repr(A), repr(B)}
    assert view.heartbeats[repr(B)] == T0 + timedelta(seconds=1.5)


def test_null_sentinel_is_no_state() -> None:
    assert hb.decode_state(b"Y2FuaW1hZGFt") is None


class Boom:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, ("echo pwned",))


@pytest.mark.parametrize(
    "payload",
    [
        Boom(),  # a classic code-execution pickle
        {"participants": {}, "last_heartbeats": {}},  # not a rendezvous state
        torch_state(1, {A: 0.0}, participants=Boom()),  # the right class wrapping a foreign object
    ],
)
def test_refuses_a_foreign_pickle(payload: object) -> None:
    with pytest.raises(hb.StateRefused):
        hb.decode_state(encoded(payload))


def test_refuses_garbage() -> None:
    with pytest.raises(hb.StateRefused):
        hb.decode_state(b"!!! not base64")
    with pytest.raises(hb.StateRefused):
        hb.decode_state(base64.b64encode(b"\x80\x04not a pickle"))


def view(round_: int, beats: dict[dyn._NodeDesc, float], *, complete: bool = True) -> hb.RendezvousView:
    return hb.RendezvousView(
        round=round_,
        complete=complete,
        closed=False,
        participants=frozenset(repr(n) for n in beats),
        heartbeats={repr(n): T0 + timedelta(seconds=s) for n, s in beats.items()},
    )


def test_a_participant_three_intervals_behind_the_newest_heartbeat_is_silent() -> None:
    tracker = hb.SilenceTracker(interval_s=1, max_attempts=3)
    assert tracker.observe(view(1, {A: 10, B: 10, C: 10}), now=0) == {}
    assert tracker.observe(view(1, {A: 12, B: 12, C: 10}), now=2) == {}  # 2 s behind: not yet
    assert tracker.observe(view(1, {A: 13, B: 13, C: 10}), now=3) == {repr(C): T0 + timedelta(seconds=10)}


def quarter_second_tracker() -> hb.SilenceTracker:
    """The spec's defaults: torch's heartbeats every second and its expiry at 3 s; the beats of
    :mod:`disttrain.trainer.launch.beat` every 0.1 s (the views below carry the freshest of both); silence 1 s."""
    rdzv = RendezvousSpec()
    assert (rdzv.keep_alive_interval_seconds * rdzv.keep_alive_max_attempts, rdzv.silent_after_seconds) == (3, 1.0)
    return hb.SilenceTracker(
        rdzv.keep_alive_interval_seconds, rdzv.keep_alive_max_attempts, silence_s=rdzv.silent_after_seconds
    )


def test_with_quarter_second_heartbeats_a_node_of_a_calm_round_is_silent_after_one_second() -> None:
    tracker = quarter_second_tracker()
    assert tracker.observe(view(1, {A: 10, B: 10, C: 10}), now=0) == {}
    assert tracker.observe(view(1, {A: 13, B: 13, C: 13}), now=3) == {}  # the round has been as it is for 3 s
    assert tracker.observe(view(1, {A: 13.75, B: 13.5, C: 13}), now=3.75) == {}  # 3 heartbeats late: not yet
    assert tracker.observe(view(1, {A: 14, B: 14, C: 13}), now=4) == {repr(C): T0 + timedelta(seconds=13)}


def test_a_node_whose_launcher_said_it_is_leaving_is_judged_at_torchs_expiry_not_after_one_second() -> None:
    """A crashed worker's launcher shuts down (its last beat says so) before its pod's exit is seen: that exit, not a
    second of silence, must name the incident (PodFailed). A launcher that never exits is still caught."""
    tracker = quarter_second_tracker()
    tracker.observe(view(1, {A: 10, B: 10, C: 10}), now=0)
    tracker.observe(view(1, {A: 13, B: 13, C: 13}), now=3)  # a calm round
    leaving = frozenset({repr(C)})
    assert tracker.observe(view(1, {A: 14.5, B: 14.5, C: 13}), now=4.5, leaving=leaving) == {}
    assert set(tracker.observe(view(1, {A: 16, B: 16, C: 13}), now=6, leaving=leaving)) == {repr(C)}
    # Without the last beat, the same silence is a verdict after one second.
    silent = quarter_second_tracker()
    silent.observe(view(1, {A: 10, B: 10, C: 10}), now=0)
    silent.observe(view(1, {A: 13, B: 13, C: 13}), now=3)
    assert set(silent.observe(view(1, {A: 14.5, B: 14.5, C: 13}), now=4.5)) == {repr(C)}


def test_a_round_that_just_changed_is_judged_at_torchs_expiry() -> None:
    """Nodes that just joined start their workers (blocking store calls, a loaded machine): a second of silence
    then is no evidence; three are, as before sub-second heartbeats."""
    tracker = quarter_second_tracker()
    assert tracker.observe(view(1, {A: 10, B: 10, C: 10}), now=0) == {}
    assert tracker.observe(view(1, {A: 11.5, B: 11.5, C: 10}), now=1.5) == {}  # 1.5 s behind, 1.5 s into the round
    assert tracker.observe(view(1, {A: 13, B: 13, C: 10}), now=3) == {repr(C): T0 + timedelta(seconds=10)}


def test_survivors_leaving_a_round_after_a_failed_collective_leave_the_dead_node_judged_after_one_second() -> None:
    tracker = quarter_second_tracker()
    tracker.observe(view(1, {A: 10, B: 10, C: 10}), now=0)
    tracker.observe(view(1, {A: 13, B: 13, C: 13}), now=3)
    # C's process died (its peers' collectives failed at once): A left to re-join; its heartbeat stays in the state.
    leaving = view(1, {A: 13.5, B: 13.5, C: 13})
    leaving = dataclasses.replace(leaving, participants=frozenset({repr(B), repr(C)}))
    assert tracker.observe(leaving, now=3.5) == {}
    assert set(tracker.observe(view(1, {B: 14, C: 13}), now=4)) == {repr(C)}


def test_a_round_still_forming_is_judged_at_torchs_expiry_however_long_it_waits() -> None:
    """Nodes waiting in a join heartbeat only between its reads (torch stops the timer in ``next_rendezvous``)."""
    tracker = quarter_second_tracker()
    tracker.observe(view(0, {A: 10, B: 10}, complete=False), now=0)
    tracker.observe(view(0, {A: 15, B: 15}, complete=False), now=5)
    assert tracker.observe(view(0, {A: 17, B: 15.5}, complete=False), now=7) == {}
    assert set(tracker.observe(view(0, {A: 18.5, B: 15.5}, complete=False), now=8.5)) == {repr(B)}


def test_after_a_drain_or_reform_directive_the_round_is_judged_at_torchs_expiry_until_the_next_one() -> None:
    """A drained node exits without leaving the round (the survivors drop it when they re-join)."""
    tracker = quarter_second_tracker()
    tracker.observe(view(1, {A: 10, B: 10, C: 10}), now=0)
    tracker.observe(view(1, {A: 13, B: 13, C: 13}), now=3)
    tracker.directive_published()
    assert tracker.observe(view(1, {A: 20, B: 20, C: 19}), now=10) == {}  # still the directive's round
    tracker.observe(view(2, {A: 20.5, B: 20.5}), now=10.5)  # the drained C is out of the next round
    tracker.observe(view(2, {A: 23.5, B: 23.5}), now=13.5)
    assert set(tracker.observe(view(2, {A: 24.5, B: 23.5}), now=14.5)) == {repr(B)}  # a new round, calm again


def test_survivors_waiting_for_the_next_round_keep_the_newest_time_fresh_with_their_beats() -> None:
    """A killed node's peers see their collective fail and wait for the next round, out of the participants: their
    torch heartbeats come once a second, their beats ten times."""
    tracker = quarter_second_tracker()
    tracker.observe(view(1, {A: 10, B: 10, C: 10}), now=0)
    tracker.observe(view(1, {A: 13, B: 13, C: 13}), now=3)
    left = dataclasses.replace(view(1, {A: 13.1, B: 13.1, C: 13}), participants=frozenset({repr(C)}))
    assert tracker.observe(left, now=3.1) == {}
    beats = {repr(A): T0 + timedelta(seconds=14.05), repr(B): T0 + timedelta(seconds=14.05)}
    assert set(tracker.observe(hb.with_beats(left, beats), now=4.05)) == {repr(C)}


def test_after_a_verdict_the_others_are_judged_at_torchs_expiry_while_they_leave_for_the_reform() -> None:
    tracker = quarter_second_tracker()
    tracker.observe(view(1, {A: 10, B: 10, C: 10}), now=0)
    tracker.observe(view(1, {A: 13, B: 13, C: 13}), now=3)
    assert set(tracker.observe(view(1, {A: 14, B: 14, C: 13}), now=4)) == {repr(C)}
    # B stops its heartbeat timer to re-join (torch's next_rendezvous) a moment after the reform directive.
    assert set(tracker.observe(view(1, {A: 15.5, B: 14.25, C: 13}), now=5.5)) == {repr(C)}
    assert set(tracker.observe(view(1, {A: 17.5, B: 14.25, C: 13}), now=7.5)) == {repr(C), repr(B)}


def test_a_node_torch_dropped_for_silence_stays_reported() -> None:
    tracker = hb.SilenceTracker(interval_s=1, max_attempts=3)
    tracker.observe(view(1, {A: 10, B: 10, C: 10}), now=0)
    tracker.observe(view(1, {A: 12, B: 12, C: 10}), now=2)
    # A survivor's write removed C (expired) before the agent saw it 3 s behind.
    assert tracker.observe(view(1, {A: 12.5, B: 12.5}), now=2.5) == {repr(C): T0 + timedelta(seconds=10)}
    assert repr(C) in tracker.observe(view(2, {A: 14, B: 14}, complete=False), now=4)


def test_a_node_that_leaves_with_a_fresh_heartbeat_is_not_silent() -> None:
    tracker = hb.SilenceTracker(interval_s=1, max_attempts=3)
    tracker.observe(view(1, {A: 10, B: 10, C: 10}), now=0)
    assert tracker.observe(view(1, {A: 11, B: 11}), now=1) == {}  # C left to re-join (or exited)
    assert tracker.observe(view(2, {A: 15, B: 15}), now=5) == {}


def test_a_closed_rendezvous_reports_nobody() -> None:
    tracker = hb.SilenceTracker(interval_s=1, max_attempts=3)
    tracker.observe(view(1, {A: 10, B: 10, C: 10}), now=0)
    closed = hb.RendezvousView(1, True, True, frozenset({repr(A), repr(C)}), {repr(A): T0 + timedelta(seconds=20)})
    assert tracker.observe(closed, now=10) == {}


def test_a_state_put_back_with_an_older_heartbeat_is_no_evidence_of_silence() -> None:
    """A reader restored the state an outsider garbled from its own stale copy, and the others wrote their
    fresh heartbeats over it: C's heartbeat went back. That is a restore, not silence (no genuine write moves a
    heartbeat back); C's next keep-alive shows it alive."""
    tracker = hb.SilenceTracker(interval_s=1, max_attempts=3)
    tracker.observe(view(1, {A: 10, B: 10, C: 10}), now=0)
    tracker.observe(view(1, {A: 11, B: 11, C: 11}), now=1)
    assert tracker.observe(view(1, {A: 14, B: 14, C: 10}), now=4) == {}  # 4 s behind in this state alone
    assert tracker.observe(view(1, {A: 15, B: 15, C: 10}), now=5) == {}  # its freshest seen is 11: held anyway
    assert tracker.observe(view(1, {A: 16, B: 16, C: 15.5}), now=6) == {}
    assert not tracker.trusted(now=8.9) and tracker.trusted(now=9)  # (3 + 1) intervals after the last sign (5)


def test_no_verdict_while_tampered_with_but_a_node_still_silent_after_the_hold_is_reported() -> None:
    tracker = hb.SilenceTracker(interval_s=1, max_attempts=3)
    tracker.observe(view(1, {A: 10, B: 10, C: 10}), now=0)
    assert tracker.observe(view(1, {A: 11, B: 11, C: 10}), now=1, tampered=True) == {}
    assert tracker.observe(view(1, {A: 13, B: 13, C: 10}), now=3) == {}  # the old rule said silent here
    assert tracker.observe(view(1, {A: 14.9, B: 14.9, C: 10}), now=4.9) == {}
    assert tracker.observe(view(1, {A: 15, B: 15, C: 10}), now=5) == {repr(C): T0 + timedelta(seconds=10)}


def test_a_node_that_vanishes_while_the_state_is_tampered_with_is_never_judged() -> None:
    """torch's sanitizer may drop a live node on a heartbeat a restore put back: the agent does not fence it."""
    tracker = hb.SilenceTracker(interval_s=1, max_attempts=3)
    tracker.observe(view(1, {A: 10, B: 10, C: 10}), now=0)
    tracker.observe(view(1, {A: 11, B: 11, C: 10}), now=1, tampered=True)
    assert tracker.observe(view(1, {A: 12.5, B: 12.5}), now=2.5) == {}  # the old rule: C silent (2.5 s > 2 s)
    assert tracker.observe(view(1, {A: 20, B: 20}), now=10) == {}


def test_a_state_that_disappears_counts_as_tampering() -> None:
    """torch never deletes its state: one that was there and is gone (or the null sentinel again) was taken away."""
    tracker = hb.SilenceTracker(interval_s=1, max_attempts=3)
    tracker.observe(view(1, {A: 10, B: 10, C: 10}), now=0)
    assert tracker.observe(None, now=1) == {}
    assert tracker.observe(view(1, {A: 13, B: 13, C: 10}), now=3) == {}
    assert tracker.observe(view(1, {A: 15, B: 15, C: 10}), now=5) == {repr(C): T0 + timedelta(seconds=10)}


def test_report_names_pods_and_skips_unknown_nodes() -> None:
    silent = {repr(C): T0, repr(B): T0}
    report = hb.silent_report(silent, {repr(C): hb.NodeIdentity("job-worker-2", "uid-2"), repr(B): None})
    assert report == [{"node": "job-worker-2", "podUid": "uid-2", "lastHeartbeat": "2026-01-01T00:00:00.000Z"}]


def test_a_silence_report_is_written_at_once_not_with_the_periodic_progress() -> None:
    from disttrain.trainer.agent import reporting

    assert reporting.urgent_reason({"silentNodes": [{"node": "w"}]}, {}, {}) is not None
    assert reporting.urgent_reason({"silentNodes": None}, {"silentNodes": [{"node": "w"}]}, {}) is not None


def test_an_agent_started_beside_a_running_group_holds_its_verdicts_until_every_survivor_heartbeated() -> None:
    """Its predecessor was lost: the survivors put the state back with heartbeats as old as the outage and bring
    them forward one by one as each reconnects."""
    tracker = hb.SilenceTracker(interval_s=1, max_attempts=3, hold_first=True)
    assert tracker.observe(view(1, {A: 10, B: 10, C: 10}), now=0) == {}
    assert tracker.observe(view(1, {A: 30, B: 10, C: 10}), now=0.5) == {}  # A reconnected first
    assert tracker.observe(view(1, {A: 31, B: 31, C: 10}), now=1.5) == {}
    assert tracker.observe(view(1, {A: 33, B: 33, C: 10}), now=tracker.hold_s + 0.1) == {
        repr(C): T0 + timedelta(seconds=10)
    }  # C never came back: judged once the hold ended


@pytest.mark.parametrize(
    "raw", [b"", b"not json", b"[]", b'{"at": "1"}', b'{"at": true}', b'{"at": -1}', b'{"at": 1e308}', b'{"at": NaN}']
)
def test_a_beat_that_is_not_a_time_is_no_beat(raw: bytes) -> None:
    assert hb.parse_beat(raw) is None


def test_a_beat_raises_the_heartbeat_of_a_node_in_the_state_and_names_nobody_else() -> None:
    state = view(1, {A: 10, B: 10})
    waiting = {**state.heartbeats, repr(C): T0 + timedelta(seconds=10)}  # C waits for the next round
    state = dataclasses.replace(state, heartbeats=waiting)
    beats = {
        repr(A): T0 + timedelta(seconds=12),
        repr(B): T0 + timedelta(seconds=9),
        repr(C): T0 + timedelta(seconds=11),
    }
    merged = hb.with_beats(state, {**beats, "d_4_0": T0 + timedelta(seconds=20)})
    assert merged.heartbeats == {
        repr(A): T0 + timedelta(seconds=12),
        repr(B): T0 + timedelta(seconds=10),
        repr(C): T0 + timedelta(seconds=11),
    }
    assert hb.parse_beat(hb.encode_beat(1_800_000_000.25).encode()) == (1_800_000_000.25, False)


def test_a_last_beat_is_a_beat_that_says_so_and_nothing_else_does() -> None:
    last = hb.encode_beat(1_800_000_000.25, leaving=True).encode()
    assert hb.parse_beat(last) == (1_800_000_000.25, True)
    assert hb.parse_beat(hb.encode_beat(1_800_000_000.25).encode()) == (1_800_000_000.25, False)
    for raw in (b'{"leaving": true}', b'{"at": -1, "leaving": true}', b"garbage"):
        assert hb.parse_beat(raw) is None, raw
    assert hb.parse_beat(b'{"at": 5, "leaving": 1}') == (5.0, False)


def test_a_verdict_withdrawn_before_any_directive_leaves_the_round_as_calm_as_it_was() -> None:
    """A live node's beats late by over a second (a loaded machine) name it; it beats again and no reform starts.
    A node lost right after is then judged after one second, not at torch's expiry."""
    tracker = quarter_second_tracker()
    tracker.observe(view(1, {A: 10, B: 10, C: 10}), now=0)
    tracker.observe(view(1, {A: 13, B: 13, C: 13}), now=3)
    assert set(tracker.observe(view(1, {A: 14.1, B: 13, C: 14.1}), now=4.1)) == {repr(B)}  # late, not lost
    assert tracker.observe(view(1, {A: 14.2, B: 14.2, C: 14.2}), now=4.2) == {}  # B beats again: withdrawn
    assert set(tracker.observe(view(1, {A: 15.3, B: 15.3, C: 14.2}), now=5.3)) == {repr(C)}  # lost: after 1.1 s


def test_a_verdict_withdrawn_after_the_round_changed_does_not_bring_the_old_calm_back() -> None:
    tracker = quarter_second_tracker()
    tracker.observe(view(1, {A: 10, B: 10, C: 10}), now=0)
    tracker.observe(view(1, {A: 13, B: 13, C: 13}), now=3)
    assert set(tracker.observe(view(1, {A: 14.1, B: 14.1, C: 13}), now=4.1)) == {repr(C)}
    tracker.directive_published()  # the operator acted on it: the survivors leave for the reform
    assert tracker.observe(view(1, {A: 14.2, B: 14.2, C: 14.2}), now=4.2) == {}
    assert tracker.observe(view(1, {A: 15.5, B: 14.2, C: 15.5}), now=5.5) == {}, "the directive's round: torch's expiry"
