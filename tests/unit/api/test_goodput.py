"""Goodput by cause: every second of wall time goes to one cause, the account survives a restarted operator (it is
all in the status), and no cause ever shrinks (the Prometheus counter by cause follows it)."""

from __future__ import annotations

import itertools
import math
import random
from typing import Optional

import pytest

from disttrain.api.goodput import Cause, Facts, GoodputStatus, Reform, account
from disttrain.api.reformphases import WorkerStartup, compute_phases

RUNNING = {"started": 0.0, "suspended": False, "finished_at": None, "reforming": False, "training": True}


def facts(now: float, **changes: object) -> Facts:
    base: dict[str, object] = {"now": now, "created": 0.0, **RUNNING}
    base.update(changes)
    return Facts(**base)  # type: ignore[arg-type]


def run(*steps: Facts, start: Optional[GoodputStatus] = None, reread: bool = True) -> list[GoodputStatus]:
    """The account after each reconcile; with ``reread``, each one read back from its wire form (as the next
    reconcile reads the status)."""
    out, account_so_far = [], start
    for f in steps:
        account_so_far = account(account_so_far, f)
        if reread:
            account_so_far = GoodputStatus.model_validate(account_so_far.to_wire())
        out.append(account_so_far)
    return out


def seconds(status: GoodputStatus) -> dict[str, float]:
    return {c.value: s for c, s in status.seconds.by_cause().items() if s}


def assert_partition(status: GoodputStatus) -> None:
    assert status.since is not None and status.accounted_until is not None
    assert math.isclose(status.seconds.total(), status.wall_seconds, abs_tol=1e-6)
    assert math.isclose(status.wall_seconds, status.accounted_until - status.since, abs_tol=2e-3)


def test_queued_then_startup_then_training():
    history = run(
        facts(5.0, started=None, suspended=True, training=False),  # created suspended: in a queue
        facts(8.0, started=5.0, training=False),  # admitted: pods start
        facts(10.0, step=1, last_progress=10.0, round=1, round_start=10.0),
        facts(21.0, step=11, last_progress=20.0, round=1, round_start=10.0),
    )
    final = history[-1]
    assert seconds(final) == {"queued": 5.0, "startup": 5.0, "training": 10.0}
    assert final.wall_seconds == 20.0 and final.ratio == 0.5
    assert final.accounted_until == 20.0  # the second after the last progress report waits for its cause


def _training_until_loss() -> list[Facts]:
    return [
        facts(0.5, started=0.0, training=False),
        facts(2.0, step=1, last_progress=2.0, round=1, round_start=2.0),
        facts(30.5, step=20, last_progress=30.0, round=1, round_start=2.0),
    ]


def _reform(reason: str, *, phases: bool = True) -> Reform:
    startup = WorkerStartup(
        old_exit_first=31.0,
        old_exit_last=32.5,
        spawned=33.0,
        imported=34.0,
        setup_begin=35.0,
        group_ready=35.5,
        resumed=36.0,
        first_step=37.0,
    )
    return Reform(
        count=1,
        start=31.0,
        duration_seconds=6.0,
        phases=compute_phases(32.0, startup, planned=False) if phases else None,
        reason=reason,
    )


def test_a_reform_goes_to_its_phases_and_the_steps_run_again_are_redone():
    after = {"round": 2, "round_start": 37.0, "resumed_from_step": 10, "reform": _reform("NodeNotReady")}
    history = run(
        *_training_until_loss(),
        facts(
            32.5,
            step=20,
            last_progress=30.0,
            round=1,
            reforming=True,
            training=False,
            reform=Reform(count=1, start=31.0),
        ),
        facts(38.0, step=11, last_progress=37.0, **after),
        facts(52.0, step=25, last_progress=51.0, **after),
    )
    during = history[3]
    assert during.accounted_until == 30.0  # nothing settled while the reform runs
    final = history[-1]
    assert_partition(final)
    got = seconds(final)
    assert got.pop("startup") == 2.0
    assert got.pop("training") == pytest.approx(28.0 + 14.0 * 5 / 14)
    # [30, 31]: the step in flight when the node was lost; [37, 51]: steps 11..20 again (9 of the 14 run after 37,
    # and step 11 itself, run at 37 within the reform's first step).
    assert got.pop("redone") == pytest.approx(1.0 + 14.0 * 9 / 14)
    assert got == {
        "detection": 1.0,
        "directive": 0.5,
        "restart": 0.5,
        "imports": 1.0,
        "modelBuild": 1.0,
        "processGroup": 0.5,
        "checkpointLoad": 0.5,
        "firstStep": 1.0,
    }
    assert final.highest_step == 25 and final.reforms == 1


