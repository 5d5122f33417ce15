"""The phases of a reform: contiguous, never negative, adding up to the total, whatever the clocks say."""

from __future__ import annotations

import pytest

from disttrain.api.reformphases import ReformPhase, WorkerStartup, compute_phases

FULL = WorkerStartup(
    old_exit_first=99.5,
    old_exit_last=100.5,
    spawned=101.5,
    imported=102.5,
    setup_begin=103.0,
    group_ready=103.25,
    resumed=103.75,
    first_step=104.0,
)


def test_unplanned_reform_starts_at_the_first_sign_of_the_loss() -> None:
    phases = compute_phases(100.0, FULL, planned=False)
    assert phases.seconds() == {
        ReformPhase.DETECTION: 0.5,
        ReformPhase.DIRECTIVE: 0.5,
        ReformPhase.RESTART: 1.0,
        ReformPhase.IMPORTS: 1.0,
        ReformPhase.MODEL_BUILD: 0.5,
        ReformPhase.PROCESS_GROUP: 0.25,
        ReformPhase.CHECKPOINT_LOAD: 0.5,
        ReformPhase.FIRST_STEP: 0.25,
    }
    assert phases.total == 4.5


def test_planned_reform_starts_at_the_directive() -> None:
    phases = compute_phases(100.0, FULL, planned=True)
    assert phases.detection == 0.0
    assert phases.total == 4.0
    assert sum(phases.seconds().values()) == pytest.approx(4.0)


def test_skewed_and_missing_stamps_never_make_a_phase_negative() -> None:
    # The old workers "exited" before the directive on a planned drain (clock skew), no import stamp, and a
    # resume stamp after the first step.
    odd = WorkerStartup(old_exit_last=98.0, spawned=101.0, setup_begin=102.0, resumed=106.0, first_step=105.0)
    phases = compute_phases(100.0, odd, planned=True)
    seconds = phases.seconds()
    assert all(s >= 0 for s in seconds.values())
    assert seconds[ReformPhase.DIRECTIVE] == 0.0
    assert seconds[ReformPhase.IMPORTS] == 0.0  # missing: its time went to the next phase with a stamp
    assert seconds[ReformPhase.MODEL_BUILD] == 1.0
    assert seconds[ReformPhase.FIRST_STEP] == 0.0
    assert sum(seconds.values()) == pytest.approx(phases.total) == 5.0


def test_no_first_step_yet_gives_zero_phases() -> None:
    phases = compute_phases(100.0, WorkerStartup(spawned=101.0), planned=False)
    assert phases.total == 0.0 and set(phases.seconds().values()) == {0.0}


def test_wire_names_are_the_phase_values() -> None:
    wire = compute_phases(100.0, FULL, planned=False).model_dump(by_alias=True)
    assert set(wire) == {p.value for p in ReformPhase} | {"total"}
    assert "modelBuild" in compute_phases(100.0, FULL, planned=False).describe()


def test_startup_times_are_bounded() -> None:
    with pytest.raises(ValueError, match="spawned"):
        WorkerStartup.model_validate({"spawned": float("inf")})
    with pytest.raises(ValueError, match="firstStep"):
        WorkerStartup.model_validate({"firstStep": -1.0})