def test_steps_not_yet_written_when_a_reform_starts_stay_training():
    """The account is written only now and then: a reform that starts after steps it has not written settles those
    steps first, so they are not taken for the step in flight."""
    written = run(*_training_until_loss()[:2])[-1]  # the account as last written: step 1 at 2 s
    reform = Reform(count=1, start=31.0)
    stopped = facts(32.5, step=20, last_progress=30.0, round=1, reforming=True, training=False, reform=reform)
    during = account(written, stopped)
    assert seconds(during) == {"startup": 2.0, "training": 28.0}
    after = {"round": 2, "round_start": 37.0, "resumed_from_step": 20, "reform": _reform("NodeNotReady")}
    final = account(during, facts(38.0, step=21, last_progress=37.0, **after))
    assert seconds(final)["redone"] == 1.0 and seconds(final)["training"] == 28.0


def test_a_stalled_step_is_the_wait_before_the_eviction():
    after = {"round": 2, "round_start": 37.0, "resumed_from_step": 20, "reform": _reform("StepStalled")}
    final = run(*_training_until_loss(), facts(38.0, step=21, last_progress=37.0, **after))[-1]
    assert seconds(final)["stalled"] == 1.0
    assert "redone" not in seconds(final)


def test_a_reform_without_startup_stamps_is_one_reform_span():
    after = {"round": 2, "round_start": 37.0, "resumed_from_step": 20, "reform": _reform("PodFailed", phases=False)}
    final = run(*_training_until_loss(), facts(38.0, step=21, last_progress=37.0, **after))[-1]
    assert seconds(final)["reform"] == 6.0
    assert not {c.value for c in Cause if c.value in ("detection", "restart", "firstStep")} & set(seconds(final))


def test_seconds_blocked_on_checkpoints_come_out_of_training():
    final = run(
        facts(0.0, training=False),
        facts(2.0, step=1, last_progress=2.0, round=1, round_start=2.0, checkpoint_blocked_seconds=0.0),
        facts(12.0, step=11, last_progress=12.0, round=1, round_start=2.0, checkpoint_blocked_seconds=1.5),
        facts(22.0, step=21, last_progress=22.0, round=1, round_start=2.0, checkpoint_blocked_seconds=2.0),
    )[-1]
    assert seconds(final) == {"startup": 2.0, "training": 18.0, "checkpointBlocked": 2.0}


def test_suspended_after_the_start_then_finished():
    history = run(
        facts(0.0, training=False),
        facts(2.0, step=1, last_progress=2.0, round=1, round_start=2.0),
        facts(10.5, step=9, last_progress=10.0, round=1, round_start=2.0),
        facts(20.0, step=9, last_progress=10.0, round=1, suspended=True, training=False),
        facts(25.0, step=9, last_progress=10.0, round=1, training=False),
        facts(27.0, step=10, last_progress=27.0, round=2, round_start=27.0, resumed_from_step=9),
        facts(40.0, step=20, last_progress=38.0, round=2, round_start=27.0, finished_at=39.5, training=False),
        facts(60.0, step=20, last_progress=38.0, round=2, round_start=27.0, finished_at=39.5, training=False),
    )
    final = history[-1]
    assert final == history[-2]  # a finished job's account is closed
    # startup: before the first step, while pending after the resume, and up to the new group's first step
    assert seconds(final) == {"startup": 9.0, "training": 19.0, "suspended": 10.0, "finishing": 1.5}
    assert final.wall_seconds == 39.5


def test_the_account_starts_at_the_creation_and_never_passes_now():
    first = account(None, facts(3.0, created=1.0, started=None, training=False))
    assert (first.since, first.accounted_until, seconds(first)) == (1.0, 3.0, {"queued": 2.0})
    early = account(first, facts(4.0, step=1, last_progress=9.0, round=1, round_start=9.0))  # rank 0's clock ahead
    assert early.accounted_until == 4.0


def test_a_job_that_trained_before_it_had_an_account_is_accounted_from_then():
    """Its past (reforms, steps) is not charged to any cause: the account starts at the first one written."""
    reform = Reform(count=3, start=50.0, duration_seconds=5.0)
    first = account(None, facts(100.0, step=40, last_progress=99.0, round=4, round_start=60.0, reform=reform))
    assert first.since == first.accounted_until == 100.0 and first.wall_seconds == 0
    later = account(first, facts(111.0, step=50, last_progress=110.0, round=4, round_start=60.0, reform=reform))
    assert seconds(later) == {"training": 10.0} and later.ratio == 1.0


def _random_facts(rng: random.Random, count: int) -> list[Facts]:
    """A job wandering through every state: queued, starting, training, reforms (some stalled, some without
    stamps), suspensions, and an end; clocks of rank 0 a little off the operator's."""
    out: list[Facts] = [facts(0.0, started=None, training=False)]
    now, step, highest, rnd, reforms, started = 0.0, 0, 0, 0, 0, None
    progress: Optional[float] = None
    round_start: Optional[float] = None
    reform = Reform(count=0)
    blocked = 0.0
    for _ in range(count):
        now = round(now + rng.uniform(0.0, 5.0), 3)
        kind = rng.choice(["train", "train", "train", "suspend", "pending", "reform", "queued"])
        changes: dict[str, object] = {}
        if kind == "queued" and started is None:
            changes = {"started": None, "suspended": rng.random() < 0.5, "training": False}
        elif kind == "suspend":
            started = started if started is not None else now
            changes = {"started": started, "suspended": True, "training": False}
        elif kind == "pending":
            started = started if started is not None else now
            changes = {"started": started, "training": False}
        elif kind == "reform" and rnd:
            reforms += 1
            start = round(now - rng.uniform(0.0, 3.0), 3)
            reform = Reform(count=reforms, start=start)
            out.append(
                facts(
                    now,
                    started=started,
                    step=step,
                    last_progress=progress,
                    round=rnd,
                    reforming=True,
                    training=False,
                    reform=reform,
                    round_start=round_start,
                )
            )
            now = round(now + rng.uniform(0.5, 10.0), 3)
            first = round(now - rng.uniform(0.0, 1.0), 3)
            startup = WorkerStartup(old_exit_first=start + rng.uniform(-1, 1), spawned=start + 1, first_step=first)
            reform = Reform(
                count=reforms,
                start=start,
                duration_seconds=round(max(0.0, first - start), 3),
                phases=compute_phases(start, startup, planned=False) if rng.random() < 0.8 else None,
                reason=rng.choice(["NodeNotReady", "StepStalled", "ScaledDown"]),
            )
            rnd += 1
            round_start = first
            resumed = rng.randint(0, step)
            step = resumed + 1
            progress = first
            changes = {"started": started, "resumed_from_step": resumed, "reform": reform}
        else:
            started = started if started is not None else now
            if rng.random() < 0.2 or not rnd:
                rnd += 1
                round_start = round(now - rng.uniform(0, 1), 3)
                blocked = 0.0
            step += rng.randint(0, 6)
            blocked += rng.uniform(0, 0.5)
            progress = round(now + rng.uniform(-1.0, 0.2), 3)  # rank 0's clock
            changes = {"started": started, "checkpoint_blocked_seconds": blocked}
        highest = max(highest, step)
        base = {"step": step, "last_progress": progress, "round": rnd, "round_start": round_start, "reform": reform}
        out.append(facts(now, **(base | changes)))
    end = round(now + 1.0, 3)
    out.append(
        facts(
            end + 5,
            step=step,
            last_progress=progress,
            round=rnd,
            round_start=round_start,
            reform=reform,
            started=started,
            finished_at=end,
            training=False,
        )
    )
    return out


@pytest.mark.parametrize("seed", range(20))
def test_every_second_is_attributed_once_and_no_cause_shrinks(seed):
    rng = random.Random(seed)
    sequence = _random_facts(rng, 60)
    history = run(*sequence)
    for (before, after), f in zip(itertools.pairwise(history), sequence[1:], strict=True):
        assert_partition(after)
        assert after.accounted_until <= max(f.now, before.accounted_until)
        for cause, value in after.seconds.by_cause().items():
            assert value >= before.seconds.by_cause()[cause] - 1e-9, (cause, before, after)
        assert 0.0 <= after.ratio <= 1.0
    final = history[-1]
    assert final.accounted_until == pytest.approx(sequence[-1].finished_at)
    assert final.wall_seconds == pytest.approx(sequence[-1].finished_at - sequence[0].created)


@pytest.mark.parametrize("seed", range(6))
def test_a_restarted_operator_neither_loses_nor_double_counts(seed):
    """An operator that dies after any reconcile: the next one reads the account from the status and goes on; one
    that misses reconciles (their accounts never written) ends with the same wall time and training share."""
    sequence = _random_facts(random.Random(seed), 60)
    continuous = run(*sequence, reread=False)[-1]
    reread = run(*sequence)[-1]
    assert reread.seconds.by_cause() == pytest.approx(continuous.seconds.by_cause(), abs=1e-6)
    kept = [f for i, f in enumerate(sequence) if i % 3 == 0 or i == len(sequence) - 1]
    sparse = run(*kept)[-1]
    assert sparse.wall_seconds == pytest.approx(continuous.wall_seconds)
    assert_partition(sparse)


def test_the_stall_reason_is_the_reconcile_cores():
    from disttrain.api.conditions import Reason
    from disttrain.api.goodput import STALL_REASON

    assert Reason.STEP_STALLED.value == STALL_REASON
